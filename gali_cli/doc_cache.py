"""The document cache: a document's prefilled keys and values kept on disk, so the next question skips the prefill.

Prompts put the document first (prompts.py), so every question about it shares the tokens up to where the
instruction starts, and their keys and values do not depend on what follows (attention is causal, and the prefill
is always cut there, cached or not). An entry holds one document's K/V for one model and method with its settings;
document_states.py names entries and decides when to load and store them, for `gali ask`/`chat` and `gali serve`
alike.

Entries are safetensors files (plain tensors, no pickled objects) named by a SHA-256 of everything the K/V depend
on; they are written to a temporary file and renamed, so a crash or a full disk never leaves half an entry, and are
checked on load (format version, key, token hash, shapes, dtype, and a CRC-32 of every tensor's bytes): a file that
fails is ignored, deleted and rebuilt. Least recently used entries go first when the directory grows past its size
limit, which counts what running writers are writing and deletes what killed ones left.

The cache owns only what it proves it wrote (cache_ownership.py): users point `--cache-dir` at folders that hold
models, and `clear`, eviction and a damaged-entry rebuild must never touch those. A file is an entry when its
safetensors header carries the directory's random token and the key its name carries (`_owned`; entries written
before the token carry gali's name and the key alone); a write's temporary folder is gali's when its marker carries
the token, never because of its name or extension. Anything else in the directory is left alone, and named once in
a warning. The one file a lookup replaces when it is damaged is the one at the path its key names: a SHA-256 of the
document and its settings, which only gali computes.

Why CRC-32: the checksum guards against damage (a disk, a copy, a stray write), not against someone who can write the
cache directory (they could rewrite any digest stored beside the data). CRC-32 catches every burst of up to 32 bits
and any other damage but one in 2^32, and zlib computes it several times faster than SHA-256 or BLAKE2b; each
tensor is checked on its own thread (zlib lets go of the GIL), so more cores check faster. docs/performance.md ("The
document cache's checksums") has those rates and its cost against a prefill.
"""

import hashlib
import json
import os
import shutil
import stat
import zlib
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from transformers import DynamicCache, PreTrainedModel

from .cache_ownership import (
    TOKEN_FILE,
    cache_token,
    known_token,
    leftovers,
    remove_empty_partials,
    user_cache_directory,
    workspace,
    workspaces,
)
from .config import parse_size
from .engine.seam.kv_cache import new_cache
from .engine.seam.packed_modules import module_device
from .printable import encodable, some_names

FORMAT = "2"  # 2: with checksums
WRITER = "gali document cache"  # every entry's header says so (entries written before it carry their key alone)
SUFFIX = ".safetensors"
KIND = "documents"  # this cache's name in the marker of the folders it writes in (cache_ownership.py)
LEFTOVER = "(an unfinished write; the gali writing it was killed)"  # how a killed writer's folder is listed
DEFAULT_LIMIT = 20 * 2**30


def default_directory() -> Path:
    """$GALI_CACHE_DIR, else the platform's user cache directory (e.g. ~/.cache/gali/documents on Linux)."""
    return user_cache_directory("documents", "GALI_CACHE_DIR")


def default_limit() -> int:
    """$GALI_CACHE_LIMIT (e.g. 20G), else 20 GiB."""
    limit = os.environ.get("GALI_CACHE_LIMIT")
    return parse_size(limit, "GALI_CACHE_LIMIT") if limit else DEFAULT_LIMIT


def entry_key(identity: dict, prefix_ids: list[int]) -> str:
    """A name for the K/V of `prefix_ids` under `identity` (model, weights, dtype, method, settings, versions)."""
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode())
    digest.update(_ids_digest(prefix_ids).encode())
    return digest.hexdigest()


def _ids_digest(ids: list[int]) -> str:
    return hashlib.sha256(torch.tensor(ids, dtype=torch.int64).numpy().tobytes()).hexdigest()


@dataclass(frozen=True)
class Entry:
    """One cached document, as `gali cache list` shows it."""

    path: Path
    size: int
    last_used: float
    tokens: int
    document: str
    model: str
    method: str
    identity: dict  # what the state depends on (versions, weights, dtype, settings, cuts); {} in older entries

    def differences(self, others: list["Entry"]) -> str:
        """What sets this entry apart from the others of the same document, model and method (which look the same
        in a list): the fields of their identities that differ, as "field value" ("" when none does)."""
        alike = [other.identity for other in others if other is not self and
                 (other.document, other.model, other.method) == (self.document, self.model, self.method)]
        mine = _flat(self.identity)
        fields = sorted({field for other in alike for field, value in {**mine, **_flat(other)}.items()
                         if mine.get(field) != _flat(other).get(field)})
        return ", ".join(f"{field} {mine.get(field, '?')}" for field in fields)


