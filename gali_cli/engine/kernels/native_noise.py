"""Noisy GALI attention on the CPU with the noise made by a small native kernel (native_kernels.c), and the loading
of that library, whose decoding kernel native_decode.py calls.

The PyTorch path (noisy_attention.explicit_noisy_partial) makes noise.py's normals in about twenty elementwise
passes over every logit, each a round trip through memory: on a CPU that costs several times the attention itself.
Here the logits come from one matrix product, and one C function sweeps each row twice while it is in cache: the
noise added and the maximum found, then the softmax numerators and their sum. The noise is noise.py's to float32
rounding (the same hashed bits; see the C file).

The kernel is compiled on first use by the system's C compiler (`$CC`, else `cc`) into the user cache directory
(~/.cache/gali/kernels on Linux), keyed by its source, compiler and CPU, and loaded with ctypes: a fraction of a
second, once per machine. noisy_attention.native_verified holds it to the PyTorch path before first use; a machine
without a working compiler gets one warning and the PyTorch path.

Shapes: B batch, H query heads, Hkv key/value heads, q queries, n keys, D head dim; the H / Hkv query heads that
share a key head are stacked as the rows of one matrix product.
"""

import ctypes
import functools
import hashlib
import itertools
import os
import platform
import subprocess
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from ...cache_ownership import user_cache_directory
from ...errors import GaliError
from ..math.noise import GOLDEN, MULTIPLIER_A, MULTIPLIER_B, Noise, head_streams, mix32
from ..math.partials import Partial
from .kernel_choice import compiler

SOURCE = Path(__file__).with_name("native_kernels.c")
# -fno-math-errno, -fno-trapping-math: sqrt and comparisons become plain vector instructions (no errno, no traps).
# The noise hash's constants come from math/noise.py, its one definition.
_FLAGS = ["-O3", "-fno-math-errno", "-fno-trapping-math", "-shared", "-fPIC", f"-DGALI_MULTIPLIER_A={MULTIPLIER_A:#x}u",
          f"-DGALI_MULTIPLIER_B={MULTIPLIER_B:#x}u", f"-DGALI_GOLDEN={GOLDEN:#x}u"]
# Tried in this order, first with OpenMP: a library that uses it links the OpenMP runtime torch has loaded (libgomp,
# by its name), so the kernel's rows go to torch's own idle threads; a second pool of threads would compete with
# them (torch's threads keep spinning for a while after each op). Apple's compiler has no -fopenmp.
_OPENMP = (["-fopenmp"], [])
_NATIVE_CPU = (["-march=native"], [])  # a compiler that does not know it builds for the generic CPU
# Explicit logits held at once: 1M float32, 4 MiB.
_TILE_ELEMENTS = 1 << 20


class KernelBuildError(GaliError):
    """The native noise kernel could not be compiled or loaded here."""


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
    source = SOURCE.read_bytes()
    command = compiler()
    identity = hashlib.sha256(source + repr((command, _FLAGS, _cpu_identity())).encode()).hexdigest()[:16]
    library = kernel_directory() / f"noise-{identity}{'.dylib' if platform.system() == 'Darwin' else '.so'}"
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
    decode.argtypes = [pointer, size, size, size, pointer, size, size, size, pointer, size, size, size, pointer,
                       pointer, size, pointer, pointer, pointer, pointer, size, size, size, size, ctypes.c_float, size,
                       size, size, pointer, pointer, ctypes.c_int]
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


def _build(command: list[str], library: Path) -> None:
    """Compile the kernel into `library`, atomically (a half-written library is never loaded): with OpenMP and for
    this CPU where the compiler can, else without them. Each compile is bounded (`_compile`), and a compiler that
    hung or failed is remembered beside the library (`_failure_note`): it cost one run its wait, not every run (a
    `$CC` that hung stalled each run 120 s per attempt). Messages stay whole in the callers' 200-character warnings."""
    note = _failure_note(library)
    if (remembered := _remembered(note)) is not None:
        raise KernelBuildError(f"in an earlier run, {remembered}; not run again: rm {_home(note)} to retry")
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
        built = Path(scratch) / library.name
        errors = []
        for extra in itertools.product(_OPENMP, _NATIVE_CPU):
            failure = _compile([*command, *_FLAGS, *extra[0], *extra[1], "-o", str(built), str(SOURCE)], command)
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
    import signal  # here, not at the top: this module's header is shared with the kernels' other work

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
    """Where a failed build of `library` is remembered: beside it, under the same key (source, compiler command,
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


@dataclass(frozen=True)
class RowLayout:
    """Whose rows a tile of logits holds, so that the kernel finds each row's noise stream and token index itself:
    the query heads sharing one key head, stacked, `queries` rows each; the tile starts at stacked row `tile_start`.
    Stacked row s is query s % queries (token first_query + s % queries) of the key head's query head s // queries.
    """

    head_stream: torch.Tensor  # (H / Hkv,) int32: noise.head_streams of the key head's query heads
    queries: int
    first_query: int
    tile_start: int


def noisy_softmax_(
    logits: torch.Tensor, scale: float, layout: RowLayout, group: int, grouped: int, sigma_unit: float,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale float32 logits q.k (rows, n) of keys 0..n-1 (each row contiguous), add the noise, then turn them into
    exp(logit - row maximum), in place; returns each row's maximum and sum of numerators, (rows,) each (written into
    `out`, two contiguous float32 tensors, when given).

    Key j gets noise of sigma (i - j) * sigma_unit where c != 0: j < grouped and j % group != 0. Rows are shared among
    torch's intra-op thread count (by OpenMP in the kernel, else by a thread pool here: the C calls release the GIL).
    """
    kernel = load_kernel()
    rows, keys = logits.shape
    top, total = out if out is not None else (logits.new_empty(rows), logits.new_empty(rows))
    if (logits.stride(1) != 1 or not layout.head_stream.is_contiguous() or not top.is_contiguous()
            or not total.is_contiguous() or top.numel() != rows or total.numel() != rows):
        raise ValueError("the logits' rows, the head streams and the results must be contiguous")
    threads = max(1, min(torch.get_num_threads(), rows, rows * keys // 8192))  # small tiles: one thread
    pair_hash = pair_hashes((keys + 1) // 2)
    arguments = (logits.data_ptr(), logits.stride(0), keys, scale, layout.head_stream.data_ptr(), layout.queries,
                 layout.first_query, layout.tile_start, pair_hash.data_ptr(), group, grouped, sigma_unit)

    def run(begin: int, end: int, threads: int = 1) -> None:
        kernel.function(*arguments, begin, end, top.data_ptr(), total.data_ptr(), threads)

    share_among_threads(run, rows, threads, kernel.threaded)
    return top, total


def noisy_partial(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    noise: Noise,
    first_query: int,
    group: int,
    grouped: int,
    total_keys: int,
) -> Partial:
    """Noisy GALI attention of queries (B, H, q, D) over keys [0, n) that they all see, as a `Partial`.

    One key head at a time, its query heads stacked as the rows of two plain matrix products (logits, then the
    numerators times the values): on two threads these run a fifth faster than one batched product over the key
    heads, which leaves a thread idle when their number is odd.

    Args:
        query: rotated queries; key, value (B, Hkv, n, D): the mixed keys (K_mix) of tokens 0..n-1, and values.
        first_query: the token index of the first query (the others follow it).
        group, grouped: g and G of Alg. 2: key j gets noise when j < G and j % g != 0.
        total_keys: T, the chunk's key count (sigma = (i - j) / T * noise.scale).
    """
    batch, heads, q_len, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    per_kv = heads // kv_heads
    streams = cpu_head_streams(noise, batch, heads).view(batch * kv_heads, per_kv)
    stacked = query.float().reshape(batch * kv_heads, per_kv * q_len, dim)
    dtype, key, value = value.dtype, key.float().flatten(0, 1), value.float().flatten(0, 1)  # (B * Hkv, n, D)
    output = stacked.new_empty(stacked.shape)
    top, total = stacked.new_empty(stacked.shape[:2]), stacked.new_empty(stacked.shape[:2])
    tile = max(1, _TILE_ELEMENTS // keys)
    for head in range(batch * kv_heads):
        for start in range(0, stacked.shape[1], tile):
            rows = slice(start, min(start + tile, stacked.shape[1]))
            logits = torch.mm(stacked[head, rows], key[head].T, out=_scratch(rows.stop - start, keys))
            layout = RowLayout(streams[head], q_len, first_query, start)
            noisy_softmax_(logits, scale, layout, group, grouped, noise.scale / total_keys,
                           out=(top[head, rows], total[head, rows]))
            torch.mm(logits, value[head], out=output[head, rows])
    output.div_(total.unsqueeze(-1))  # normalised, and the log-sum-exps, once for every head
    lse = total.log_().add_(top)
    return Partial(output.view(batch, heads, q_len, dim).to(dtype), lse.view(batch, heads, q_len))


@functools.lru_cache(maxsize=64)
def cpu_head_streams(noise: Noise, batch: int, heads: int) -> torch.Tensor:
    """noise.head_streams as int32 on the CPU, kept for the layer's next chunks and decoding steps."""
    return int32_bits(head_streams(noise, batch, heads, torch.device("cpu")))


_pair_hashes = torch.empty(0, dtype=torch.int32)


def pair_hashes(pairs: int) -> torch.Tensor:
    """mix32(m ^ GOLDEN) as int32 for pairs m < `pairs`: a prefix of one table, grown by doubling (the same for every
    chunk, layer and seed)."""
    global _pair_hashes
    if len(_pair_hashes) < pairs:
        _pair_hashes = int32_bits(mix32(torch.arange(max(pairs, 2 * len(_pair_hashes), 4096)) ^ GOLDEN))
    return _pair_hashes[:pairs]


_held = threading.local()


def _scratch(rows: int, columns: int) -> torch.Tensor:
    """A float32 CPU buffer (rows, columns) for a tile's logits, reused from call to call (by this thread): a fresh
    tile of several MiB would be new pages from the system each time, their faults costing as much as the kernel.
    One buffer inside torch.inference_mode and one outside: neither kind of tensor may be written in the other."""
    size, inference = rows * columns, torch.is_inference_mode_enabled()
    buffers = _held.__dict__.setdefault("buffers", {})
    if inference not in buffers or buffers[inference].numel() < size:
        buffers[inference] = torch.empty(max(size, _TILE_ELEMENTS))
    return buffers[inference][:size].view(rows, columns)


def int32_bits(values: torch.Tensor) -> torch.Tensor:
    """32-bit values held in int64 (noise.py's convention) as int32 with the same bits."""
    return torch.where(values > 0x7FFFFFFF, values - (1 << 32), values).to(torch.int32)
