"""ReAttention (Liu et al. 2025, "ReAttention: Training-Free Infinite Context with Finite Attention Scope", ICLR;
OpenMOSS/ReAttention): a position-agnostic top-k attention picks a finite part of the KV cache, and ordinary attention
with positions inside the training window runs over it, however long the input.

Past the training window L, the input is read in chunks of s tokens (the first chunk ends at L, as GALI's do); every
forward over a chunk ending at token T, in every layer:
- the first G keys (the sink) and the last W (the local window, which holds the chunk's own queries) are kept;
- every query head h scores the middle keys [G, T - W) by the raw dot product of its un-rotated query with the
  un-rotated keys of its key head (h // group), and each (head, query) pair votes for its k best keys;
- at most C voted keys are kept, the most voted first (ties: the earlier key), and each brings the span of S tokens
  around it (c - S//2 .. c + S - S//2 - 1, inside the middle);
- the kept keys, in their order, sit at positions 0..n-1 (n = G + spans + W <= L) and query i at n - (T - i):
  causal attention with the model's own RoPE. One selection serves every head and query of the chunk.
A forward ending within L is the unpatched model. Decoding selects again at every token, in every layer.

Differences from the official code, by design: it is plain attention while the input fits the training window (the
official code goes sparse past G + W tokens, which would change what the model reads exactly); the local window is
exactly W (the official one shrinks by up to 128 so that its Triton kernel sees multiples of 128), and the last
prompt token ends the last chunk instead of being fed as a decoding step; the top-k is exact per (head, query) (the
official prefill kernel keeps one key per block of 128), scored in float32 (its decoding rounds to float16), with
query head h on key head h // group in prefill and decoding alike (its decoding pairs h with h mod Hkv). The
selection reads every key, so the static decoding step cannot hold it: ReAttention decodes eagerly.
"""

import torch
from torch import nn
from transformers import PretrainedConfig

from ..config import MethodSettings
from ..engine.attention.dense import causal_partial, partial_attention
from ..engine.checks import reference_model as ref
from ..engine.contract import Forward, PositionalAttention
from ..engine.math.positions import chunk_plan, planned_chunks
from ..engine.math.rope import rotate
from ..errors import ConfigError
from .method import Method, SeamExample

SCORES_PER_BLOCK = 2**22  # float32 scores held at once while selecting (16 MB): keys are scored a block at a time
# Scores closer than TIE * |q| * max |k| are ties, which the earlier key wins. A repeated token has the same
# un-rotated key in the first layer, but a matrix product rounds identical columns differently: without this the
# choice among its copies would follow the product's tiling, not the input.
TIE = 2.0**-16


def earliest_best(scores: torch.Tensor, keep: int, tolerance: torch.Tensor) -> torch.Tensor:
    """The `keep` best of each row of scores (..., N), the earliest among ties within `tolerance` (..., 1): their
    positions in the row, ascending, (..., keep). Only a row whose (k+1)-th best is within `tolerance` of its k-th
    has ties to break; the others keep what topk found."""
    if keep == scores.shape[-1]:  # every score: nothing to break
        return torch.arange(keep, device=scores.device).expand_as(scores)
    values, positions = scores.topk(keep + 1, dim=-1)  # the one after the k-th: is it tied with it?
    threshold, positions = values[..., keep - 1 : keep], positions[..., :keep].clone()
    crowded = values[..., keep] >= threshold[..., 0] - tolerance[..., 0]
    if crowded.any():
        rows, low = scores[crowded], threshold[crowded]
        above = rows > low + tolerance[crowded]
        tied = (rows >= low - tolerance[crowded]) & ~above
        need = keep - above.sum(-1, keepdim=True)  # at least 1: the threshold's own score is tied
        chosen = above | (tied & (tied.cumsum(-1) <= need))
        positions[crowded] = chosen.nonzero()[:, -1].view(-1, keep)
    return positions.sort(dim=-1).values


