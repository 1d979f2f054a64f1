"""A method's logits fed in several forwards through one cache, greedy decoding through the engine, and Llama 3's
architecture (without weights) for the methods' published settings."""

import torch
from transformers import DynamicCache, LlamaConfig

from gali_cli.engine.seam.cache_argument import with_cache


def forwards(model, ids: torch.Tensor, cuts: list[int]) -> torch.Tensor:
    """Logits of `ids` fed in forwards ending at `cuts`, through one cache."""
    cache, outputs, start = DynamicCache(config=model.config), [], 0
    for stop in cuts:
        outputs.append(model(ids[:, start:stop], **with_cache(model, cache), use_cache=True).logits)
        start = stop
    return torch.cat(outputs, dim=1)


def engine_greedy(model, ids: torch.Tensor, steps: int) -> list[int]:
    cache = DynamicCache(config=model.config)
    logits, tokens = model(ids, **with_cache(model, cache), use_cache=True).logits[0, -1], []
    for _ in range(steps):
        tokens.append(int(logits.argmax()))
        logits = model(torch.tensor([[tokens[-1]]]), **with_cache(model, cache), use_cache=True).logits[0, -1]
    return tokens


def llama3_config(version: str) -> LlamaConfig:
    """The architecture of Llama-3-8B(-Instruct) or Llama-3.1-8B(-Instruct), without weights."""
    rope = {"rope_type": "default", "rope_theta": 500000.0} if version == "3" else {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    return LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, rope_parameters=rope,
                       max_position_embeddings=8192 if version == "3" else 131072)
