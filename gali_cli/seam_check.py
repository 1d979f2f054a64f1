"""The end-to-end check of the seam with transformers (`gali info --check`, first): a tiny random Llama built in
memory, patched with each method (then a tiny model of each other family in model/families.py, unpatched and with
GALI), prefilled in several forwards through one KV cache and decoded a few tokens by gali's own calls
(generate.prefill, generate.decode), held to the method's float64 restatement (engine/checks/reference_model.py), which
computes the same model from its weights without transformers.

This is the check that would have caught transformers 5.24, which renamed the cache argument: its prefill of a whole
prompt stayed right, and every later forward ran at position 0. It runs in seconds on a CPU, needs no download, and
reports a seam that fails outright (SeamError) as a failed check with its one-line reason.
"""

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from .config import MethodSettings
from .engine.checks import reference_model as ref
from .engine.checks.self_check import Check
from .engine.seam.kv_cache import new_cache
from .generate import decode, prefill
from .methods.registry import DEFAULT, UNPATCHED, all_methods
from .model.families import FAMILIES
from .patching import apply_method, prefill_spans, remove_method

TRAIN_LEN, PROMPT, DECODED, SPAN = 16, 40, 4, 12  # a prompt 2.5 windows long, fed 12 tokens a forward at most
VOCAB = 64
TOLERANCE = 1e-4  # float32 against float64 on a tiny model; a position off by one moves logits by about 1


def tiny_llama(**sizes) -> PreTrainedModel:
    """A random Llama whose attention is sharp enough for position errors to show in the logits (`tiny_model`)."""
    return tiny_model("llama", **sizes)


