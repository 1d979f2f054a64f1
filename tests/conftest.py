"""Shared fixtures: tiny random Llamas built in memory (nothing is ever downloaded)."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 64


def tiny_llama(
    train_len: int = 16,
    heads: int = 4,
    kv_heads: int = 2,
    hidden: int = 32,
    layers: int = 2,
    rope_parameters: dict | None = None,
    attn_implementation: str = "sdpa",
    seed: int = 0,
) -> LlamaForCausalLM:
    """A random Llama whose attention is sharp enough for position errors to show in the logits."""
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=train_len,
        rope_parameters=rope_parameters or {"rope_type": "default", "rope_theta": 10000.0},
        attn_implementation=attn_implementation,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.ndim == 2:  # unit-variance projections; queries twice as strong for peaked attention
                std = (2.0 if "q_proj" in name else 1.0) / parameter.shape[1] ** 0.5
                parameter.normal_(0.0, std if "embed" not in name else 1.0)
    return model


@pytest.fixture
def make_llama():
    return tiny_llama


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield
