"""Dual Chunk Attention (An et al. 2024, "Training-Free Long-Context Scaling of LLMs"), ChunkLlama's method.

The input is cut into chunks of s tokens and keys sit at positions j mod s (Eq. 2). A query i attends (Eq. 8):
- to keys of its own chunk at i mod s (intra-chunk: exact distances);
- to keys of the previous chunk at s + (i mod s) while i mod s < w, else at c - 1 (successive-chunk: the w
  nearest keys keep exact distances, Eq. 7);
- to all older keys at c - 1 (inter-chunk, Eq. 5),
with c the pretraining window. Keys are cached without RoPE; positions depend on (i, j) only, a key's on j alone, so
while decoding the keys are kept rotated from token to token (engine/attention/kept_keys.py).
"""

import torch
from torch import nn
from transformers import PretrainedConfig

from ..config import MethodSettings
from ..engine.attention.dense import causal_partial, merge_partials, partial_attention
from ..engine.checks import reference_model as ref
from ..engine.contract import Forward, KeptKeys, Placement, PositionalAttention
from ..engine.math.rope import rotate
from ..errors import ConfigError
from .method import Method, SeamExample


class DualChunkAttention(PositionalAttention):
    name = "chunk-llama"

    def __init__(self, chunk_size: int, local_window: int, max_position: int) -> None:
        """`max_position` is c - 1 in the paper's terms (train_len - 1)."""
        if not 0 < chunk_size <= max_position:
            raise ConfigError(
                f"--dca-chunk-size must be between 1 and train_len - 1 ({max_position}), got {chunk_size}")
        if not 0 <= local_window <= max_position + 1 - chunk_size:
            raise ConfigError(
                f"--local-window must be between 0 and train_len - dca-chunk-size ({max_position + 1 - chunk_size}) "
                f"for chunk-llama, got {local_window}: successive-chunk positions would pass the training window"
            )
        self.chunk_size, self.local_window, self.max_position = chunk_size, local_window, max_position
        self.exact_until = chunk_size  # one chunk: plain RoPE
        self._kept = KeptKeys()

    def table_rows(self, start: int, stop: int) -> int:
        return self.max_position + 1

    def decode_placement(self, query: torch.Tensor, keys: torch.Tensor) -> Placement:
        """Keys at j mod s; the query at i mod s for its own chunk, at s + i mod s (within the local window) or c - 1
        for the previous one, at c - 1 for older ones."""
        size, top = self.chunk_size, self.max_position
        within = query % size
        successive = torch.where(within < self.local_window, size + within, top)
        chunk = keys // size - query // size  # 0: the query's own chunk, -1: the previous one
        at = torch.where(chunk == 0, within, torch.where(chunk == -1, successive, top))
        # Keys at 0..s - 1, the query at most at max(c - 1, s + local window - 1): offsets of at most that size.
        return Placement(keys % size - at, reach=max(top, size + self.local_window))

    def attend(self, forward: Forward, module: nn.Module, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, scaling: float, dropout: float, **kwargs) -> torch.Tensor:
        """Per chunk of s tokens, three parts merged by their log-sum-exps, each one mask-free call: its own keys
        (causal), the previous chunk's keys and the keys before that, every key rotated once at j mod s."""
        size, start, stop = self.chunk_size, forward.start, forward.stop
        query_tables = forward.memo(("chunk-llama", query.device, query.dtype),
                                    lambda: self._query_tables(forward, query))
        partial = partial_attention(forward.attention_plan(query, key, value, dropout), value.dtype)
        table = forward.table(query.device, query.dtype)

        def key_rotation(first: int, last: int) -> tuple[torch.Tensor, torch.Tensor]:  # keys at P_k = j mod s
            def build() -> tuple[torch.Tensor, torch.Tensor]:
                rows = torch.arange(first, last, device=key.device) % size
                return table.cos[rows], table.sin[rows]

            return forward.memo(("chunk-llama-keys", key.device, key.dtype, first, last), build)

        if stop - start == 1:  # decoding: the keys kept from the previous token, the new one rotated
            keys = self._kept.rotated(forward.cache, module.layer_idx, key, start, stop, key_rotation)
        else:  # a longer forward rotates them for itself: keeping them would hold a copy of every layer's keys
            self._kept.forget(forward.cache)
            keys = rotate(key[:, :, :stop], *key_rotation(0, stop))  # (B, Hkv, T, D)
        # A decoded token past the local window sees the previous chunk at c - 1, as it sees the older ones: one call
        # over both (the successive-chunk part has no key at an exact distance then).
        far_together = stop - start == 1 and start % size >= self.local_window
        intra, inter = rotate(query, *query_tables[0]), rotate(query, *query_tables[2])
        successive = None if far_together else rotate(query, *query_tables[1])
        outputs = []
        for chunk in range(start // size, (stop - 1) // size + 1):
            first, last = max(start, chunk * size), min(stop, (chunk + 1) * size)  # the chunk's queries in this forward
            rows = slice(first - start, last - start)
            begin = chunk * size
            parts = [causal_partial(intra[:, :, rows], keys[:, :, begin:last], value[:, :, begin:last], scaling,
                                    partial)]
            if chunk >= 1 and far_together:
                parts.append(partial(inter[:, :, rows], keys[:, :, :begin], value[:, :, :begin], scaling))
            elif chunk >= 1:
                previous = slice(begin - size, begin)
                parts.append(partial(successive[:, :, rows], keys[:, :, previous], value[:, :, previous], scaling))
            if chunk >= 2 and not far_together:
                parts.append(partial(inter[:, :, rows], keys[:, :, : begin - size], value[:, :, : begin - size],
                                     scaling))
            outputs.append(merge_partials(parts).output)
        return torch.cat(outputs, dim=2).transpose(1, 2) if len(outputs) > 1 else outputs[0].transpose(1, 2)

    def _query_tables(self, forward: Forward, query: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """The forward's query rotations, shared by its layers: (cos, sin) at the intra-chunk (i mod s),
        successive-chunk (s + i mod s within the local window, else c - 1) and inter-chunk (c - 1) positions."""
        size, window, top = self.chunk_size, self.local_window, self.max_position
        table = forward.table(query.device, query.dtype)
        within = torch.arange(forward.start, forward.stop, device=query.device) % size
        successive = torch.where(within < window, size + within, top)
        return tuple((table.cos[rows], table.sin[rows]) for rows in (within, successive, within.new_full((1,), top)))


def _settings(config: PretrainedConfig, settings: MethodSettings, train_len: int, tokens: int | None) -> dict:
    size = settings.dca_chunk_size if settings.dca_chunk_size is not None else 3 * train_len // 4
    window = settings.local_window if settings.local_window is not None else train_len - size
    return {"train_len": train_len, "dca_chunk_size": size, "local_window": window}


METHOD = Method("chunk-llama", _settings, lambda config, settings, s: DualChunkAttention(
    s["dca_chunk_size"], s["local_window"], s["train_len"] - 1), examples=(SeamExample(
        "chunk-llama", MethodSettings(dca_chunk_size=12, local_window=4),
        lambda model, s: ref.NaiveDualChunk(model, s["dca_chunk_size"], s["local_window"], s["train_len"])),))
