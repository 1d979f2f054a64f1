"""Dual Chunk Attention (An et al. 2024, "Training-Free Long-Context Scaling of LLMs"), ChunkLlama's method.

The input is cut into chunks of s tokens and keys sit at positions j mod s (Eq. 2). A query i attends (Eq. 8):
- to keys of its own chunk at i mod s (intra-chunk: exact distances);
- to keys of the previous chunk at s + (i mod s) while i mod s < w, else at c - 1 (successive-chunk: the w
  nearest keys keep exact distances, Eq. 7);
- to all older keys at c - 1 (inter-chunk, Eq. 5),
with c the pretraining window. Keys are cached without RoPE; positions depend on (i, j) only.
"""

import torch
from torch import nn

from ..engine.dense import grouped_logits, mask_future, tiled_attention
from ..engine.hooks import Forward, PositionalAttention
from ..engine.rope import rotate
from ..errors import ConfigError


class DualChunkAttention(PositionalAttention):
    name = "chunk-llama"

    def __init__(self, chunk_size: int, local_window: int, max_position: int) -> None:
        """`max_position` is c - 1 in the paper's terms (train_len - 1)."""
        if not 0 < chunk_size <= max_position:
            raise ConfigError(f"--dca-chunk-size must be between 1 and train_len - 1 ({max_position}), got {chunk_size}")
        if not 0 <= local_window <= max_position + 1 - chunk_size:
            raise ConfigError(
                f"--local-window must be between 0 and train_len - dca-chunk-size ({max_position + 1 - chunk_size}) "
                f"for chunk-llama, got {local_window}: successive-chunk positions would pass the training window"
            )
        self.chunk_size, self.local_window, self.max_position = chunk_size, local_window, max_position
        self.exact_until = chunk_size  # one chunk: plain RoPE

    def table_rows(self, start: int, stop: int) -> int:
        return self.max_position + 1

    def attend(self, forward: Forward, module: nn.Module, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, scaling: float, dropout: float, **kwargs) -> torch.Tensor:
        size, window, top = self.chunk_size, self.local_window, self.max_position
        start, stop = forward.start, forward.stop
        table = forward.table(query.device, query.dtype)
        cos, sin = table.cos32, table.sin32
        key_index = torch.arange(stop, device=key.device)
        key_chunk, key_position = key_index // size, key_index % size
        keys = rotate(key[:, :, :stop].float(), cos[key_position], sin[key_position])  # (B, Hkv, T, D) at P_k

        def logits(rows: slice) -> torch.Tensor:
            query_index = torch.arange(start + rows.start, start + rows.stop, device=key.device)
            rows_query = query[:, :, rows].float()
            scores = grouped_logits(rotate(rows_query, cos[top], sin[top]), keys, scaling)  # inter-chunk everywhere
            # Own and previous chunk: a band of at most two chunks plus the tile.
            low, high = max(0, (int(query_index[0]) // size - 1) * size), int(query_index[-1]) + 1
            within = query_index % size
            intra = grouped_logits(rotate(rows_query, cos[within], sin[within]), keys[:, :, low:high], scaling)
            successive_position = torch.where(within < window, size + within, top)
            successive = grouped_logits(rotate(rows_query, cos[successive_position], sin[successive_position]),
                                        keys[:, :, low:high], scaling)
            distance = query_index.unsqueeze(1) // size - key_chunk[low:high]  # chunks apart, (n, band)
            scores[..., low:high] = torch.where(
                distance == 0, intra, torch.where(distance == 1, successive, scores[..., low:high])
            )
            mask_future(scores, query_index)
            return scores

        return tiled_attention(logits, value[:, :, :stop], query.shape[1], query.shape[2], dropout).transpose(1, 2)
