"""A Llama's projection weights held as one byte each, for the CPU decoding step, where they are exactly that.

A decoding step reads every weight of the model once to make one token: on a CPU in float32 its time is the weights'
bytes over the memory's bandwidth (SmolLM2: 540 MB, 20 of a 45 ms step after 4,096 tokens). A model read from a
GGUF file holds far fewer distinct values than float32 can: transformers dequantizes each block of 32 weights from
4 or 8 bits and a scale (Q4_0, Q4_1, Q8_0, and the K-quants' sub-blocks of 32), so every block is base + step * code
for integer codes 0..255. Held that way (a byte per weight, a float32 step and base per block: 1.25 bytes a weight),
the same products read 3.2x fewer bytes, and native_kernels.c's gali_grid_matvec computes each row as
sum(step * (codes . x)) + sum(base * sum(x)), the rounding of a float32 product apart.

Only weights found on such a grid are held so: `gali_grid_pack` checks every weight, in double, to within 2**-20 of
its block's largest magnitude, so a GGUF block is held as transformers dequantized it, to float32 rounding (a
float block whose weights are all tiny beside one large one could pass too: its products then differ by no more
than float32 rounding of a sum of a few hundred terms). A group of projections whose blocks lie on no grid of 256
levels (float checkpoints, GGUF's Q6_K with its sub-blocks of 16) stays with the model's own modules, in PyTorch,
as before. Projections that a Llama computes from the same input are stacked: q, k and v as one matrix; the MLP's
gate and up as one, SiLU(gate) * up computed as each row is made (Llama's `hidden_act` "silu"); the layer's
RMSNorm and its residual addition are done in the same native call as the product they go with.

Shapes: B batch, N a matrix's rows, M its columns (a multiple of BLOCK).
"""

import functools
import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel

from ...errors import GaliWarning
from ...model.families import family_of
from ..kernels.native_noise import load_kernel, share_among_threads
from .hooks import llama_model

BLOCK = 32  # weights per block, as native_kernels.c's GRID_BLOCK
# How close every weight of a block must be to its grid point, relative to the block's largest magnitude: a few
# float32 roundings (a GGUF block dequantized as d * q + m in float32 is within 2**-22 of its grid).
RELATIVE_TOLERANCE = 2.0**-20


@dataclass(frozen=True)
class GridWeight:
    """A weight matrix (N, M) as `codes` (N, M) uint8 and per block of BLOCK weights of a row a `step` and a `base`
    (N, M / BLOCK) float32: weight[n, m] = base[n, m // BLOCK] + step[n, m // BLOCK] * codes[n, m]."""

    codes: torch.Tensor
    step: torch.Tensor
    base: torch.Tensor

    def __post_init__(self) -> None:
        """The C function walks these as raw pointers: their layout is checked once, here."""
        tables = (self.step, self.base)
        if self.codes.dim() != 2 or self.codes.dtype != torch.uint8 or self.columns % BLOCK or any(
                table.shape != (self.rows, self.columns // BLOCK) or table.dtype != torch.float32 for table in tables
        ) or any(x.device.type != "cpu" or not x.is_contiguous() for x in (self.codes, *tables)):
            raise ValueError("a GridWeight is uint8 codes (N, M) and float32 step and base (N, M / 32), contiguous, "
                             "on the CPU")

    @property
    def rows(self) -> int:
        return self.codes.shape[0]

    @property
    def columns(self) -> int:
        return self.codes.shape[1]

    def nbytes(self) -> int:
        return sum(x.numel() * x.element_size() for x in (self.codes, self.step, self.base))

    def __call__(self, x: torch.Tensor, gated: bool = False, norm: nn.Module | None = None,
                 into: torch.Tensor | None = None) -> torch.Tensor:
        """x (..., M) float32 times the matrix: (..., N). `gated`: the matrix is a gate's rows above an up
        projection's, and the result (..., N / 2) is SiLU(gate) * up. `norm`: a Llama RMSNorm (float32 weight
        (M,)) applied to x first. `into`: a float32 tensor of the result's shape, contiguous and apart from x, that
        the result is added to (in place; returned)."""
        columns, rows = self.columns, self.rows
        outputs = rows // 2 if gated else rows
        if x.dim() == 0 or x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[-1] != columns or (
                gated and rows % 2):
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
                     self.base.data_ptr(), rows, int(gated), int(into is not None))
        failed = []

        def run(begin: int, end: int, threads: int = 1) -> None:
            if kernel.grid_matvec(*arguments, begin, end, out.data_ptr(), threads):
                failed.append(True)

        share_among_threads(run, outputs, torch.get_num_threads(), kernel.threaded)
        if failed:
            raise MemoryError("the grid product's scratch memory could not be allocated")
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


