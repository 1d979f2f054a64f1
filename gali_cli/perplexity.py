"""Perplexity of a document under a method, in one pass, without ever holding more than a slice of logits."""

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from .engine.seam.cache_argument import with_cache
from .engine.seam.kv_cache import new_cache, reserve
from .errors import ConfigError

# Positions whose logits exist at once: logits are (slice x vocab) floats, e.g. 512 x 128k x 4 B = 256 MiB.
_LOGIT_SLICE = 512


@dataclass(frozen=True)
class Perplexity:
    length: int  # over the first `length` tokens: tokens 2..length, each predicted from its whole prefix
    ppl: float
    mean_nll: float


def perplexities(
    model: PreTrainedModel,
    ids: torch.Tensor,
    lengths: list[int],
    spans: list[tuple[int, int]],
    progress: Callable[[int, int, float], None] | None = None,
    boundaries: list[int] | None = None,
    kv_dtype: torch.dtype | None = None,
) -> list[Perplexity]:
    """PPL over the first l tokens of `ids` (1, N) for every l in `lengths`, from one pass along `spans`.

    The model's body runs forward by forward (its cache carrying the prefix); the LM head runs on slices of each
    forward's hidden states, cut at the method's chunk `boundaries` too, so that logits never span two chunks.
    `progress` gets (tokens done, N, perplexity of the first `done` tokens) after every forward. `kv_dtype`: how the
    cache stores keys and values (kv_cache.new_cache; None: as the model computes).
    """
    total = ids.shape[1]
    for length in lengths:
        if not 2 <= length <= total:
            raise ConfigError(f"--lengths: {length} tokens asked, the document has {total} (at least 2 needed)")
    head = model.get_output_embeddings()
    nll = torch.zeros(total - 1, dtype=torch.float64)  # nll[t]: token t + 1 given tokens 0..t
    cuts = sorted({*(boundaries or []), *(last for _, last in spans)})
    with torch.inference_mode():
        cache = new_cache(model, kv_dtype)
        reserve(cache, spans[-1][1])
        given = with_cache(model.model, cache)
        for first, last in spans:
            hidden = model.model(input_ids=ids[:, first:last], **given, use_cache=True).last_hidden_state
            start = first
            for end in (cut for cut in cuts if first < cut <= last):
                for begin in range(start, end, _LOGIT_SLICE):
                    piece = slice(begin, min(begin + _LOGIT_SLICE, end, total - 1))
                    if piece.start >= piece.stop:
                        break
                    logits = head(hidden[0, piece.start - first : piece.stop - first]).float()
                    targets = ids[0, piece.start + 1 : piece.stop + 1].to(logits.device)
                    nll[piece] = F.cross_entropy(logits, targets, reduction="none").double().cpu()
                start = end
            if progress and last >= 2:
                progress(last, total, math.exp(nll[: last - 1].mean().item()))
    return [Perplexity(length, math.exp(nll[: length - 1].mean().item()), nll[: length - 1].mean().item())
            for length in lengths]