def select(query: torch.Tensor, middle: torch.Tensor, top_keys: int, span: int, clip: int) -> torch.Tensor:
    """The middle keys a chunk attends: query (H, q, D) and middle (Hkv, M, D), both un-rotated, one sequence.
    Returns their sorted indices into the middle (LongTensor). Never holds more than SCORES_PER_BLOCK scores: each
    block of keys gives its best k a row, and the best k of those candidates are the row's (the best of a union are
    among its parts'; the candidates stay in token order, so the earlier of ties still comes first)."""
    heads, rows, dim = query.shape
    kv_heads, length = middle.shape[0], middle.shape[1]
    stacked = query.float().reshape(kv_heads, heads // kv_heads * rows, dim)  # head h = kv * group + g: kv = h // g
    tolerance = TIE * stacked.norm(dim=-1, keepdim=True) * middle.float().norm(dim=-1).amax(-1)[:, None, None]
    keep = min(top_keys, length)
    block = max(keep, SCORES_PER_BLOCK // (heads * rows))
    candidate_scores, candidates = [], []
    for first in range(0, length, block):
        scores = torch.matmul(stacked, middle[:, first : first + block].float().transpose(-1, -2))
        picked = earliest_best(scores, min(keep, scores.shape[-1]), tolerance)
        candidate_scores.append(scores.gather(-1, picked))
        candidates.append(picked + first)
    scores, indices = torch.cat(candidate_scores, dim=-1), torch.cat(candidates, dim=-1)
    best = indices.gather(-1, earliest_best(scores, keep, tolerance))
    votes = torch.bincount(best.flatten(), minlength=length)
    chosen = votes.nonzero().squeeze(1)
    if len(chosen) > clip:  # the most voted, the earlier of equals first (a stable sort of ascending indices)
        chosen = chosen[torch.sort(votes[chosen], descending=True, stable=True).indices[:clip]].sort().values
    # Each chosen key's span, clamped to the middle: +1 where a span starts, -1 where it ends, summed along.
    edges = torch.zeros(length + 1, dtype=torch.long, device=middle.device)
    ones = torch.ones_like(chosen)
    edges.index_add_(0, (chosen - span // 2).clamp(min=0), ones)
    edges.index_add_(0, (chosen + span - span // 2).clamp(max=length), -ones)
    return (edges.cumsum(0)[:length] > 0).nonzero().squeeze(1)


class ReAttention(PositionalAttention):
    name = "reattention"

    def __init__(self, train_len: int, sink: int, local_window: int, top_keys: int, span: int, clip: int,
                 chunk_size: int) -> None:
        self.train_len, self.sink, self.local_window = train_len, sink, local_window
        self.top_keys, self.span, self.clip, self.chunk_size = top_keys, span, clip, chunk_size
        self.exact_until = train_len  # the whole input inside the window: the unpatched model

    def table_rows(self, start: int, stop: int) -> int:
        return min(stop, self.train_len)  # n <= sink + clip * span + local window <= train_len

    def chunk_ends(self, start: int, stop: int, cuts: list[int]) -> list[int]:
        """Where a forward over [start, stop) may end without changing the results: its chunks' ends (one selection
        each), each of `cuts` ending a forward too."""
        return [last for stretch in planned_chunks(start, stop, cuts, self.train_len, self.chunk_size)
                for _, last in stretch]

    def attend(self, forward: Forward, module: nn.Module, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, scaling: float, dropout: float, **kwargs) -> torch.Tensor:
        """Each chunk of the forward: the unpatched model within the window, else its own selection (module
        docstring), a batch row at a time (rows select apart)."""
        partial = partial_attention(forward.attention_plan(query, key, value, dropout), value.dtype)
        table = forward.table(query.device, query.dtype)
        outputs = []
        for first, last in chunk_plan(forward.start, forward.stop, self.train_len, self.chunk_size):
            if last <= self.train_len:  # only the first chunk can end inside the window
                outputs.append(forward.exact_attention(module, query, key, value, last, scaling, dropout, **kwargs))
                continue
            queries = query[:, :, first - forward.start : last - forward.start]
            rows = []
            for row in range(query.shape[0]):
                kept = self.kept_keys(queries[row], key[row], last)
                keys, values = key[row : row + 1, :, kept], value[row : row + 1, :, kept]
                n = len(kept)
                rotated_query = rotate(queries[row : row + 1], table.cos[n - (last - first) : n],
                                       table.sin[n - (last - first) : n])
                rotated_keys = rotate(keys, table.cos[:n], table.sin[:n])
                rows.append(causal_partial(rotated_query, rotated_keys, values, scaling, partial).output)
            outputs.append(torch.cat(rows).transpose(1, 2))
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)

    def kept_keys(self, query: torch.Tensor, key: torch.Tensor, stop: int) -> torch.Tensor:
        """Token indices a chunk ending at `stop` attends, in order: the sink, the selected spans of the middle, the
        local window. query (H, q, D) and key (Hkv, >= stop, D) of one sequence, un-rotated."""
        local = stop - self.local_window
        chosen = select(query, key[:, self.sink : local], self.top_keys, self.span, self.clip) + self.sink
        device = chosen.device
        return torch.cat((torch.arange(self.sink, device=device), chosen, torch.arange(local, stop, device=device)))


def _settings(config: PretrainedConfig, settings: MethodSettings, train_len: int, tokens: int | None) -> dict:
    """The authors' settings (sink 32, top 4, spans of 32, local window L/2, chunks L/8: their Llama-3-8B run with
    8K tokens, 32 + 127 * 32 + 4096 = 8192), the sink and spans at most L/16 on smaller windows; as many spans as
    fit the window."""
    sink = settings.sink_tokens if settings.sink_tokens is not None else min(32, train_len // 16)
    span = settings.span_size or max(1, min(32, train_len // 16))
    local = settings.local_window if settings.local_window is not None else train_len // 2
    chunk = settings.chunk_size or max(1, train_len // 8)
    room = train_len - sink - local
    if local < 1 or room < span:
        raise ConfigError(f"reattention keeps --sink-tokens ({sink}) + --local-window ({local}) + at least one span "
                          f"(--span-size {span}) within train_len ({train_len}); lower one of them")
    clip = settings.recall_clip or room // span
    if sink + clip * span + local > train_len:
        raise ConfigError(f"--recall-clip {clip} spans of {span} tokens, with --sink-tokens {sink} and "
                          f"--local-window {local}, place keys past train_len ({train_len}): at most {room // span}")
    if chunk > local:
        raise ConfigError(f"--chunk-size ({chunk}) must be at most --local-window ({local}) for reattention: a "
                          "chunk's queries see each other through the local window")
    return {"train_len": train_len, "sink_tokens": sink, "local_window": local, "top_keys": settings.top_keys or 4,
            "span_size": span, "recall_clip": clip, "chunk_size": chunk}


def _attention(config: PretrainedConfig, settings: MethodSettings, s: dict) -> ReAttention:
    return ReAttention(s["train_len"], s["sink_tokens"], s["local_window"], s["top_keys"], s["span_size"],
                       s["recall_clip"], s["chunk_size"])


def _reference(model: nn.Module, s: dict) -> ref.NaiveReAttention:
    return ref.NaiveReAttention(model, s["train_len"], s["sink_tokens"], s["local_window"], s["top_keys"],
                                s["span_size"], s["recall_clip"], s["chunk_size"], TIE)


METHOD = Method("reattention", _settings, _attention,
                boundaries=lambda method, start, stop, cuts: method.chunk_ends(start, stop, cuts),
                step=lambda method: 8 * method.chunk_size,  # 8 chunks a forward
                examples=(SeamExample("reattention", MethodSettings(sink_tokens=2, local_window=6, top_keys=2,
                                                                    span_size=2, chunk_size=4), _reference),))
