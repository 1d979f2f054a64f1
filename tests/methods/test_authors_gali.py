"""gali against the authors' GALI code itself (adlnlp/Gali, run under the transformers it pins, 4.46.2, by
benchmarks/authors_gali.py): the same weights and prompt give the same prefill logits, the same logits at every
decoding step, and the same greedy tokens, on whichever transformers release is installed (scripts/compat.py runs
this file on each). Float32, noise off."""


import pytest
import torch
from helpers.paths import DATA
from safetensors import safe_open
from transformers import DynamicCache

from gali_cli import GaliConfig, apply_gali
from gali_cli.generate import decode, forward_spans, prefill
from gali_cli.patching import forward_ends
from gali_cli.seam_check import tiny_llama

OUTPUTS = DATA / "authors_gali.safetensors"


def authors_case(name: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The case's weights (by parameter name) and the authors' outputs."""
    with safe_open(OUTPUTS, "pt") as outputs:
        # safe_open has keys() but cannot be iterated itself, hence the noqa.
        found = {key.removeprefix(f"{name}/"): outputs.get_tensor(key) for key in outputs.keys()  # noqa: SIM118
                 if key.startswith(f"{name}/")}
    weights = {key.removeprefix("weights/"): value for key, value in found.items() if key.startswith("weights/")}
    return weights, {key: value for key, value in found.items() if not key.startswith("weights/")}


@pytest.mark.parametrize("name", ["gqa2", "mqa", "no_window"])
@pytest.mark.parametrize("span", [1000, 7])  # the prompt in forwards as long as the chunk plan allows, or short ones
def test_gali_equals_the_authors_code(name, span):
    weights, authors = authors_case(name)
    train_len, heads, kv_heads, hidden, chunk_size, local_window, prompt_len, decoded = authors["settings"].tolist()
    model = tiny_llama(train_len=train_len, heads=heads, kv_heads=kv_heads, hidden=hidden)
    model.load_state_dict(weights, strict=False)  # the rotary's inverse frequencies are not weights
    apply_gali(model, GaliConfig(chunk_size=chunk_size, local_window=local_window, noise=False))
    ids = authors["prompt"].unsqueeze(0)
    spans = forward_spans(0, prompt_len, span, forward_ends(model, "gali", 0, prompt_len))
    cache, seen = DynamicCache(config=model.config), []
    with torch.inference_mode():
        whole = model(ids).logits[0]  # every prefill logit, one forward
        last = prefill(model, ids, cache, spans)

        def greedy(logits: torch.Tensor) -> int:
            seen.append(logits)
            return int(logits.argmax())

        tokens = list(decode(model, cache, last, greedy, decoded, stop_ids=set()))
    torch.testing.assert_close(whole, authors["prefill_logits"], rtol=0, atol=1e-4)
    assert tokens == authors["tokens"].tolist()
    torch.testing.assert_close(torch.stack(seen), authors["token_logits"], rtol=0, atol=1e-4)