def _flat(identity: dict, prefix: str = "") -> dict[str, str]:
    """{"settings": {"chunk_size": 64}} -> {"chunk_size": "64"}: the leaves of an identity, by their own names."""
    flat = {}
    for name, value in identity.items():
        if isinstance(value, dict):
            flat |= _flat(value, f"{name}.")
        else:
            flat[name if name not in flat else f"{prefix}{name}"] = str(value)
    return flat


@dataclass(frozen=True)
class Cleared:
    """What `DocumentCache.clear` did: the files it removed, with their sizes, and those it could not, with why."""

    removed: tuple[tuple[Path, int], ...]
    kept: tuple[tuple[Path, int, str], ...]

    @property
    def removed_bytes(self) -> int:
        return sum(size for _, size in self.removed)

    @property
    def kept_bytes(self) -> int:
        return sum(size for _, size, _ in self.kept)


class DocumentCache:
    """Prefilled document states in `directory`, at most `limit` bytes in all."""

    def __init__(self, directory: Path, limit: int, warn: Callable[[str], None]) -> None:
        self.directory = directory
        self.limit = limit
        self.warn = warn
        self._looked_for_foreign = False

    def path(self, key: str) -> Path:
        return self.directory / f"{key}{SUFFIX}"

    def load(self, key: str, prefix_ids: list[int], model: PreTrainedModel, kv_dtype: torch.dtype | None = None
             ) -> DynamicCache | None:
        """The cached K/V of `prefix_ids` as a DynamicCache on the model's devices, or None (absent or unusable);
        `kv_dtype`: the dtype the cache stores them in (kv_cache.new_cache), which the entry's tensors must have."""
        path = self.path(key)
        try:
            status = path.stat()
        except FileNotFoundError:
            return None
        except OSError as error:
            self.warn(f"cannot read the document cache in {self.directory}: {error}")
            return None
        if not stat.S_ISREG(status.st_mode):  # a FIFO would block the open forever; a folder is no entry
            self.warn(f"ignoring {path}: not a regular file (the document will be read again, and not cached)")
            return None
        inode = status.st_ino
        try:
            with safe_open(path, framework="pt") as file:  # one handle: a concurrent replace cannot mix two files
                metadata = file.metadata() or {}
                _check_metadata(metadata, key, prefix_ids)
                tensors = {name: file.get_tensor(name) for name in file.keys()}  # noqa: SIM118 - not iterable
            _check_tensors(tensors, len(prefix_ids), model, json.loads(metadata.get("crc32", "{}")), kv_dtype)
        except FileNotFoundError:
            return None  # evicted by another gali meanwhile
        except (OSError, SafetensorError, ValueError, KeyError, TypeError, AttributeError) as error:
            self.warn(f"ignoring the damaged document cache entry {path}: {error}; it will be rebuilt")
            _unlink_if_same(path, inode)
            return None
        try:
            os.utime(path)  # recently used: evicted last
        except OSError:
            pass  # a read-only cache still serves
        cache = new_cache(model, kv_dtype)  # the rows as they were stored: no conversion, and no copy back
        for layer, attention in enumerate(layer.self_attn for layer in model.model.layers):
            device = module_device(attention.k_proj)  # with device_map="auto", layers live on different GPUs
            cache.update(tensors[f"keys.{layer}"].to(device), tensors[f"values.{layer}"].to(device), layer)
        return cache

    def save(self, key: str, prefix_ids: list[int], cache: DynamicCache, description: dict[str, str]) -> None:
        """Store the first len(prefix_ids) tokens' K/V of `cache`, in the dtype it stores them in (a 16-bit cache's
        entry is half the size); a failure (e.g. a full disk) only warns."""
        tokens = len(prefix_ids)
        tensors = {}
        for layer, state in enumerate(cache.layers):
            tensors[f"keys.{layer}"] = state.keys[:, :, :tokens].contiguous().cpu()
            tensors[f"values.{layer}"] = state.values[:, :, :tokens].contiguous().cpu()
        size = sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
        if size > self.limit:
            self.warn(f"not caching the document: its state takes {size / 2**30:.2f} GiB, more than the cache "
                      f"limit of {self.limit / 2**30:.2f} GiB (GALI_CACHE_LIMIT)")
            return
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            metadata = {"format": FORMAT, "writer": WRITER, "owner": cache_token(self.directory), "key": key,
                        "tokens": str(tokens), "ids_sha256": _ids_digest(prefix_ids),
                        "crc32": json.dumps(checksums(tensors)),
                        **{name: encodable(value) for name, value in description.items()}}  # a name not UTF-8
            self._evict(keep=self.limit - size)
            # written in a folder of its own, which this process locks (safetensors replaces the file it writes,
            # so a lock on the file itself would not last) and marks as gali's: no other gali takes it for a
            # killed writer's leftover, and after kill -9 the next one deletes it, whatever safetensors left in it
            with workspace(self.directory, KIND) as temporary:
                written = temporary / f"{key}{SUFFIX}"
                save_file(tensors, written, metadata)
                with open(written, "rb") as file:
                    os.fsync(file.fileno())
                os.replace(written, self.path(key))
            _fsync_directory(self.directory)
        except (OSError, SafetensorError) as error:
            self.warn(f"could not write the document cache in {self.directory}: {error}")

    def entries(self) -> list[Entry]:
        """Every entry, most recently used first, and what a killed gali left of a write (LEFTOVER); a file gali did
        not write is no entry (it is named in one warning: `foreign`). On the way, the empty folders of writers
        killed before they marked them are removed (`remove_empty_partials`)."""
        return self._entries(list(self._owned_files()))

    def _entries(self, owned: list[tuple[Path, dict[str, str]]]) -> list[Entry]:
        """`entries`, of the files gali wrote as the caller listed them (`_owned_files`: no header is read again)."""
        remove_empty_partials(self.directory)
        found = []
        for path in leftovers(self.directory, KIND):
            try:
                stat = path.stat()
            except OSError:
                continue  # gone meanwhile
            found.append(Entry(path, _size(path), stat.st_mtime, 0, LEFTOVER, "?", "?", {}))
        for path, metadata in owned:
            try:
                stat = path.stat()
            except OSError:
                continue
            try:
                tokens = int(metadata.get("tokens", 0))
            except (ValueError, TypeError):
                tokens = 0
            found.append(Entry(path, stat.st_size, stat.st_mtime, tokens, str(metadata.get("document", "?")),
                               str(metadata.get("model", "?")), str(metadata.get("method", "?")),
                               _identity(metadata)))
        return sorted(found, key=lambda entry: entry.last_used, reverse=True)

    def foreign(self, owned: list[tuple[Path, dict[str, str]]] | None = None) -> list[Path]:
        """What the directory holds that gali did not write (a model's files, say), largest first: never listed,
        moved or deleted. `owned`: the files gali wrote where the caller has listed them (`_owned_files`), so that
        no header is read twice in one operation."""
        try:
            with os.scandir(self.directory) as found:
                names = [Path(entry.path) for entry in found]
        except OSError:
            return []
        owned = self._owned_files() if owned is None else owned
        ours = ({path for path, _ in owned} | set(workspaces(self.directory, KIND))
                | {self.directory / TOKEN_FILE})
        return sorted((path for path in names if path not in ours), key=lambda path: (-_size(path), path.name))

    def warn_about_foreign_files(self, owned: list[tuple[Path, dict[str, str]]] | None = None) -> None:
        """One warning naming the files in the directory that are not the cache's; looked for once per DocumentCache
        (every save would read every entry's header again). `owned`: as `foreign` takes it."""
        if self._looked_for_foreign:
            return
        self._looked_for_foreign = True
        foreign = self.foreign(owned)
        if foreign:
            self.warn(f"the document cache directory {self.directory} also holds {some_names(foreign)}, which gali did "
                      "not write: they are left alone (give the cache a folder of its own: --cache-dir, "
                      "GALI_CACHE_DIR)")

    def clear(self) -> Cleared:
        """Delete every entry (and what killed writers left); says what was removed and what could not be. What a
        running gali is writing is left to it, and what gali did not write is never touched."""
        removed, kept = [], []
        try:
            self._files(strict=True)
        except FileNotFoundError:
            return Cleared((), ())
        except OSError as error:
            return Cleared((), ((self.directory, 0, error.strerror or str(error)),))
        owned = list(self._owned_files())  # each header read once: for the warning and the entries
        self.warn_about_foreign_files(owned)
        for entry in self._entries(owned):
            try:
                _remove(entry.path)
                removed.append((entry.path, entry.size))
            except FileNotFoundError:
                continue
            except OSError as error:
                kept.append((entry.path, entry.size, error.strerror or str(error)))
        return Cleared(tuple(removed), tuple(kept))

    def _files(self, strict: bool = False) -> list[Path]:
        """The regular files in the directory with an entry's suffix (whether they are ours, _owned_files says); an
        unreadable directory has none, or with `strict` raises OSError."""
        try:
            with os.scandir(self.directory) as found:
                return [Path(entry.path) for entry in found
                        if entry.name.endswith(SUFFIX) and entry.is_file(follow_symlinks=False)]
        except OSError:
            if strict:
                raise
            return []

    def _owned_files(self) -> Iterable[tuple[Path, dict[str, str]]]:
        """The entries gali wrote, with their metadata: their header carries the cache's token and their key."""
        token = known_token(self.directory)
        for path in self._files():
            metadata = _owned(path, token)
            if metadata is not None:
                yield path, metadata

    def _evict(self, keep: int) -> None:
        """Delete what killed writers left, then least recently used entries until the others, with what running
        writers are writing, take at most `keep` bytes. Files gali did not write are neither counted nor touched."""
        owned = list(self._owned_files())  # each header read once: for the warning and the entries
        self.warn_about_foreign_files(owned)
        entries = []
        for entry in self._entries(owned):
            if entry.document == LEFTOVER:
                with suppress(OSError):
                    _remove(entry.path)
            else:
                entries.append(entry)
        total = sum(_size(path) for path in workspaces(self.directory, KIND)) + sum(entry.size for entry in entries)
        for entry in reversed(entries):
            if total <= keep:
                break
            entry.path.unlink(missing_ok=True)
            total -= entry.size


