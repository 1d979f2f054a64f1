"""A decoding step's projections on the CPU: each group of a layer's projections (q, k and v stacked; the MLP's
gate above its up projection; the attention's output; the MLP's down projection) and the head, as one grid product
(grid_weights.py) where its weights lie on a grid, else as the layer's own modules.

A GGUF model's projections are grids already (packed_modules.py: read from the file's blocks, q, k and v, gate and
up stacked as they load); a float32 model's are packed here from its float weights where they lie exactly on one,
once per model. On grids the norm is applied and the residual added in the same native call as the product.
"""

import functools
import warnings
import weakref
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel

from ...errors import GaliWarning
from ...model.families import family_of
from ..kernels.native_library import load_kernel
from .grid_weights import GridWeight, to_grid
from .hooks import llama_model
from .packed_modules import PackedLinear


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
        total = sum(m.in_features * m.out_features for layer in self.layers for m in _linears(layer.layer)) + (
            self.head.in_features * self.head.out_features)
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
    if not load_kernel().grid_vectorised or not all(
            isinstance(m, nn.Linear | PackedLinear) and m.bias is None for m in linears) or (
            getattr(model.config, "hidden_act", None) != "silu") or not all(
            type(norm).__name__ == rms_norm and norm.weight.dtype == torch.float32 for norm in norms) or any(
            m._forward_hooks or m._forward_pre_hooks for m in (*linears, *norms)):  # hooks the grids would skip
        return module_projections(model)
    if all(isinstance(m, PackedLinear) for m in linears):
        return gguf_grids(base, head)
    if not all(isinstance(m, nn.Linear) for m in linears):
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


def gguf_grids(base: nn.Module, head: PackedLinear) -> Projections:
    """A GGUF model's projections, whose modules hold grids already: a group is its members' shared grid where
    they were stacked as one (`PackedLinear.group`, in order), a lone projection its own; a group without one grid
    (a float tensor among them) stays with its modules."""
    def grid(*members: PackedLinear) -> GridWeight | None:
        group = getattr(members[0], "group", members[0].grid)
        if not isinstance(group, GridWeight) or any(getattr(m, "group", m.grid) is not group for m in members):
            return None
        if group.rows != sum(m.out_features for m in members):
            return None
        return group

    layers = []
    for layer in base.layers:
        attention, mlp = layer.self_attn, layer.mlp
        layers.append(LayerProjections(layer, grid(attention.q_proj, attention.k_proj, attention.v_proj),
                                       grid(attention.o_proj), grid(mlp.gate_proj, mlp.up_proj), grid(mlp.down_proj)))
    return Projections(tuple(layers), base.norm, head, grid(head))
