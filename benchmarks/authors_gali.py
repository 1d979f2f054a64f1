"""The authors' GALI code (adlnlp/Gali) run on tiny random Llamas: the outputs tests/methods/test_authors_gali.py holds
gali to, on every transformers release gali supports.

It runs in an environment of its own, with the transformers the authors pinned and their repository on the path:

    python3 -m venv /tmp/authors && /tmp/authors/bin/pip install torch==2.13.0 transformers==4.46.2 numpy
    # a checkout of adlnlp/Gali in /tmp/gali-authors (the search tool's fetch, then git clone of the mirror)
    PYTHONPATH=/tmp/gali-authors /tmp/authors/bin/python benchmarks/authors_gali.py tests/data/authors_gali.safetensors

Nothing of theirs is copied: their patch functions (models/DPI/patches/Llama.py) are imported and bound to the
model's modules as their loader does for method "dpi" (models/DPI/dpi_withoutflash.py), and the model is driven
through `model.generate`, their entry point, which prefills train_len tokens, then chunk by chunk, then decodes.
float32 and noise off: their noise draws from torch's global generator, which nothing else can reproduce. The file
holds each case's weights, prompt, every prefill logit, the greedy tokens and the logits each was chosen from.
"""

import sys
from types import MethodType

import torch
from models.DPI.patches import Llama as authors  # from the authors' checkout on PYTHONPATH
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 64
# name: (train_len, heads, kv heads, hidden, chunk size, local window, prompt tokens, decoded tokens)
CASES = {
    "gqa2": (16, 4, 2, 32, 4, 2, 41, 6),
    "mqa": (32, 4, 1, 64, 8, 8, 100, 6),
    "no_window": (16, 4, 4, 32, 4, 0, 48, 6),  # local window 0 with T a multiple of train_len: ceil reaches L
}


def tiny_llama(train_len: int, heads: int, kv_heads: int, hidden: int, seed: int) -> LlamaForCausalLM:
    """A random Llama whose attention is sharp enough for position errors to show (as tests/conftest.py's)."""
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=train_len,
                         rope_theta=10000.0, attn_implementation="sdpa", pad_token_id=0, eos_token_id=None,
                         bos_token_id=None)
    model = LlamaForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.ndim == 2:
                std = (2.0 if "q_proj" in name else 1.0) / parameter.shape[1] ** 0.5
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * (1.0 if "embed" in name else std))
    return model


def patch_as_the_authors_do(model: LlamaForCausalLM, chunk_size: int, local_window: int) -> None:
    """Their loader's method "dpi": their attention, rotary, model forward and generation loop, bound to the model."""
    model.config.dpi_config = {"local_window": local_window, "chunk_coe": chunk_size, "appro_attn": True,
                               "noise_type": "no"}
    model.config.output_attentions = True
    bindings = {"LlamaSdpaAttention": ("forward", authors.dpi_llamaattn_forward),
                "LlamaRotaryEmbedding": ("forward", authors.rope_forward_dpi_with_pi),
                "LlamaModel": ("forward", authors.dpi_llamamodel_forward)}
    bound = set()
    for module in model.modules():
        if type(module).__name__ in bindings:
            name, function = bindings[type(module).__name__]
            setattr(module, name, MethodType(function, module))
            bound.add(type(module).__name__)
    for name, function in (("_sample", authors.dpi_sample),
                           ("prepare_inputs_for_generation", authors.dpi_prepare_inputs_for_generation),
                           ("_update_model_kwargs_for_generation", authors.dpi_update_model_kwargs_for_generation)):
        setattr(model, name, MethodType(function, model))
    if bound != set(bindings):
        raise SystemExit(f"authors_gali: could not bind {set(bindings) - bound} (not transformers 4.46?)")


def run(name: str, train_len: int, heads: int, kv_heads: int, hidden: int, chunk_size: int, local_window: int,
        prompt_len: int, decoded: int, seed: int) -> dict[str, torch.Tensor]:
    model = tiny_llama(train_len, heads, kv_heads, hidden, seed)
    weights = {f"{name}/weights/{key}": value.detach().clone().contiguous() for key, value in
               model.state_dict().items() if not key.endswith("inv_freq")}
    ids = torch.randint(1, VOCAB, (1, prompt_len), generator=torch.Generator().manual_seed(seed + 100))
    patch_as_the_authors_do(model, chunk_size, local_window)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=decoded, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    forwards = [logits[0] for logits in out.logits]  # each forward's logits: prefill chunks whole, then one a step
    prefill = torch.cat(forwards[: len(forwards) - decoded + 1])
    # The logits each greedy token was chosen from: the last prefill forward's last row, then one per decoding step.
    chosen_from = torch.stack([forward[-1] for forward in forwards[len(forwards) - decoded:]])
    assert prefill.shape[0] == prompt_len, (prefill.shape, prompt_len)
    settings = torch.tensor([train_len, heads, kv_heads, hidden, chunk_size, local_window, prompt_len, decoded])
    return {**weights, f"{name}/settings": settings, f"{name}/prompt": ids[0], f"{name}/prefill_logits": prefill,
            f"{name}/token_logits": chosen_from, f"{name}/tokens": out.sequences[0, prompt_len:].clone()}


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    tensors = {}
    for seed, (name, case) in enumerate(CASES.items()):
        tensors |= run(name, *case, seed=seed)
        print(f"{name}: tokens {tensors[f'{name}/tokens'].tolist()}", file=sys.stderr)
    save_file(tensors, sys.argv[1], metadata={"authors_code": "adlnlp/Gali 5a3e947", "transformers": "4.46.2",
                                              "dtype": "float32", "noise": "off"})


if __name__ == "__main__":
    main()
