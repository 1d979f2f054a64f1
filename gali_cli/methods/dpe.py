"""DPE (Lu et al. 2025, "Effective Length Extrapolation via Dimension-Wise Positional Embeddings Manipulation",
arXiv 2504.18857; LuLuLuyi/DPE): SelfExtend applied per group of RoPE frequencies, each group with its own scale.

RoPE's D/2 frequencies are cut into equal groups. A query i and a key j closer than the window W keep their true
positions in every frequency; farther pairs sit, in a group with scale s, at i // s + W - W // s (query) and j // s
(key), so that each group's distances continue from the window's edge at 1/s the rate. The paper chooses each
group's scale from the distance up to which that group stays effective (a needle sweep per model); the official
repository ships the result for a few models (PUBLISHED), used when the model matches. Elsewhere every group gets
the smallest scale that keeps its positions within train_len (SelfExtend's rule), and --dpe-scales passes others.

Keys are cached without RoPE; the far keys' rotations depend on j only, so they are rotated once and kept while
decoding. Positions depend on (i, j) only: any split of the input into forwards gives the same result.
"""

import math

import torch
from torch import nn
from transformers import PretrainedConfig

from ..config import MethodSettings
from ..engine.checks import reference_model as ref
from ..engine.contract import Forward, KeptKeys, Placement, PositionalAttention
from ..engine.math.rope import rotate, rotation
from ..errors import ConfigError
from .method import Method, SeamExample, head_dim, neighbor_window, smallest_group
from .windowed import kept_far_keys, windowed_attend

# Settings from the official repository's config/dpe_config.yaml (eight equal groups of Llama-3's 64 frequencies,
# highest frequency first), chosen there by a needle sweep for each model.
PUBLISHED = {
    "Meta-Llama-3-8B-Instruct": (1024, (2, 8, 2, 8, 32, 32, 32, 4)),
    "Meta-Llama-3.1-8B-Instruct": (1024, (2, 32, 32, 2, 2, 2, 2, 1)),
}
_LLAMA_3_8B = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
               "intermediate_size": 14336, "vocab_size": 128256}


def published_settings(config: PretrainedConfig) -> tuple[str, int, tuple[int, ...]] | None:
    """(model, window, scales) when `config` is one of the models DPE's authors published settings for.

    Matched by architecture: base and Instruct models share it (the settings were searched on the Instruct ones).
    """
    model = llama3_8b(config)
    return (model, *PUBLISHED[model]) if model else None


def llama3_8b(config: PretrainedConfig) -> str | None:
    """The name of the model whose architecture `config` has, base or Instruct (Meta-Llama-3-8B-Instruct,
    Meta-Llama-3.1-8B-Instruct), else None: the models DPE's and STRING's authors published settings for."""
    if getattr(config, "model_type", None) != "llama" or any(
            getattr(config, name, None) != value for name, value in _LLAMA_3_8B.items()):
        return None
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_theta") != 500000.0:
        return None
    if rope.get("rope_type", "default") == "default" and config.max_position_embeddings == 8192:
        return "Meta-Llama-3-8B-Instruct"
    if (rope.get("rope_type") == "llama3" and rope.get("factor") == 8.0
            and rope.get("original_max_position_embeddings") == 8192 and config.max_position_embeddings == 131072):
        return "Meta-Llama-3.1-8B-Instruct"
    return None


