"""A Llama's projection weights held as one byte each, for the CPU decoding step, where they are exactly that.

A decoding step reads every weight of the model once to make one token: on a CPU in float32 its time is the weights'
bytes over the memory's bandwidth (SmolLM2: 540 MB in float32). A model quantized as a GGUF holds far fewer distinct
values than float32 can: each block of 16 or 32 weights is base + step * code for integer codes 0..255 (Q4_0 to
Q8_0, and the K-quants' sub-blocks). Held that way (a byte per weight, a float32 step and base per block: 1.25
bytes a weight for blocks of 32, 1.5 for 16), the same products read 2.7-3.2x fewer bytes than float32, and
native_grids.c's gali_grid_matvec computes each row as sum(step * (codes . x)) + sum(base * sum(x)), the rounding
of a float32 product apart.

A GGUF's weights are read into grids straight from its blocks (model/gguf_blocks.py). A float32 model's weights are
held so only where `gali_grid_pack` finds them on a grid of blocks of 32: it checks every weight, in double, to
within 2**-20 of its block's largest magnitude (a float block whose weights are all tiny beside one large one could
pass too: its products then differ by no more than float32 rounding of a sum of a few hundred terms).
Projections that a Llama computes from the same input are stacked (projections.py): q, k and v as one matrix; the
MLP's gate and up as one, SiLU(gate) * up computed as each row is made (Llama's `hidden_act` "silu"); the layer's
RMSNorm and its residual addition are done in the same native call as the product they go with.

Shapes: B batch, N a matrix's rows, M its columns (a multiple of the block).
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..kernels.native_library import load_kernel, share_among_threads

BLOCK = 32  # weights per block, as native_grids.c's GRID_BLOCK
BLOCKS = (16, BLOCK)  # the block sizes the grid product takes (GGUF's Q2_K, Q3_K and Q6_K share a step by 16)
# How close every weight of a block must be to its grid point, relative to the block's largest magnitude: a few
# float32 roundings (a GGUF block dequantized as d * q + m in float32 is within 2**-22 of its grid).
RELATIVE_TOLERANCE = 2.0**-20


@dataclass(frozen=True)
class GridWeight:
    """A weight matrix (N, M) as `codes` (N, M) uint8 and per block of `block` weights of a row (32, or 16 for the
    GGUF types whose sub-blocks are 16 wide) a `step` and a `base` (N, M / block) float32: weight[n, m] =
    base[n, m // block] + step[n, m // block] * codes[n, m]."""

    codes: torch.Tensor
    step: torch.Tensor
    base: torch.Tensor
    block: int = BLOCK

    def __post_init__(self) -> None:
        """The C function walks these as raw pointers: their layout is checked once, here."""
        tables = (self.step, self.base)
        if self.block not in BLOCKS or self.codes.dim() != 2 or self.codes.dtype != torch.uint8 or (
                self.columns % self.block) or any(
                table.shape != (self.rows, self.columns // self.block) or table.dtype != torch.float32
                for table in tables) or any(not x.is_contiguous() for x in (self.codes, *tables)):
            raise ValueError("a GridWeight is uint8 codes (N, M) and float32 step and base (N, M / block) for a block "
                             f"of {' or '.join(map(str, BLOCKS))}, contiguous")

    @property
    def shape(self) -> tuple[int, int]:
        """(N, M), as the matrix's."""
        return self.rows, self.columns

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def rows(self) -> int:
        return self.codes.shape[0]

    @property
    def columns(self) -> int:
        return self.codes.shape[1]

    def nbytes(self) -> int:
        return sum(x.numel() * x.element_size() for x in (self.codes, self.step, self.base))

    def row_range(self, begin: int, end: int) -> "GridWeight":
        """Rows [begin, end) as a GridWeight of views (no copy)."""
        return GridWeight(self.codes[begin:end], self.step[begin:end], self.base[begin:end], self.block)

    def __call__(self, x: torch.Tensor, gated: bool = False, norm: nn.Module | None = None,
                 into: torch.Tensor | None = None) -> torch.Tensor:
        """x (..., M) float32 times the matrix: (..., N). `gated`: the matrix is a gate's rows above an up
        projection's, and the result (..., N / 2) is SiLU(gate) * up. `norm`: a Llama RMSNorm (float32 weight
        (M,)) applied to x first. `into`: a float32 tensor of the result's shape, contiguous and apart from x, that
        the result is added to (in place; returned)."""
        columns, rows = self.columns, self.rows
        outputs = rows // 2 if gated else rows
        if x.dim() == 0 or x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[-1] != columns or (
                gated and rows % 2) or self.codes.device.type != "cpu":
            raise ValueError(f"a grid matrix {rows} x {columns} takes float32 CPU inputs (..., {columns}), got "
                             f"{x.dtype} {tuple(x.shape)} on {x.device}")
        scales = None if norm is None else norm.weight  # a module attribute: looked up once (this is the hot path)
        if scales is not None and (scales.shape != (columns,) or scales.dtype != torch.float32 or
                                   scales.device.type != "cpu" or not scales.is_contiguous()):
            raise ValueError(f"a grid matrix {rows} x {columns} takes a norm of float32 CPU weights ({columns},)")
        if into is not None and (into.shape != (*x.shape[:-1], outputs) or into.dtype != torch.float32 or
                                 into.device.type != "cpu" or not into.is_contiguous() or
                                 into.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()):
            shape = (*x.shape[:-1], outputs)
            raise ValueError(f"a grid matrix {rows} x {columns} adds into float32 CPU tensors {shape}, contiguous and "
                             f"apart from its input")
        flat = x.resolve_neg().reshape(-1, columns).contiguous()
        out = into if into is not None else torch.empty(*x.shape[:-1], outputs, dtype=torch.float32, device="cpu")
        if flat.shape[0] == 0:
            return out
        kernel = load_kernel()
        arguments = (flat.data_ptr(), flat.shape[0], columns, None if scales is None else scales.data_ptr(),
                     0.0 if norm is None else norm.variance_epsilon, self.codes.data_ptr(), self.step.data_ptr(),
                     self.base.data_ptr(), self.block, rows, int(gated), int(into is not None))
        failed = []

        def run(begin: int, end: int, threads: int = 1) -> None:
            if status := kernel.grid_matvec(*arguments, begin, end, out.data_ptr(), threads):
                failed.append(status)

        share_among_threads(run, outputs, torch.get_num_threads(), kernel.threaded)
        if failed:
            raise MemoryError("the grid product's scratch memory could not be allocated") if -1 in failed else (
                ValueError(f"the grid product was built without blocks of {self.block}: rebuild the kernel"))
        return out


def to_grid(weights: Sequence[torch.Tensor]) -> GridWeight | None:
    """`weights` (each (N_i, M), float32 on the CPU, M a multiple of BLOCK) stacked by rows as one GridWeight, or
    None when a block of them lies on no grid (or their shapes do not fit one)."""
    columns = weights[0].shape[-1]
    if columns % BLOCK or any(w.dim() != 2 or w.shape[1] != columns or w.dtype != torch.float32 or
                              w.device.type != "cpu" for w in weights):
        return None
    matrix = torch.cat([w.detach() for w in weights]).contiguous() if len(weights) > 1 else (
        weights[0].detach().contiguous())
    rows = matrix.shape[0]
    codes = torch.empty(rows, columns, dtype=torch.uint8)
    step = torch.empty(rows, columns // BLOCK, dtype=torch.float32)
    base = torch.empty_like(step)
    kernel, missed = load_kernel(), []

    def run(begin: int, end: int, threads: int = 1) -> None:
        missed.append(kernel.grid_pack(matrix.data_ptr(), columns, begin, end, RELATIVE_TOLERANCE,
                                       codes.data_ptr(), step.data_ptr(), base.data_ptr(), threads))

    share_among_threads(run, rows, torch.get_num_threads(), kernel.threaded)
    return None if any(missed) else GridWeight(codes, step, base)