def _owned(path: Path, token: str | None) -> dict[str, str] | None:
    """The metadata of the entry at `path` when gali wrote it: its header names the key its file is named by (a
    SHA-256), and carries the cache's `token`, or, in entries written before the token was recorded, gali as its
    writer (or the format and the token digest). None for anything else, or a header that cannot be read."""
    try:
        metadata = _metadata(path)
    except (OSError, SafetensorError, ValueError, TypeError, AttributeError):
        return None
    if not isinstance(metadata, dict) or metadata.get("key") != path.name.removesuffix(SUFFIX):
        return None
    if "owner" in metadata:
        return metadata if token is not None and metadata["owner"] == token else None
    if metadata.get("writer") == WRITER or ("format" in metadata and "ids_sha256" in metadata):
        return metadata
    return None


def _size(path: Path) -> int:
    """The bytes a file, or a folder's files, take (0 for one gone meanwhile: renamed into an entry, or deleted)."""
    try:
        return sum(file.stat().st_size for file in path.iterdir()) if path.is_dir() else path.stat().st_size
    except OSError:
        return 0


def _remove(path: Path) -> None:
    """Delete an entry, or a leftover folder with what it holds; OSError says why not."""
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink()


def _identity(metadata: dict[str, str]) -> dict:
    try:
        identity = json.loads(metadata.get("identity", "{}"))
    except json.JSONDecodeError:
        return {}
    return identity if isinstance(identity, dict) else {}


