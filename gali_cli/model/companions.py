"""What transformers reads slowly from a GGUF, its config and tokenizer, kept in the user cache once read.

transformers takes tens of seconds to build a GGUF's tokenizer from its vocabulary (docs/performance.md, "GGUF
weights in their blocks") and seconds for its config; gali reads the weights from the file itself on every load
(gguf_weights.py), so an entry here holds only the rest: the config without its GGUF quantization marker, the
generation config, and the tokenizer with its chat template (tens of MB at most, never a weight), saved as a load
makes it, in the form transformers reads straight into its Rust tokenizer (`_save_as_loaded`). It is named after
the GGUF's identity (path, size, modification time, digest of its first MiB) and the transformers version, built in
a temporary directory and renamed, so a crash never leaves half an entry, and carries a manifest with every file's
size and CRC-32, checked before use: a damaged entry is rebuilt with a warning.

Entries another transformers release wrote are kept (another environment may use them) until they are unused for
`UNUSED_DAYS`, or their GGUF is gone: each build prunes those, and `gali cache prune` prunes every entry this
installation cannot use at once, the float copies of whole models that gali wrote before it read GGUF weights
directly among them. An entry's modification time is the last time gali loaded it.

The cache owns only what it proves it wrote (cache_ownership.py): an entry is built in a workspace whose marker
carries the directory's random token and is renamed whole, marker included; a folder is an entry when that marker
is in it, or when its manifest names the folder after a digest of the GGUF it describes and lists exactly the files
the folder holds (how entries written before the token are known). Anything else in the directory (a model's own
folder, one named like an entry or like a build, one holding a file named like the manifest) is never listed,
pruned or cleared, and is named once in a warning.
"""

import functools
import glob
import hashlib
import json
import os
import shutil
import time
import warnings
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import transformers
from transformers import AutoConfig, AutoTokenizer, GenerationConfig, PreTrainedTokenizerFast

from ..cache_ownership import (
    PARTIAL,
    TOKEN_FILE,
    is_marked,
    known_token,
    leftovers,
    remove_empty_partials,
    user_cache_directory,
    workspace,
    workspaces,
)
from ..errors import GaliWarning, ModelLoadError
from ..printable import some_names
from .gguf import GgufFile

FORMAT = "3"
OLD_FORMATS = {"1": "a float copy of the whole model, which gali no longer uses",  # what gali wrote before
               "2": "a tokenizer that transformers loads through Python copies of its vocabulary"}
MANIFEST = "gali-gguf.json"
CONFIG = "config.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
KIND = "tokenizer"  # where entries of format 1 named their dtype
CACHE = "models"  # this cache's name in the marker of the folders it builds in (cache_ownership.py)
_TRANSFORMERS = f"transformers-{transformers.__version__}"
UNUSED_DAYS = 30  # an entry this installation cannot use, unused this long, goes at the next build


@dataclass(frozen=True)
class ModelEntry:
    """One entry in the cache, as `gali cache list` shows it."""

    path: Path
    gguf: str  # the GGUF file it was read from
    dtype: str  # "tokenizer" for a config and tokenizer; the dtype of a float copy an older gali wrote
    transformers: str  # the release that read it; only that release loads it
    size: int
    last_used: float
    usable: bool  # this installation would load it: its transformers, its GGUF unchanged and present
    damaged: str | None = None  # why its manifest or files are not sound
    obsolete: str | None = None  # what an older gali wrote that this one no longer reads

    @property
    def reason_unusable(self) -> str | None:
        if self.obsolete:
            return self.obsolete
        if self.damaged:
            return f"damaged: {self.damaged}"
        if self.transformers != transformers.__version__:
            return f"written by transformers {self.transformers}"
        return None if self.usable else "its GGUF file is gone or changed"


def default_directory() -> Path:
    """$GALI_MODEL_CACHE, else the platform's user cache directory (e.g. ~/.cache/gali/models on Linux)."""
    return user_cache_directory("models", "GALI_MODEL_CACHE")


