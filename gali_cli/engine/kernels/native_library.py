"""The native library: every native kernel, one C file each (SOURCES: the noisy softmax, native_noise.c, for
native_noise.py; the decoding step, native_decode.c, for native_decode.py; the byte-grid products, native_grids.c, for
engine/seam/grid_weights.py and packed_modules.py; what they share, native_common.h), built together on first use by
the system's C compiler into one library and loaded with ctypes; and their rows shared among threads.

The library is compiled by `$CC`, else `cc`, into the user cache directory (~/.cache/gali/kernels on Linux), keyed by
its files (BUILT_FROM), compiler and CPU: a fraction of a second, once per machine. A compiler that fails or hangs is
remembered beside it, so it costs one run its wait; each kernel's caller holds it to the PyTorch path before first
use, and a machine without a working compiler gets one warning and the PyTorch path.
"""

import ctypes
import functools
import hashlib
import itertools
import os
import platform
import signal
import subprocess
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ...cache_ownership import user_cache_directory
from ...errors import GaliError
from ..math.noise import GOLDEN, MULTIPLIER_A, MULTIPLIER_B
from .kernel_choice import compiler

_HERE = Path(__file__).parent
# One C file a kernel family, compiled together (one compiler run) into one library; each includes HEADER.
SOURCES = tuple(_HERE / name for name in ("native_noise.c", "native_decode.c", "native_grids.c"))
HEADER = _HERE / "native_common.h"  # what the kernels share: the noise's math, the vector types
BUILT_FROM = (*SOURCES, HEADER)  # every file the library is made of: each is in its cache key, and in the wheel
# -fno-math-errno, -fno-trapping-math: sqrt and comparisons become plain vector instructions (no errno, no traps).
# The noise hash's constants come from math/noise.py, its one definition.
_FLAGS = ["-O3", "-fno-math-errno", "-fno-trapping-math", "-shared", "-fPIC", f"-DGALI_MULTIPLIER_A={MULTIPLIER_A:#x}u",
          f"-DGALI_MULTIPLIER_B={MULTIPLIER_B:#x}u", f"-DGALI_GOLDEN={GOLDEN:#x}u"]
# Tried in this order, first with OpenMP: a library that uses it links the OpenMP runtime torch has loaded (libgomp,
# by its name), so the kernel's rows go to torch's own idle threads; a second pool of threads would compete with
# them (torch's threads keep spinning for a while after each op). Apple's compiler has no -fopenmp.
_OPENMP = (["-fopenmp"], [])
_NATIVE_CPU = (["-march=native"], [])  # a compiler that does not know it builds for the generic CPU


class KernelBuildError(GaliError):
    """The native library could not be compiled or loaded here."""


def kernel_directory() -> Path:
    """Where compiled kernels are kept: the user cache's kernels folder."""
    return user_cache_directory("kernels")


@dataclass(frozen=True)
class Kernel:
    """The loaded C functions (`gali_noisy_softmax`; `gali_decode_attention` and `gali_merge_runs`;
    `gali_grid_pack`, `gali_grid_matvec` and `gali_grid_unpack`), whether they share their work among threads
    themselves (OpenMP), and whether the grid products were built for vector registers that make them pay
    (`grid_vectorised`)."""

    function: ctypes._CFuncPtr
    threaded: bool
    decode: ctypes._CFuncPtr
    merge_runs: ctypes._CFuncPtr
    grid_pack: ctypes._CFuncPtr
    grid_matvec: ctypes._CFuncPtr
    grid_unpack: ctypes._CFuncPtr
    grid_vectorised: bool


@functools.cache
def load_kernel() -> Kernel:
    """The kernel, compiled on first use (once per machine: the library is kept)."""
    command = compiler()
    identity = hashlib.sha256(_sources() + repr((command, _FLAGS, _cpu_identity())).encode()).hexdigest()[:16]
    library = kernel_directory() / f"native-{identity}{'.dylib' if platform.system() == 'Darwin' else '.so'}"
    if not library.exists():
        _build(command, library)
    try:
        loaded = ctypes.CDLL(str(library))
        function, threaded = loaded.gali_noisy_softmax, loaded.gali_noisy_softmax_threaded
        decode, merge_runs = loaded.gali_decode_attention, loaded.gali_merge_runs
        grid_pack, grid_matvec, grid_unpack = loaded.gali_grid_pack, loaded.gali_grid_matvec, loaded.gali_grid_unpack
        grid_vectorised = loaded.gali_grid_vectorised
    except (OSError, AttributeError) as error:
        raise KernelBuildError(f"cannot load {library}: {error}") from error
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    int32 = ctypes.c_int32
    function.argtypes = [pointer, size, size, ctypes.c_float, pointer, size, size, size, pointer, int32, int32,
                         ctypes.c_float, size, size, pointer, pointer, ctypes.c_int]
    function.restype = None
    decode.argtypes = [pointer, size, size, size, pointer, size, size, size, pointer, size, size, size, ctypes.c_int,
                       pointer, pointer, size, pointer, pointer, pointer, pointer, size, size, size, size,
                       ctypes.c_float, size, size, size, pointer, pointer, ctypes.c_int]
    decode.restype = None
    merge_runs.argtypes = [pointer, pointer, size, size, size, size, pointer]
    merge_runs.restype = None
    grid_pack.argtypes = [pointer, size, size, size, ctypes.c_float, pointer, pointer, pointer, ctypes.c_int]
    grid_pack.restype = size
    grid_matvec.argtypes = [pointer, size, size, pointer, ctypes.c_float, pointer, pointer, pointer, size, size,
                            ctypes.c_int, ctypes.c_int, size, size, pointer, ctypes.c_int]
    grid_matvec.restype = ctypes.c_int
    grid_unpack.argtypes = [pointer, pointer, pointer, size, size, size, size, size, pointer, ctypes.c_int]
    grid_unpack.restype = None
    threaded.restype = grid_vectorised.restype = ctypes.c_int
    return Kernel(function, bool(threaded()), decode, merge_runs, grid_pack, grid_matvec, grid_unpack,
                  bool(grid_vectorised()))


