"""Softmax attention split over disjoint key sets and merged back exactly by log-sum-exp: the arithmetic every
route that avoids a (queries x keys) mask shares (dense parts, the windowed methods, decoding, the kernels' runs)."""

from collections.abc import Sequence
from typing import NamedTuple

import torch


class Partial(NamedTuple):
    """Attention of queries over one part of their keys, and what merging it with the other parts needs.

    Softmax attention over disjoint key sets A and B is exactly the two partial results weighted by their shares of
    the normaliser: out = out_A exp(lse_A - lse) + out_B exp(lse_B - lse), lse = logaddexp(lse_A, lse_B)
    (`merge_partials`). So a method whose logits follow different rules on different keys (positions, noise, a
    window) computes each part with an ordinary mask-free call and merges them, never building a (q x T) mask.
    """

    output: torch.Tensor  # (B, H, q, D), normalised over this part's keys
    lse: torch.Tensor  # (B, H, q) float32: log-sum-exp of the part's scaled logits, per query


def merge_partials(parts: Sequence[Partial]) -> Partial:
    """Attention over the union of the parts' (disjoint) key sets, from the parts: exact, see `Partial`.

    Two at a time, each in one lerp: out_A + (out_B - out_A) * share_B (a few small elementwise ops, where a stacked
    log-sum-exp over all parts costs more on the few rows of a decode step). Parts may come in different dtypes (a
    noisy part in the model's, a CUDA part in float32): when they do, the merge is in float32."""
    merged = parts[0]
    for output, lse in parts[1:]:
        if output.dtype != merged.output.dtype:
            merged, output = Partial(merged.output.float(), merged.lse), output.float()
        share = torch.sigmoid(lse - merged.lse).unsqueeze(-1)
        merged = Partial(torch.lerp(merged.output, output, share.to(output.dtype)), torch.logaddexp(merged.lse, lse))
    return merged


def merge_runs(output: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """A decoding step's attention from its runs of keys (flash-decoding, triton_decode and native_decode): outputs
    (B, Hkv, runs, g, D) and log-sum-exps (B, Hkv, runs, g), float32, merged over the runs into (B, Hkv, g, D). An
    empty run has -inf and weighs nothing; the first run holds key 0, seen by every token, so the total is finite."""
    total = torch.logsumexp(lse, dim=2, keepdim=True)
    return (output * torch.exp(lse - total).unsqueeze(-1)).sum(2)