class GgufCompanions:
    """Entries in `directory`, one per GGUF file."""

    def __init__(self, directory: Path | None = None, notice: Callable[[str], None] | None = None) -> None:
        self.directory = directory or default_directory()
        self.notice = notice or (lambda message: None)
        self._looked_for_foreign = False

    def check(self) -> None:
        """Refuse at once a cache directory that cannot be one (a file, or a path under a file): a load calls it
        before reading the GGUF, which takes a while, not when the first entry is written."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise self._unwritable(error) from error

    def config(self, gguf: GgufFile):
        """The model's config: from an entry of this file when there is one (instant), else from the GGUF."""
        for entry in self._entries_of(gguf):
            try:
                manifest = _manifest(entry, full=False)
            except ValueError:
                continue  # damaged: directory_for says so and rebuilds it
            if manifest.get("gguf") == gguf.fingerprint():
                return AutoConfig.from_pretrained(entry)
        return _plain(AutoConfig.from_pretrained(gguf.path.parent, gguf_file=gguf.path.name))

    def directory_for(self, gguf: GgufFile) -> Path:
        """A checked entry holding `gguf`'s config and tokenizer; built (and a damaged one, or one an older gali
        wrote, rebuilt) when needed."""
        entry = self.directory / _entry_name(gguf)
        if entry.exists() or entry.is_symlink():
            if _describe(entry, known_token(self.directory)) is None:
                raise ModelLoadError(f"the model cache holds {entry}, which gali did not write, where it keeps "
                                     f"{gguf.path.name}'s tokenizer: move it away, or choose another cache with "
                                     "GALI_MODEL_CACHE")
            if _old_manifest(entry) is not None:  # sound, in an older form: read again, as the first time
                shutil.rmtree(entry, ignore_errors=True)
        if entry.exists() or entry.is_symlink():
            try:
                if _manifest(entry, full=True).get("key") != _key(gguf):
                    raise ValueError("its manifest describes another file")
                with suppress(OSError):
                    os.utime(entry)  # last used now: what pruning goes by
                return entry
            except ValueError as problem:
                warnings.warn(f"the cached tokenizer of {gguf.path.name} in {entry} is damaged ({problem}); "
                              "reading it again", GaliWarning, stacklevel=2)
                shutil.rmtree(entry, ignore_errors=True)
        self.notice(f"Reading {gguf.path.name}'s tokenizer once (it takes a while); later runs load it from "
                    f"{self.directory}")
        self._build(gguf, entry)
        return entry

    def entries(self) -> list[ModelEntry]:
        """Every entry, most recently used first (an unreadable directory holds none), and each build a killed gali
        left unfinished, as an unusable entry (what prune and clear delete). On the way, the empty folders of builds
        killed before they marked them are removed (`remove_empty_partials`)."""
        remove_empty_partials(self.directory)
        token = known_token(self.directory)
        try:
            paths = [path for path in self.directory.iterdir()
                     if path.is_dir() and not path.is_symlink() and not path.name.startswith(PARTIAL)]
        except OSError:
            return []
        entries = [_describe(path, token) for path in paths] + [
            _unfinished(path) for path in leftovers(self.directory, CACHE)]
        return sorted((entry for entry in entries if entry), key=lambda entry: -entry.last_used)

    def foreign(self, entries: list[ModelEntry] | None = None) -> list[Path]:
        """What the directory holds that gali did not write: never listed, pruned or cleared. `entries`: the cache's,
        where the caller has listed them, so that no manifest is read twice in one operation."""
        try:
            found = list(self.directory.iterdir())
        except OSError:
            return []
        entries = self.entries() if entries is None else entries
        ours = ({entry.path for entry in entries} | set(workspaces(self.directory, CACHE))
                | {self.directory / TOKEN_FILE})
        return sorted(path for path in found if path not in ours)

    def warn_about_foreign_files(self, entries: list[ModelEntry] | None = None) -> None:
        """One warning naming what the directory holds that gali did not write (they are left alone); looked for
        once per GgufCompanions (it reads every entry's manifest). `entries`: as `foreign` takes them."""
        if self._looked_for_foreign:
            return
        self._looked_for_foreign = True
        foreign = self.foreign(entries)
        if foreign:
            warnings.warn(f"the model cache {self.directory} also holds {some_names(foreign)}, which gali did not "
                          "write: they are left alone (give the cache a folder of its own: GALI_MODEL_CACHE)",
                          GaliWarning, stacklevel=2)

    def prune(self, unused_seconds: float = 0.0) -> tuple[list[ModelEntry], list[ModelEntry]]:
        """Delete the entries this installation cannot use (another transformers release, a GGUF gone or changed,
        damaged) that have been unused for `unused_seconds`; returns (deleted, those that could not be)."""
        self.warn_about_foreign_files()
        return _remove(_stale(self.entries(), unused_seconds))

    def clear(self) -> tuple[list[ModelEntry], list[ModelEntry]]:
        """Delete every entry (a later load dequantizes again); returns (deleted, those that could not be)."""
        self.warn_about_foreign_files()
        return _remove(self.entries())

    def _unwritable(self, error: OSError) -> ModelLoadError:
        """The one-line error for a cache directory gali cannot write in."""
        reason = error.strerror or str(error)
        if isinstance(error, FileExistsError) or self.directory.is_file():
            reason = "it is a file, not a directory"
        return ModelLoadError(f"cannot write the model cache in {self.directory}: {reason} (GALI_MODEL_CACHE "
                              "chooses another place)")

    def _entries_of(self, gguf: GgufFile) -> list[Path]:
        """This installation's entries of `gguf` that gali wrote."""
        token = known_token(self.directory)
        try:
            found = sorted(self.directory.glob(f"{glob.escape(_stem(gguf))}.*.{_TRANSFORMERS}"))
        except OSError:
            return []
        return [path for path in found if _describe(path, token) is not None]

    def _build(self, gguf: GgufFile, entry: Path) -> None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            entries = self.entries()  # listed once (each manifest read once): what goes, what is foreign
            left = _remove_leftovers(gguf, entries)
            self.warn_about_foreign_files(entries)  # all of them: one whose removal failed is still gali's
            _remove(_stale(left, UNUSED_DAYS * 86400))  # as prune(UNUSED_DAYS * 86400) would
            # built in a workspace this process locks and marks as gali's, renamed whole into the entry, marker
            # and all; also on Ctrl-C no half entry stays (after kill -9, the next build or prune deletes it)
            with workspace(self.directory, CACHE) as temporary:
                _read_into(gguf, temporary)
                _write_manifest(temporary, _key(gguf), gguf)
                try:
                    os.rename(temporary, entry)
                except OSError:
                    if not entry.exists():
                        raise
                    # another gali built the same entry meanwhile: theirs serves
        except OSError as error:  # e.g. a full disk
            raise self._unwritable(error) from error


