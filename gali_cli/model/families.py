"""The model families gali reads past their window, and what each differs in, in one table.

Every family here is a Llama in the parts gali hooks: a decoder model with a `rotary_emb` whose cos/sin its
attention applies to queries and keys just before the attention function transformers picks by name, a KV cache
filled by the attention layers, and positions as a plain arange. So one seam (engine/hooks.py) serves them all,
and what differs is declared here, read from a config as plain JSON or as transformers' config object, with neither
torch nor transformers imported (`gali info` answers without them):

- q/k/v biases (Qwen2) are added by the projections before RoPE: the hooks see biased, un-rotated queries and keys,
  so nothing of the seam changes; the float64 restatement adds them (engine/reference_model.py).
- q/k RMSNorm before RoPE (Qwen3) likewise happens before the rotation the hooks take over; the cache holds normed,
  un-rotated keys. The static decoding step, which writes the layer out, applies the norms where `qk_norm` says.
- A sliding window (Mistral v0.1's 4,096, Qwen2's `use_sliding_window`): such a model never attends farther back
  than its window, inside its training length, so no relative position ever leaves what it was trained on and the
  position methods have nothing to extend; bending positions under a window it was not trained with would change
  it for nothing. Methods are refused there (`why_no_methods`); --method original reads it as transformers does.
"""

from dataclasses import dataclass
from typing import Any

from ..errors import UnsupportedModelError


@dataclass(frozen=True)
class Family:
    """One family of decoder models as gali hooks it."""

    name: str  # as `gali info` shows it
    model_type: str  # config.json's model_type
    causal_lm: str  # transformers' class for it, and of its decoder layers (the static step writes out)
    decoder_layer: str
    qk_norm: bool = False  # each head's q and k RMS-normed (q_norm, k_norm) before RoPE
    # The documented pretraining length where the config's max_position_embeddings states another (a window padded
    # for the answer), by max_position_embeddings: --train-len's default.
    pretraining_len: tuple[tuple[int, int], ...] = ()
    # transformers' class of its RMSNorms where they compute Llama's x / rms(x) * weight, which the CPU decoding
    # step's byte-grid products fuse (seam/grid_weights.py); None: its norms are run as modules.
    rms_norm: str | None = None


FAMILIES = (
    Family("Llama", "llama", "LlamaForCausalLM", "LlamaDecoderLayer", rms_norm="LlamaRMSNorm"),
    Family("Mistral", "mistral", "MistralForCausalLM", "MistralDecoderLayer", rms_norm="MistralRMSNorm"),
    Family("Qwen2", "qwen2", "Qwen2ForCausalLM", "Qwen2DecoderLayer", rms_norm="Qwen2RMSNorm"),
    # Qwen3's configs state 40,960 positions: its 32,768-token pretraining context plus 8,192 for the answer.
    Family("Qwen3", "qwen3", "Qwen3ForCausalLM", "Qwen3DecoderLayer", qk_norm=True, pretraining_len=((40960, 32768),),
           rms_norm="Qwen3RMSNorm"),
)


def _get(config: Any, field: str, default: Any = None) -> Any:
    """A field of a config given as a dict (config.json) or as transformers' config object."""
    return config.get(field, default) if isinstance(config, dict) else getattr(config, field, default)


def supported() -> str:
    """The families' names, for messages."""
    return ", ".join(family.name for family in FAMILIES)


def family_of(config: Any, name: str = "the model") -> Family:
    """`config`'s family, or an UnsupportedModelError naming the supported ones."""
    model_type = _get(config, "model_type")
    for family in FAMILIES:
        if family.model_type == model_type:
            return family
    raise UnsupportedModelError(f"{name} is a {model_type!r} model; gali supports {supported()}")


def default_train_len(config: Any) -> int:
    """What --train-len defaults to: the family's documented pretraining length where the config states another
    window, else its max_position_embeddings."""
    window = int(_get(config, "max_position_embeddings", 2048))
    return dict(family_of(config).pretraining_len).get(window, window)


def why_no_methods(config: Any) -> str | None:
    """Why the position methods do not apply to this model (None: they do): a sliding window on its layers."""
    window = _get(config, "sliding_window")
    if window is None or (_get(config, "model_type") != "mistral" and not _get(config, "use_sliding_window")):
        return None
    return (f"its layers attend within a sliding window of {window} tokens, so it never sees a distance it was not "
            "trained on: read it with --method original")
