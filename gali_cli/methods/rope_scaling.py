"""Global RoPE frequency scaling: static NTK, dynamic NTK and YaRN, through transformers' own rope types.

Each rebuilds the model's rotary embedding from a copy of its config with other `rope_parameters`; the model's own
module is kept inside the replacement, to be put back.
"""

import copy
import math

from torch import nn
from transformers import PretrainedConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from ..config import MethodSettings
from ..engine.checks import reference_model as ref
from ..errors import ConfigError
from ..model.families import GLOBAL, family_of, rope_parameters
from .method import Method, SeamExample


class RescaledRope(nn.Module):
    """The model's rotary embedding rebuilt with other rope parameters; `original` is the one to put back."""

    def __init__(self, original: nn.Module, config) -> None:
        super().__init__()
        self.original = original
        if family_of(config).layer_kinds:  # its own class: a rope per layer kind, the kind passed on
            device = original.get_buffer(f"{GLOBAL}_inv_freq").device
            self.rescaled = type(original)(config=config).to(device)
        else:
            self.rescaled = LlamaRotaryEmbedding(config=config).to(original.inv_freq.device)

    def forward(self, x, position_ids, *kind):
        return self.rescaled(x, position_ids, *kind)


def ntk_theta(rope_theta: float, factor: float, head_dim: int) -> float:
    """Static NTK-aware scaling: the base grows by factor^(d / (d - 2)), so the lowest frequency stretches by factor."""
    return rope_theta * factor ** (head_dim / (head_dim - 2))


def rescale(base: nn.Module, kind: str, factor: float, train_len: int) -> dict:
    """Install `kind` ("ntk", "dynamic-ntk" or "yarn") with `factor`, relative to a window of `train_len`, in the
    decoder model `base` (the module holding `rotary_emb`, seam/hooks.py's `llama_model`).

    Returns the rope parameters now in use (a family with local layers: its global layers', the local layers'
    rope kept).
    """
    config = copy.deepcopy(base.config)
    parameters = rope_parameters(config)
    if parameters.get("rope_type", "default") != "default":
        raise ConfigError(
            f"--method {kind} rescales plain RoPE, but this model already uses rope_type "
            f"{parameters['rope_type']!r}; use gali, self-extend, chunk-llama or original"
        )
    if factor < 1:
        raise ConfigError(f"--factor must be >= 1, got {factor}")
    theta = parameters.get("rope_theta", 10000.0)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if kind == "ntk":
        parameters = {"rope_type": "default", "rope_theta": ntk_theta(theta, factor, head_dim)}
    elif kind == "dynamic-ntk":
        parameters = {"rope_type": "dynamic", "rope_theta": theta, "factor": float(factor)}
        config.max_position_embeddings = train_len  # where dynamic scaling starts
    elif kind == "yarn":
        parameters = {"rope_type": "yarn", "rope_theta": theta, "factor": float(factor),
                      "original_max_position_embeddings": train_len}
    else:
        raise ValueError(f"unknown rope scaling {kind!r}")
    if family_of(config).layer_kinds:
        config.rope_parameters = {**config.rope_parameters, GLOBAL: parameters}
    else:
        config.rope_parameters = parameters
    original = base.rotary_emb.original if isinstance(base.rotary_emb, RescaledRope) else base.rotary_emb
    base.rotary_emb = RescaledRope(original, config)
    return parameters


def restore(base: nn.Module) -> bool:
    """Put the decoder model's own rotary embedding back; False when nothing was rescaled."""
    if not isinstance(base.rotary_emb, RescaledRope):
        return False
    base.rotary_emb = base.rotary_emb.original
    return True


def default_factor(settings: MethodSettings, train_len: int, tokens: int | None) -> float:
    return settings.factor if settings.factor is not None else max(1, math.ceil((tokens or 0) / train_len))


def _factor(config: PretrainedConfig, settings: MethodSettings, train_len: int, tokens: int | None) -> dict:
    return {"train_len": train_len, "factor": default_factor(settings, train_len, tokens)}


def _plain_rope(label: str, settings: MethodSettings, decodes: bool = True) -> tuple[SeamExample, ...]:
    """The seam check's example of a method that changes only the rotary's frequencies (and scaling): plain RoPE
    with the patched rotary is its restatement."""
    return (SeamExample(label, settings, lambda model, s: ref.NaiveRoPE(model), decodes),)


ORIGINAL = Method("original", lambda config, settings, train_len, tokens: {},
                  examples=_plain_rope("original", MethodSettings()))
NTK = Method("ntk", _factor, rope="ntk", examples=_plain_rope("ntk", MethodSettings(factor=3)))
# Dynamic NTK picks its frequencies from the longest position of each forward: one forward for the whole input. The
# unpatched model caches keys rotated by the frequencies of their own forward: only the one-forward prefill has a
# plain restatement.
DYNAMIC_NTK = Method("dynamic-ntk", _factor, rope="dynamic-ntk", boundaries=lambda method, start, stop, cuts: [stop],
                     examples=_plain_rope("dynamic-ntk", MethodSettings(factor=3), decodes=False))
YARN = Method("yarn", _factor, rope="yarn", examples=_plain_rope("yarn", MethodSettings(factor=3)))