def _read_into(gguf: GgufFile, directory: Path) -> None:
    """Read `gguf`'s config and tokenizer with transformers' own GGUF support and write them as transformers files."""
    folder, name = gguf.path.parent, gguf.path.name
    try:
        with _quiet_reading():
            config = AutoConfig.from_pretrained(folder, gguf_file=name, trust_remote_code=False)
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, trust_remote_code=False)
    except (OSError, ValueError, KeyError, IndexError, TypeError, RuntimeError, NotImplementedError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ModelLoadError(f"transformers cannot read {gguf.path}: {reason}") from error
    _plain(config).save_pretrained(directory)
    GenerationConfig.from_model_config(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    del tokenizer  # transformers' reading of the GGUF's vocabulary: hundreds of MB for Gemma's
    _save_as_loaded(directory)


def _save_as_loaded(directory: Path) -> None:
    """Save the tokenizer in `directory` again as a load makes it, in the form that loads without a Python copy of
    its vocabulary. The class transformers names for a GGUF's tokenizer (GemmaTokenizer, Qwen2Tokenizer, ...)
    rebuilds its pipeline at each load from Python lists of the vocabulary and merges, which it keeps, and a config
    without the added tokens makes transformers parse the whole tokenizer.json in Python for them (Gemma 3's 262,144
    tokens and 514,906 merges: 0.3 GB more at the peak, 13 s; docs/performance.md). Saved once as loaded, with its
    added tokens and class settings in the config, it is the same tokenizer (the same pipeline, so the same ids),
    which transformers' generic class (PreTrainedTokenizerFast) reads straight into the Rust tokenizer."""
    loaded = AutoTokenizer.from_pretrained(directory, trust_remote_code=False)
    loaded.save_pretrained(directory)  # tokenizer.json: the pipeline the class built
    path = directory / TOKENIZER_CONFIG
    settings = json.loads(path.read_text(encoding="utf-8"))
    settings.update(tokenizer_class=PreTrainedTokenizerFast.__name__, padding_side=loaded.padding_side,
                    model_input_names=loaded.model_input_names,
                    added_tokens_decoder={str(index): token.__getstate__()
                                          for index, token in loaded.added_tokens_decoder.items()})
    path.write_text(json.dumps(settings, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


@contextmanager
def _quiet_reading() -> Iterator[None]:
    """transformers' GGUF reader draws its own tqdm bar on stderr, which transformers' progress switch does not
    reach; silence it for the duration (the caller has said that reading is under way)."""
    import transformers.modeling_gguf_pytorch_utils as module

    original = getattr(module, "tqdm", None)
    if original is None:
        yield
        return
    module.tqdm = functools.partial(original, disable=True)
    try:
        yield
    finally:
        module.tqdm = original


def _plain(config):
    """`config` without transformers' GGUF quantization marker: gali reads the weights itself."""
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    return config


def _write_manifest(directory: Path, key: str, gguf: GgufFile) -> None:
    files = {}
    for path in sorted(directory.iterdir()):
        with open(path, "rb") as file:
            os.fsync(file.fileno())
        files[path.name] = {"size": path.stat().st_size, "crc32": _crc32(path)}
    manifest = {"format": FORMAT, "key": key, "gguf": gguf.fingerprint(), "dtype": KIND,
                "transformers": transformers.__version__, "files": files}
    with open(directory / MANIFEST, "w") as file:
        json.dump(manifest, file, indent=1)
        file.flush()
        os.fsync(file.fileno())


def _manifest(entry: Path, full: bool) -> dict:
    """The entry's manifest, after checking that its files are those it lists, with the sizes (and with `full`,
    the CRC-32s) written; raises ValueError saying what is wrong."""
    try:
        manifest = json.loads((entry / MANIFEST).read_text())
        files = manifest["files"]
        if manifest.get("format") != FORMAT or CONFIG not in files:
            raise ValueError(f"{MANIFEST} is not one gali {FORMAT} wrote")
        for name, facts in files.items():
            size = (entry / name).stat().st_size
            if size != facts["size"]:
                raise ValueError(f"{name} has {size} bytes, {facts['size']} were written")
            if full and _crc32(entry / name) != facts["crc32"]:
                raise ValueError(f"{name} does not hold what was written (CRC-32)")
    except FileNotFoundError as error:
        raise ValueError(f"{Path(error.filename).name} is missing") from None
    except (OSError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as error:
        raise ValueError(f"{MANIFEST} is unreadable ({type(error).__name__}: {error})") from None
    return manifest


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as file:
        while block := file.read(2**24):
            crc = zlib.crc32(block, crc)
    return crc


def _key(gguf: GgufFile) -> str:
    """What an entry depends on: the GGUF and the transformers that read it."""
    return hashlib.sha256(json.dumps({"gguf": gguf.fingerprint(), "kind": KIND,
                                      "transformers": transformers.__version__}, sort_keys=True).encode()).hexdigest()


def _stem(gguf: GgufFile) -> str:
    """Entries of one GGUF file share this prefix: its name and a digest of its identity."""
    return _stem_of(gguf.fingerprint())


def _stem_of(fingerprint: dict) -> str:
    identity = hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:16]
    return f"{Path(fingerprint['path']).stem}-{identity}"


def _entry_name(gguf: GgufFile) -> str:
    return f"{_stem(gguf)}.{KIND}.{_TRANSFORMERS}"


def _remove_leftovers(gguf: GgufFile, entries: list[ModelEntry]) -> list[ModelEntry]:
    """Delete, of `entries` (as `GgufCompanions.entries` lists them: only what gali proves it wrote), the builds a
    killed gali left and the entries of an earlier file at the same path (replaced since); returns the others."""
    left = []
    for entry in entries:
        if entry.path.name.startswith(PARTIAL) or (  # only a killed build is listed under a workspace's name
                entry.gguf == str(gguf.path) and entry.path.name.startswith(f"{gguf.path.stem}-")
                and not entry.path.name.startswith(_stem(gguf))):
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            left.append(entry)
    return left


def _stale(entries: list[ModelEntry], unused_seconds: float) -> list[ModelEntry]:
    """The `entries` this installation cannot use that have been unused for `unused_seconds`: what prune deletes."""
    stale = time.time() - unused_seconds
    return [entry for entry in entries if not entry.usable and entry.last_used <= stale]


def _remove(entries: list[ModelEntry]) -> tuple[list[ModelEntry], list[ModelEntry]]:
    for entry in entries:
        shutil.rmtree(entry.path, ignore_errors=True)
    return ([entry for entry in entries if not entry.path.exists()],
            [entry for entry in entries if entry.path.exists()])


def _unfinished(path: Path) -> ModelEntry | None:
    """A build a killed gali left, as an unusable entry (what prune and clear delete)."""
    try:
        size = sum(file.stat().st_size for file in path.iterdir())
        last_used = path.stat().st_mtime
    except OSError:
        return None
    return ModelEntry(path, "?", "?", "?", size, last_used, False, "an unfinished build; the gali writing it was "
                                                                     "killed")


def _describe(path: Path, token: str | None) -> ModelEntry | None:
    """What `path` holds, from its manifest (sizes checked, not CRCs: listing stays fast); None for what gali cannot
    prove it wrote (`_ours`)."""
    if not _ours(path, token):
        return None
    try:
        size = sum(file.stat().st_size for file in path.iterdir())
        last_used = path.stat().st_mtime
    except OSError:
        return None
    obsolete = _old_manifest(path)
    if obsolete is not None:
        source = obsolete.get("gguf") or {}
        kind = str(obsolete.get("dtype", "?"))
        return ModelEntry(path, str(source.get("path", "?")), kind if kind == KIND else f"{kind} copy",
                          str(obsolete.get("transformers", "?")), size, last_used, False,
                          obsolete=f"written by an older gali: {OLD_FORMATS[obsolete['format']]}")
    try:
        manifest = _manifest(path, full=False)
    except ValueError as problem:
        return ModelEntry(path, "?", "?", path.name.rpartition(".transformers-")[2] or "?", size, last_used, False,
                          str(problem))
    source = manifest.get("gguf") or {}
    release = str(manifest.get("transformers", "?"))
    usable = release == transformers.__version__ and _unchanged(source)
    return ModelEntry(path, str(source.get("path", "?")), str(manifest.get("dtype", "?")), release, size, last_used,
                      usable)


def _ours(path: Path, token: str | None) -> bool:
    """Whether gali wrote the folder `path`: it holds the marker of this cache with the directory's `token`, or it
    is an entry written before the token, whose manifest names the folder after the digest of the GGUF it describes
    and lists exactly the files the folder holds (which a user's folder does not by accident)."""
    if path.is_symlink() or not path.is_dir():
        return False
    if is_marked(path, token, CACHE):
        return True
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        named = f"{_stem_of(manifest['gguf'])}.{manifest['dtype']}.transformers-{manifest['transformers']}"
        listed = set(manifest["files"]) | {MANIFEST}
        held = {file.name for file in path.iterdir()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False
    return manifest.get("format") in {FORMAT, *OLD_FORMATS} and named == path.name and held == listed


def _old_manifest(path: Path) -> dict | None:
    """The manifest of an entry an older gali wrote (a format of OLD_FORMATS), else None."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and manifest.get("format") in OLD_FORMATS else None


def _unchanged(source: dict) -> bool:
    """The GGUF an entry was made from is still there, with the size and modification time it had."""
    try:
        status = os.stat(source["path"])
    except (OSError, KeyError, TypeError, ValueError):
        return False
    return status.st_size == source.get("size") and status.st_mtime_ns == source.get("mtime_ns")