@dataclass(frozen=True)
class LayerProjections:
    """A decoder layer's parts around its attention, for the decoding step: its norms, projections and residual
    additions, each group of projections on one grid where its weights lie on one (q, k and v stacked; the MLP's
    gate above its up projection; the attention's output; the MLP's down projection), else the layer's own modules.
    On grids the norm is applied and the residual added in the same native call as the product."""

    layer: nn.Module
    qkv: GridWeight | None = None
    output: GridWeight | None = None
    gate_up: GridWeight | None = None
    down: GridWeight | None = None

    def attention_inputs(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q_proj, k_proj and v_proj of the input norm of the residual stream `hidden` (B, 1, hidden)."""
        attention, norm = self.layer.self_attn, self.layer.input_layernorm
        if self.qkv is None:
            normed = norm(hidden)
            return attention.q_proj(normed), attention.k_proj(normed), attention.v_proj(normed)
        return self.qkv(hidden, norm=norm).split(self.qkv_sizes, dim=-1)

    @functools.cached_property
    def qkv_sizes(self) -> tuple[int, int, int]:
        """q's, k's and v's rows of the stacked matrix (read once: module attributes cost a microsecond each)."""
        attention = self.layer.self_attn
        return attention.q_proj.out_features, attention.k_proj.out_features, attention.v_proj.out_features

    def add_attention_output(self, hidden: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """hidden + o_proj(x): in place on grids."""
        if self.output is None:
            return hidden + self.layer.self_attn.o_proj(x)
        return self.output(x, into=hidden)

    def add_mlp(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden + the MLP of its post-attention norm, down(SiLU(gate(x)) * up(x)): in place where the down
        projection is on a grid."""
        mlp, norm = self.layer.mlp, self.layer.post_attention_layernorm
        if self.gate_up is None and self.down is None:
            return hidden + mlp(norm(hidden))
        if self.gate_up is None:
            normed = norm(hidden)
            inner = mlp.act_fn(mlp.gate_proj(normed)) * mlp.up_proj(normed)
        else:
            inner = self.gate_up(hidden, gated=True, norm=norm)
        return hidden + mlp.down_proj(inner) if self.down is None else self.down(inner, into=hidden)

    def grids(self) -> list[GridWeight]:
        return [w for w in (self.qkv, self.output, self.gate_up, self.down) if w is not None]


@dataclass(frozen=True)
class Projections:
    """Every projection a decoding step multiplies by: the layers' (`LayerProjections`) and the language-model
    head's, each on its grid where it lies on one."""

    layers: tuple[LayerProjections, ...]
    norm: nn.Module
    head: nn.Module
    head_grid: GridWeight | None = None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head's logits for the final norm of the residual stream `hidden`."""
        return self.head(self.norm(hidden)) if self.head_grid is None else self.head_grid(hidden, norm=self.norm)

    def grids(self) -> list[GridWeight]:
        return [w for layer in self.layers for w in layer.grids()] + ([self.head_grid] if self.head_grid else [])

    def grid_share(self) -> float:
        """The share of the projections' weights held on grids (0 to 1)."""
        total = sum(m.weight.numel() for layer in self.layers for m in _linears(layer.layer)) + (
            self.head.weight.numel())
        return sum(w.codes.numel() for w in self.grids()) / total


def available_memory() -> int | None:
    """Bytes of memory the system can give without swapping (Linux's MemAvailable), None where it does not say."""
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def module_projections(model: PreTrainedModel) -> Projections:
    """The projections as the model's own modules (no grids)."""
    base = llama_model(model)
    return Projections(tuple(LayerProjections(layer) for layer in base.layers), base.norm,
                       model.get_output_embeddings())


def _linears(layer: nn.Module) -> list[nn.Module]:
    attention, mlp = layer.self_attn, layer.mlp
    return [attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj, mlp.gate_proj, mlp.up_proj,
            mlp.down_proj]


@dataclass(frozen=True)
class _Packed:
    """A model's projections as packed, with the weight tensors they were packed from (held weakly: a tensor freed
    and another allocated at its address is not the same weight) and their versions then."""

    weights: tuple[weakref.ref, ...]
    versions: tuple[int, ...]
    projections: Projections


# Per model: its packed projections. A model's weights are packed once (a fraction of a second for SmolLM2's 135M
# on two cores), not once per answer.
_packed: "weakref.WeakKeyDictionary[nn.Module, _Packed]" = weakref.WeakKeyDictionary()


def grid_projections(model: PreTrainedModel) -> Projections:
    """`model`'s projections, each group held on a grid where its weights lie exactly on one (kept for the model's
    next answers), else as its modules: all of them where the model is not a float32 model on the CPU whose layers
    this step knows (no biases, a SiLU MLP, RMSNorms computed as Llama's: the family's `rms_norm`), hooks are
    registered on those modules (the grids would skip them), the kernels were built for no vector registers that
    make them pay (`Kernel.grid_vectorised`), or the grids would take more than half the memory available (one
    warning)."""
    base, head = llama_model(model), model.get_output_embeddings()
    rms_norm = family_of(model.config).rms_norm
    linears = [head] + [m for layer in base.layers for m in _linears(layer)]
    norms = [base.norm] + [norm for layer in base.layers for norm in (layer.input_layernorm,
                                                                      layer.post_attention_layernorm)]
    if not load_kernel().grid_vectorised or not all(isinstance(m, nn.Linear) and m.bias is None for m in linears) or (
            getattr(model.config, "hidden_act", None) != "silu") or not all(
            type(norm).__name__ == rms_norm and norm.weight.dtype == torch.float32 for norm in norms) or any(
            m._forward_hooks or m._forward_pre_hooks for m in (*linears, *norms)):  # hooks the grids would skip
        return module_projections(model)
    # The weights as packed: the same tensors, not changed in place since (tensors made in inference mode count no
    # versions: a change to one would show as the first step's disagreement with the forward).
    weights = [m.weight for m in linears]
    versions = tuple(0 if w.is_inference() else w._version for w in weights)
    known = _packed.get(model)
    if known is not None and known.versions == versions and all(
            kept() is weight for kept, weight in zip(known.weights, weights, strict=True)):
        return known.projections
    needed, free = sum(w.numel() for w in weights) * 5 // 4, available_memory()
    if free is not None and needed > free // 2:  # the grids must not push the machine into swap or the OOM killer
        warnings.warn(f"not enough free memory to hold the projections as bytes ({needed / 2**30:.1f} GiB needed, "
                      f"{free / 2**30:.1f} GiB available); decoding reads their float32 weights", GaliWarning,
                      stacklevel=2)
        packed = module_projections(model)  # kept too: the model's next answers decide the same, without a warning
    else:
        packed = _pack(base, head)
    _packed[model] = _Packed(tuple(weakref.ref(w) for w in weights), versions, packed)
    return packed


def _pack(base: nn.Module, head: nn.Linear) -> Projections:
    """Each group of projections on its grid where its weights lie on one."""
    layers = []
    for layer in base.layers:
        attention, mlp = layer.self_attn, layer.mlp
        layers.append(LayerProjections(
            layer, to_grid([attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight]),
            to_grid([attention.o_proj.weight]), to_grid([mlp.gate_proj.weight, mlp.up_proj.weight]),
            to_grid([mlp.down_proj.weight])))
    return Projections(tuple(layers), base.norm, head, to_grid([head.weight]))