def default_groups(head_dim: int) -> int:
    """Eight groups, as the paper cuts them, when they split the frequencies evenly."""
    return math.gcd(8, head_dim // 2)


def check_scales(scales: tuple[int, ...], head_dim: int) -> None:
    """A ConfigError unless `scales` are whole numbers >= 1 whose count splits the head's frequencies evenly."""
    if not scales or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in scales):
        raise ConfigError(f"--dpe-scales must be whole numbers >= 1, got {','.join(map(str, scales))}")
    if (head_dim // 2) % len(scales):
        raise ConfigError(f"--dpe-scales gives {len(scales)} groups: they must split the model's {head_dim // 2} RoPE "
                          "frequencies evenly")


class DPE(PositionalAttention):
    name = "dpe"

    def __init__(self, scales: tuple[int, ...], window: int, train_len: int, head_dim: int) -> None:
        half = head_dim // 2
        check_scales(scales, head_dim)
        if not 0 < window < train_len:
            raise ConfigError(f"--neighbor-window must be between 1 and train_len - 1 ({train_len - 1}), got {window}")
        self.scales, self.window, self.train_len = tuple(scales), window, train_len
        self.exact_until = window  # every distance below the window: plain RoPE
        self._per_frequency = torch.tensor(scales).repeat_interleave(half // len(scales))  # (D/2,)
        self._on_device: dict[torch.device, torch.Tensor] = {}
        self._kept = KeptKeys()

    def table_rows(self, start: int, stop: int) -> int:
        return 2 * self.window  # near keys are rotated relative to their tile

    def decode_placement(self, query: torch.Tensor, keys: torch.Tensor) -> Placement:
        """SelfExtend's placement with a group size per frequency: offsets (C, D/2)."""
        if keys.device not in self._on_device:  # made before a graph is recorded (its warm-up step), reused in it
            self._on_device[keys.device] = self._per_frequency.to(keys.device)
        scales, window = self._on_device[keys.device], self.window
        grouped = keys.unsqueeze(-1) // scales - (query // scales + window - window // scales)
        near = (query - keys < window).unsqueeze(-1)
        return Placement(torch.where(near, (keys - query).unsqueeze(-1), grouped).double())

    def attend(self, forward: Forward, module: nn.Module, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, scaling: float, dropout: float, **kwargs) -> torch.Tensor:
        window, start, stop = self.window, forward.start, forward.stop
        cos, sin = forward.memo(("dpe-query", query.device), lambda: self._rotation(
            forward, torch.arange(start, stop, device=query.device), True, torch.float32))
        far_query = rotate(query.float(), cos, sin)

        def key_rotation(first: int, last: int) -> tuple[torch.Tensor, torch.Tensor]:
            return forward.memo(("dpe-key", key.device, key.dtype, first, last), lambda: self._rotation(
                forward, torch.arange(first, last, device=key.device), False, key.dtype))

        far_key, at_token_index = kept_far_keys(self._kept, forward, module.layer_idx, query, key, window,
                                                key_rotation)
        return windowed_attend(forward, query, key, value, far_query, far_key, window, scaling, dropout,
                               at_token_index)

    def _rotation(self, forward: Forward, tokens: torch.Tensor, queries: bool,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin (n, D) of the far positions of these tokens, per frequency: i // s + W - W // s for queries,
        j // s for keys."""
        scales = self._per_frequency.to(tokens.device)
        positions = torch.div(tokens.unsqueeze(-1), scales, rounding_mode="floor")  # (n, D/2)
        if queries:
            positions = positions + self.window - torch.div(self.window, scales, rounding_mode="floor")
        rotary = forward.installed.rotary
        return rotation(positions, rotary.inv_freq, rotary.attention_scaling, dtype)


def _settings(config: PretrainedConfig, settings: MethodSettings, train_len: int, tokens: int | None) -> dict:
    # The authors' settings hold for the model's own window only.
    published = published_settings(config) if train_len == config.max_position_embeddings else None
    window = neighbor_window(settings, train_len, published[1] if published else train_len // 8)
    if settings.dpe_scales or published:
        scales = list(settings.dpe_scales or published[2])
        check_scales(tuple(scales), head_dim(config))
    elif tokens is None:
        scales = "the smallest that reaches the input, in every group"
    else:
        scales = [smallest_group(window, train_len, tokens)] * default_groups(head_dim(config))
    return {"train_len": train_len, "neighbor_window": window, "dpe_scales": scales,
            "dpe_published": published[0] if published and not settings.dpe_scales else None}


METHOD = Method("dpe", _settings, lambda config, settings, s: DPE(
    tuple(s["dpe_scales"]), s["neighbor_window"], s["train_len"], head_dim(config)), examples=(SeamExample(
        "dpe", MethodSettings(neighbor_window=2, dpe_scales=(2, 4)),
        lambda model, s: ref.NaiveDPE(model, s["dpe_scales"], s["neighbor_window"])),))