def _metadata(path: Path) -> dict[str, str]:
    """The entry's metadata, from the safetensors header (the tensors are not read)."""
    with safe_open(path, framework="pt") as file:
        return file.metadata() or {}


def _check_metadata(metadata: dict[str, str], key: str, prefix_ids: list[int]) -> None:
    """Raise ValueError unless the entry says it holds the K/V of exactly `prefix_ids` under `key`."""
    if metadata.get("format") != FORMAT:
        raise ValueError(f"format {metadata.get('format')!r}, expected {FORMAT}")
    if metadata.get("key") != key or metadata.get("ids_sha256") != _ids_digest(prefix_ids):
        raise ValueError("it belongs to another document or setting")


def checksums(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """The CRC-32 of each tensor's bytes (contiguous CPU tensors), as 8 hex digits; computed in threads."""
    with ThreadPoolExecutor() as pool:
        return dict(zip(tensors, pool.map(_crc32, tensors.values())))


def _crc32(tensor: torch.Tensor) -> str:
    return f"{zlib.crc32(tensor.reshape(-1).view(torch.uint8).numpy()):08x}"


def _check_tensors(tensors: dict[str, torch.Tensor], tokens: int, model: PreTrainedModel, expected_sums: dict,
                   kv_dtype: torch.dtype | None = None) -> None:
    """Raise ValueError unless `tensors` are the keys and values of `tokens` tokens for every layer of `model`, with
    the bytes they were saved with, all of one dtype: `kv_dtype` where it is given."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    expected = (1, config.num_key_value_heads, tokens, head_dim)
    names = {f"{kind}.{layer}" for kind in ("keys", "values") for layer in range(config.num_hidden_layers)}
    if set(tensors) != names:
        raise ValueError(f"its tensors are not the keys and values of {config.num_hidden_layers} layers")
    dtype = kv_dtype or next(iter(tensors.values())).dtype
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != expected or tensor.dtype != dtype:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)} {tensor.dtype}, expected {expected} {dtype}")
    for name, found in checksums(tensors).items():
        if expected_sums.get(name) != found:
            raise ValueError(f"the data of {name} does not match its checksum")


def _unlink_if_same(path: Path, inode: int) -> None:
    """Delete `path` unless another process has replaced it since we looked (then the new file is not ours to judge)."""
    try:
        if path.stat().st_ino == inode:
            path.unlink()
    except OSError:
        pass


def _fsync_directory(directory: Path) -> None:
    """Make a rename durable (POSIX); a no-op where directories cannot be opened (Windows)."""
    try:
        handle = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(handle)
    except OSError:
        pass
    finally:
        os.close(handle)
