"""Shared fixtures: tiny random Llamas and tokenizers built at test time (nothing is ever downloaded)."""

import os
from pathlib import Path

# Triton kernels run on the CPU through Triton's interpreter. It must be chosen before torch imports triton (triton
# decorates its own library when imported); TRITON_INTERPRET=0 tests the compiled kernels on a GPU instead.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

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
def _own_cache_dir(tmp_path_factory, monkeypatch):
    """No test reads or writes the user's document cache."""
    monkeypatch.setenv("GALI_CACHE_DIR", str(tmp_path_factory.mktemp("gali-cache")))
    monkeypatch.delenv("GALI_CACHE_LIMIT", raising=False)


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n{{ message['content'] }}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
CORPUS = (
    "The lease ends in March. The tenant pays rent monthly, and the landlord repairs the roof. "
    "def read(path):\n    return open(path).read()\n" * 4
)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE with Llama 3's special tokens and chat format, trained in a blink."""
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([CORPUS], trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                                   chat_template=CHAT_TEMPLATE)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama (window 32) and its tokenizer on disk; its stop tokens never win a greedy pick."""
    directory = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = tiny_tokenizer()
    model = tiny_llama(train_len=32, hidden=64)
    stops = [tokenizer.convert_tokens_to_ids(t) for t in ("<|end_of_text|>", "<|eot_id|>")]
    model.resize_token_embeddings(len(tokenizer))
    with torch.no_grad():
        model.lm_head.weight[stops] = 0
    model.config.eos_token_id = model.generation_config.eos_token_id = stops
    model.config.bos_token_id = model.generation_config.bos_token_id = 0
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