def tiny_model(
    model_type: str,
    train_len: int = 16,
    heads: int = 4,
    kv_heads: int = 2,
    hidden: int = 32,
    layers: int | None = None,
    rope_parameters: dict | None = None,
    attn_implementation: str = "sdpa",
    seed: int = 0,
    head_dim: int | None = None,
    **family_fields,
) -> PreTrainedModel:
    """A random model of a family in model/families.py (its config's `model_type`), sized as a tiny Llama: random
    q/k/v biases (Qwen2) and q/k norm weights (Qwen3), so that a restatement missing them is off. `family_fields`
    set other config fields (Mistral's sliding_window, say); `head_dim`: hidden / heads unless given.

    Gemma 3 (`gemma3_text`): three layers, local, global, local, the local ones on an 8-token window and a RoPE base
    of 100 (the global one's 10,000: swapping them shows), the logits scaled by query_pre_attn_scalar = head_dim / 2
    (not 1/sqrt(head_dim): a route ignoring the scaling it is handed shows), and random norm weights (Gemma's
    RMSNorm scales by 1 + weight, zero at init)."""
    rope = rope_parameters or {"rope_type": "default", "rope_theta": 10000.0}
    head_dim = head_dim or hidden // heads
    if model_type == "gemma3_text":
        layers = layers or 3
        family_fields = {"layer_types": ["sliding_attention", "full_attention", "sliding_attention"][:layers]
                         + ["full_attention"] * (layers - 3), "sliding_window": 8,
                         "query_pre_attn_scalar": head_dim // 2, **family_fields}
        rope = {"full_attention": rope, "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}} \
            if "full_attention" not in rope else rope
    elif model_type == "mistral":
        family_fields = {"sliding_window": None, **family_fields}
    config = AutoConfig.for_model(
        model_type,
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers or 2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=train_len,
        rope_parameters=rope,
        attn_implementation=attn_implementation,
        **family_fields,
    )
    with torch.random.fork_rng(devices=[]):  # the global generator as it was afterwards
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config).eval()
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if parameter.ndim == 2:  # unit-variance projections; queries twice as strong for peaked attention
                    std = (2.0 if "q_proj" in name else 1.0) / parameter.shape[1] ** 0.5
                    parameter.normal_(0.0, std if "embed" not in name else 1.0)
                elif name.endswith("_proj.bias"):
                    parameter.normal_(0.0, 0.5)
                elif name.endswith(("q_norm.weight", "k_norm.weight")):
                    parameter.uniform_(0.5, 1.5)
                elif model_type == "gemma3_text" and name.endswith("norm.weight"):
                    parameter.uniform_(-0.5, 0.5)
    return model


@dataclass(frozen=True)
class SeamCase:
    """One method as the seam check runs it: its settings on the tiny model, and its restatement."""

    label: str
    method: str
    settings: MethodSettings
    reference: Callable[[PreTrainedModel, dict], ref.NaiveLlama]  # (patched model, resolved settings)
    decoded: int = DECODED


# Every method's examples, in the registry's order (each method's module declares its own).
CASES = tuple(SeamCase(example.label, name, example.settings, example.reference, DECODED if example.decodes else 0)
              for name, method in all_methods().items() for example in method.examples)


# The other families' checks: the unpatched model and GALI, each through gali's prefill and decode (every method on
# every family: tests/model/test_families.py).
FAMILY_CASES = (UNPATCHED, DEFAULT)


def family_cases(model_type: str) -> list[SeamCase]:
    """The cases the seam check runs on a model of this family: every case on a Llama, FAMILY_CASES on the others
    (what the tests count the checks by)."""
    return list(CASES) if model_type == "llama" else [case for case in CASES if case.label in FAMILY_CASES]


def seam_checks() -> Iterator[Check]:
    """One check per case, as each completes: every case on a Llama, then FAMILY_CASES on each other family."""
    ids = torch.randint(0, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(7))
    for family in FAMILIES:
        model = tiny_model(family.model_type, train_len=TRAIN_LEN)
        cases = family_cases(family.model_type)
        try:
            for case in cases:
                yield seam_check(model, ids, case, "" if family.model_type == "llama" else f"{family.name}, ")
        finally:
            remove_method(model)


def seam_check(model: PreTrainedModel, ids: torch.Tensor, case: SeamCase, family: str = "") -> Check:
    """gali's prefill and greedy decoding of `ids` with `case`'s method against its float64 restatement."""
    name = f"transformers seam, {family}{case.label}: {PROMPT}-token prompt"
    started = time.perf_counter()
    try:
        with torch.inference_mode():
            resolved = apply_method(model, case.method, case.settings, PROMPT + case.decoded)
            spans = prefill_spans(model, case.method, 0, PROMPT, step=SPAN)
            seen: list[torch.Tensor] = []

            def greedy(logits: torch.Tensor) -> int:
                seen.append(logits.double())
                return int(logits.argmax())

            cache = new_cache(model)
            logits = prefill(model, ids, cache, spans)
            tokens = list(decode(model, cache, logits, greedy, case.decoded, stop_ids=set()))
        engine_seconds = time.perf_counter() - started
        started = time.perf_counter()
        reference = case.reference(model, resolved)
        if case.decoded:
            expected_tokens, expected = reference.greedy(ids[0].tolist(), case.decoded)
        else:
            seen, expected_tokens, expected = [logits.double()], [], [reference.prefill(ids[0].tolist())[-1]]
    except Exception as error:  # whatever stops the seam (a SeamError above all) is this check's finding
        return Check(f"{name} ({type(error).__name__}: {' '.join(str(error).split())[:400]})", float("nan"),
                     TOLERANCE, {}, seam=True)
    name += (f" in {len(spans)} forward{'s' if len(spans) > 1 else ''}"
             f"{f' + {case.decoded} decoded tokens' if case.decoded else ''} vs its float64 restatement")
    error = max((got - want).abs().max().item() for got, want in zip(seen, expected))
    if tokens != expected_tokens:
        name, error = f"{name} (decoded {tokens}, expected {expected_tokens})", float("inf")
    seconds = {"engine": engine_seconds, "float64": time.perf_counter() - started}
    return Check(name, error, TOLERANCE, seconds, seam=True)
