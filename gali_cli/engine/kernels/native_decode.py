"""One decoded query's attention over the KV cache on the CPU, each key rotated as it is read: native_decode.c's
gali_decode_attention, for the static decoding step (static_decode.py).

The static step places every cached key anew each token (a method's positions move as the text grows), so in
PyTorch it rotates all keys into a new tensor and then attends over it, which made the step slower than the
unpatched model's (docs/notes/2026-11-performance-history.md, "The static step through the native kernel (issue
26)"). The kernel reads each key once, rotates it in registers with its row of the
step's cos/sin table, adds GALI's noise (noise.py's draws, to float32 rounding) and keeps an online softmax, the
keys cut into runs shared among torch's threads; the runs' partial softmaxes are merged by their log-sum-exps
(in C too: a few small torch operations per layer would cost more than the merge).
Float32 queries (a CPU model computes in float32 unless it has AMX) over keys and values stored in float32, or in
float16 or bfloat16 (--kv-dtype: each row widened to float32 as it is loaded, so the attention equals the float32
kernel's on the same rounded rows), head dims that are multiples of 16 up to 256, up to 16 query heads per key head.
Shapes: B batch, Hkv key/value heads, g query heads per key head, C the cache's rows, D head dim.
"""

import torch

from .native_library import load_kernel, share_among_threads

MAX_GROUP, MAX_DIM, LANES = 16, 256, 16  # as native_decode.c and native_common.h define them
KEYS_PER_RUN = 256  # no run shorter: a run's setup and merge are then small beside its keys
KV_KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # how the cache stores K/V, as the C code numbers it


def supports(dtype: torch.dtype, head_dim: int, group: int) -> bool:
    """Whether the kernel takes these heads (float32, D a multiple of 16 up to 256, g up to 16)."""
    return dtype == torch.float32 and head_dim % LANES == 0 and 0 < head_dim <= MAX_DIM and 0 < group <= MAX_GROUP


def _check_table_rows(table_rows: torch.Tensor, index: int, length: int, mixed: bool) -> None:
    """Refuse table rows that would make the kernel read outside a table of `length` rows: every row it reads for
    keys 0..index, and the next where `mixed` (a small share of the step: docs/performance.md, "CPU: two cores,
    SmolLM2-135M")."""
    low, high = (int(x) for x in torch.aminmax(table_rows[: index + 1]))
    if low < 0 or high >= length - mixed:
        raise ValueError(f"native decoding: table rows {low}..{high} outside the table's {length} rows"
                         f"{' (and the next, mixed)' if mixed else ''}")


def native_decode_attention(
    rows: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    index: int,
    scale: float,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    sigma: torch.Tensor | None = None,
    streams: torch.Tensor | None = None,
    runs: int | None = None,
    table_rows: torch.Tensor | None = None,
    mix: torch.Tensor | None = None,
) -> torch.Tensor:
    """triton_decode.rotating_decode_attention on the CPU: `rows` (B, Hkv, g, D) float32 over keys/values
    (B, Hkv, C, D) of one of KV_KINDS' dtypes up to token `index` (an int: nothing is graphed on a CPU), cos/sin
    (>= C, >= D/2) rotating key j by row j (None: the keys as they are), or by row table_rows[j] (C,) int32 of a
    table of any length, interpolated towards the next row by `mix` (C,) float32 where given; GALI's noise from
    `sigma` (C,) float32 and `streams` (B * H,) int32 (native_noise.int32_bits of noise.head_streams). `runs`: runs
    per key head (None: enough to share among torch's threads). Returns (B, Hkv, g, D) float32."""
    batch, kv_heads, group, dim = rows.shape
    if (cos is None) != (sin is None) or (sigma is None) != (streams is None) or (
            table_rows is None and mix is not None) or (table_rows is not None and cos is None):
        raise ValueError("cos and sin go together, and so do sigma and streams; table rows need a table, a mix rows")
    # The C function reads raw pointers: every extent it walks is checked here.
    count = keys.shape[2]
    if keys.shape != (batch, kv_heads, count, dim) or values.shape != keys.shape or not 0 <= index < count or (
            runs is not None and runs < 1) or (cos is not None and (cos.shape != sin.shape or cos.dim() != 2 or (
            cos.shape[0] < (1 if table_rows is not None else count) or cos.shape[1] < dim // 2))) or (
            sigma is not None and (sigma.shape != (count,) or streams.shape != (batch * kv_heads * group,))) or (
            any(x is not None and x.shape != (count,) for x in (table_rows, mix))):
        raise ValueError(f"native decoding: shapes that do not fit rows {tuple(rows.shape)}, keys "
                         f"{tuple(keys.shape)}, values {tuple(values.shape)}, index {index}")
    tensors = [rows, keys, values, *(x for x in (cos, sin, sigma, streams, table_rows, mix) if x is not None)]
    if any(x.device.type != "cpu" or x.stride(-1) != 1 for x in tensors) or not supports(rows.dtype, dim, group):
        raise ValueError("the native decoding kernel takes float32 CPU tensors with contiguous rows")
    if keys.dtype not in KV_KINDS or values.dtype != keys.dtype or (cos is not None and (
            cos.dtype != torch.float32 or cos.stride() != sin.stride())) or (sigma is not None and (
            sigma.dtype != torch.float32 or streams.dtype != torch.int32)) or (table_rows is not None and (
            table_rows.dtype != torch.int32)) or (mix is not None and mix.dtype != torch.float32):
        raise ValueError("the native decoding kernel takes keys and values of one dtype (float32, float16 or "
                         "bfloat16), float32 tables, mix and sigma, int32 streams and table rows")
    if table_rows is not None:
        _check_table_rows(table_rows, index, cos.shape[0], mix is not None)
    kernel = load_kernel()
    threads = max(1, torch.get_num_threads())
    seen = index + 1
    runs = runs or max(1, min(-(-seen // KEYS_PER_RUN), -(-2 * threads // max(1, batch * kv_heads))))
    items = batch * kv_heads * runs
    out = torch.empty(items, group, dim, dtype=torch.float32, device="cpu")  # not torch's default dtype/device:
    lse = torch.empty(items, group, dtype=torch.float32, device="cpu")  # the C code writes float32 here
    arguments = (rows.data_ptr(), *rows.stride()[:3], keys.data_ptr(), *keys.stride()[:3], values.data_ptr(),
                 *values.stride()[:3], KV_KINDS[keys.dtype],
                 *(None if x is None else x.data_ptr() for x in (cos, sin)),
                 0 if cos is None else cos.stride(0),
                 *(None if x is None else x.data_ptr() for x in (table_rows, mix, sigma, streams)),
                 kv_heads, group, dim, index, scale, runs)

    def run(begin: int, end: int, threads: int = 1) -> None:
        kernel.decode(*arguments, begin, end, out.data_ptr(), lse.data_ptr(), threads)

    share_among_threads(run, items, threads, kernel.threaded)
    merged = torch.empty(batch, kv_heads, group, dim, dtype=torch.float32, device="cpu")
    kernel.merge_runs(out.data_ptr(), lse.data_ptr(), batch * kv_heads, runs, group, dim, merged.data_ptr())
    return merged