def _sources() -> bytes:
    """Every file of BUILT_FROM, each by its name, length and bytes: an edit to any of them (or a file added, removed
    or renamed) is a new library, and no library built from other files (the single C file of before) matches
    its key."""
    framed = []
    for path in BUILT_FROM:
        text = path.read_bytes()
        framed.append(f"{path.name} {len(text)}\n".encode() + text)
    return b"".join(framed)


def _build(command: list[str], library: Path) -> None:
    """Compile the kernels (SOURCES, in one compiler run) into `library`, atomically (a half-written library is
    never loaded): with OpenMP and for this CPU where the compiler can, else without them. Each compile is bounded
    (`_compile`), and a compiler that hung or failed is remembered beside the library (`_failure_note`): it cost one
    run its wait, not every run (a `$CC` that hung stalled each run 120 s per attempt). Messages stay whole in the
    callers' 200-character warnings."""
    note = _failure_note(library)
    if (remembered := _remembered(note)) is not None:
        raise KernelBuildError(f"in an earlier run, {remembered}; not run again: rm {_home(note)} to retry")
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
        built = Path(scratch) / library.name
        errors = []
        for extra in itertools.product(_OPENMP, _NATIVE_CPU):
            failure = _compile([*command, *_FLAGS, *extra[0], *extra[1], "-o", str(built), *map(str, SOURCES)],
                               command)
            if failure is None:
                os.replace(built, library)
                return
            if failure.startswith(_NO_COMPILER):  # nothing ran: a compiler installed later is tried at once
                raise KernelBuildError(failure)
            errors.append(failure)
            if " hung: " in failure:  # a hung compiler hangs again with other flags
                break
    _remember(note, errors[-1])
    raise KernelBuildError(f"{errors[-1]}; not run again: rm {_home(note)} to retry")


BUILD_SECONDS = 60  # a compile takes a second or two; one still running after a minute is hung
_NO_COMPILER = "no C compiler"


def _compile(arguments: list[str], command: list[str]) -> str | None:
    """Run one compile in a process group of its own, bounded by BUILD_SECONDS; on timeout the whole group is
    killed (a compiler driver's cc1 and as outlived a killed driver, orphaned). None when it compiled, else what
    happened, in one short line."""
    shown = " ".join(command)
    shown = shown if len(shown) <= 40 else f"...{shown[-37:]}"  # the end: the compiler's name, or its flags
    try:
        process = subprocess.Popen(arguments, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, errors="replace", start_new_session=True)
    except OSError as error:
        return f"{_NO_COMPILER}: {shown} cannot be run ({error.strerror or error})"
    try:
        _, stderr = process.communicate(timeout=BUILD_SECONDS)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except OSError:  # the group is gone already
            pass
        try:
            process.communicate(timeout=10)  # reaped; its pipes closed by the kill
        except subprocess.TimeoutExpired:  # a child that left the group still holds a pipe: leave it
            pass
        return f"{shown} hung: killed after {BUILD_SECONDS} s with its child processes"
    if process.returncode == 0:
        return None
    last = stderr.strip().splitlines()[-1].strip() if stderr.strip() else f"exit status {process.returncode}"
    return f"{shown} failed: {last if len(last) <= 60 else last[:57] + '...'}"


def _failure_note(library: Path) -> Path:
    """Where a failed build of `library` is remembered: beside it, under the same key (sources, compiler command,
    flags and CPU), so that another compiler, a new source or another CPU is tried afresh."""
    return library.with_name(f"{library.name.split('.')[0]}.failed")


def _remembered(note: Path) -> str | None:
    """What an earlier run's failed build said, or None where none failed (or its note cannot be read)."""
    try:
        return note.read_text(encoding="utf-8").strip()[:120] or None
    except (OSError, UnicodeDecodeError):
        return None


def _remember(note: Path, failure: str) -> None:
    """Write `failure` to `note` atomically; a cache that cannot be written only means the next run tries again."""
    try:
        note.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=note.parent, suffix=".tmp", delete=False, encoding="utf-8") as file:
            file.write(failure + "\n")
        os.replace(file.name, note)
    except OSError:
        pass


def _home(path: Path) -> str:
    """`path` with the home directory as ~, to keep a warning line short."""
    home = str(Path.home())
    return f"~{str(path)[len(home):]}" if str(path).startswith(home + os.sep) else str(path)


def _cpu_identity() -> str:
    """What -march=native depends on: the CPU's model and features (a cache shared by machines must not mix them)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return f"{platform.machine()} {platform.processor()}"
    return "\n".join(sorted({line for line in lines if line.startswith(("model name", "flags", "Features"))}))


@functools.cache
def workers(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=threads, thread_name_prefix="gali-native")


def share_among_threads(run: Callable[..., None], items: int, threads: int, threaded: bool) -> None:
    """Items [0, items) of a C function shared among `threads` threads: `run(begin, end, threads)` once, where the
    library shares them itself (`threaded`: OpenMP), else `run(begin, end)` over equal spans, all but the first on
    a pool (the C calls release the GIL)."""
    threads = max(1, min(threads, items))
    if threaded or threads == 1:
        run(0, items, threads)
        return
    spans = list(itertools.pairwise([items * part // threads for part in range(threads + 1)]))
    pending = [workers(threads - 1).submit(run, *span) for span in spans[1:]]
    run(*spans[0])
    for job in pending:
        job.result()
