"""One document cache for `gali ask` and `gali serve`: a document either of them read is a cache hit for the other,
and the answer is the one a fresh read gives."""

import dataclasses
import json

import pytest
import torch
from helpers.tiny_models import CORPUS
from typer.testing import CliRunner

from gali_cli import cli
from gali_cli.config import MethodSettings
from gali_cli.doc_cache import DocumentCache
from gali_cli.document_states import DocumentStates, state_identity
from gali_cli.engine.seam.kv_cache import new_cache
from gali_cli.generate import TextPiece, prefill
from gali_cli.loading import load_model
from gali_cli.patching import apply_method
from gali_cli.prompts import ask_instruction, prompt_ids, served_parts, served_prompt
from gali_cli.server.reuse import STORE_MIN_TOKENS
from gali_cli.server.schemas import Message
from gali_cli.server.worker import Done, Job, ModelWorker, Sampling

DOCUMENT = CORPUS * 7  # about 1,400 tokens: more than the server stores below (STORE_MIN_TOKENS)


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load_model(str(tiny_model_dir), "none", "cpu", "float32")  # what `gali ask -m DIR` loads on a CPU


@pytest.fixture
def doc(tmp_path):
    path = tmp_path / "lease.txt"
    path.write_text(DOCUMENT)
    return path


def ask(tiny_model_dir, doc, question: str, cache_dir) -> dict:
    """`gali ask` in-process, as JSON (with -v's note on stderr)."""
    result = CliRunner().invoke(cli.app, ["ask", str(doc), question, "-m", str(tiny_model_dir), "--max-new-tokens",
                                          "6", "--json", "-v", *(["--cache-dir", str(cache_dir)] if cache_dir else
                                                                 ["--no-cache"])])
    assert result.exit_code == 0, result.stderr
    return {**json.loads(result.stdout), "stderr": result.stderr}


def serve(loaded, question: str, cache_dir) -> tuple[str, Done]:
    """A chat request as a client sends `gali ask`'s prompt to `gali serve`: the answer and its usage."""
    message = Message.model_validate({"role": "user", "content": f"{DOCUMENT.strip()}\n\n{ask_instruction(question)}"})
    parts, bos = served_parts(loaded.tokenizer, ["user"])
    prompt = served_prompt(loaded.tokenizer, parts, [message.text], [message.cuts()], bos)
    store = DocumentCache(cache_dir, 2**30, lambda warning: None) if cache_dir else None
    worker = ModelWorker(loaded, "gali", MethodSettings(), store, 4)
    events: list = []
    job = Job(lambda tokenizer, check: prompt, Sampling(6, 0.0, 1.0, 0), "gali serve: lease", loop=None)
    job.emit = events.append  # no event loop here: the test reads the events directly
    worker._answer(job)
    assert isinstance(events[-1], Done), events[-1]
    return "".join(event.text for event in events if isinstance(event, TextPiece)), events[-1]


@pytest.mark.slow  # ask's states served: tests/server/test_server.py; the way back: the next test
def test_a_document_read_by_gali_ask_is_served_from_the_cache(tiny_model_dir, loaded, doc, tmp_path):
    first = ask(tiny_model_dir, doc, "Who pays the rent?", tmp_path / "cache")
    entry, = DocumentCache(tmp_path / "cache", 2**30, print).entries()
    assert entry.tokens > STORE_MIN_TOKENS and entry.document.endswith("lease.txt") and entry.method == "gali"
    assert first["cached_tokens"] == 0 and "from the cache" not in first["stderr"]
    answer, done = serve(loaded, "When does the lease end?", tmp_path / "cache")
    assert done.cached_tokens == entry.tokens  # loaded, not read again
    assert answer == serve(loaded, "When does the lease end?", None)[0]  # the answer of a fresh read
    assert len(DocumentCache(tmp_path / "cache", 2**30, print).entries()) == 1


def test_a_document_read_by_gali_serve_is_a_cache_hit_for_gali_ask(tiny_model_dir, loaded, doc, tmp_path):
    _, done = serve(loaded, "Who pays the rent?", tmp_path / "cache")
    entry, = DocumentCache(tmp_path / "cache", 2**30, print).entries()
    assert done.cached_tokens == 0 and entry.tokens > STORE_MIN_TOKENS and entry.document == "gali serve: lease"
    cached = ask(tiny_model_dir, doc, "When does the lease end?", tmp_path / "cache")
    assert f"(document state from the cache: {entry.tokens} tokens not read again)" in cached["stderr"]
    assert cached["cached_tokens"] == entry.tokens
    assert cached["answer"] == ask(tiny_model_dir, doc, "When does the lease end?", None)["answer"]


def test_the_key_names_the_forward_ends_that_change_the_state(loaded):
    """The cuts before a state's last token count where the method does not allow a forward to end anyway (GALI's
    chunk boundaries), and not at all for a method whose forwards may end anywhere."""
    ids = prompt_ids(loaded.tokenizer, DOCUMENT, ask_instruction("When?")).ids[:100]
    apply_method(loaded.model, "gali", MethodSettings(), len(ids))  # train_len 32, chunks of 8: ends at 32, 40, ...
    gali = DocumentStates(loaded, "gali", None)
    assert gali.key(ids, [40, 100], {}) == gali.key(ids, [], {}) != gali.key(ids, [41], {})
    gali_key = gali.key(ids, [], {})
    apply_method(loaded.model, "yarn", MethodSettings(), len(ids))
    yarn = DocumentStates(loaded, "yarn", None)
    assert yarn.key(ids, [41], {}) == yarn.key(ids, [], {}) != gali_key


def test_a_16_bit_cache_s_states_have_keys_of_their_own(loaded, tmp_path):
    """--kv-dtype: a state stored in float32 is not a float16 run's, nor the reverse (nor bfloat16's); the stored
    dtype, as the key names it, is saved with the entry, and a 16-bit state loads back as it was stored. The default
    adds nothing to the identity, so that states stored before the option still match."""
    ids = prompt_ids(loaded.tokenizer, DOCUMENT, ask_instruction("When?")).ids[:80]
    apply_method(loaded.model, "gali", MethodSettings(), len(ids))
    runs = {dtype: dataclasses.replace(loaded, kv_dtype=dtype) for dtype in (None, torch.float16, torch.bfloat16)}
    keys = {dtype: DocumentStates(run, "gali", None).key(ids, [], {}) for dtype, run in runs.items()}
    assert len(set(keys.values())) == 3
    assert keys[None] == DocumentStates(dataclasses.replace(loaded, kv_dtype=torch.float32), "gali", None).key(
        ids, [], {})  # the model's own dtype named: the same rows, the same state
    assert "kv_dtype" not in state_identity(runs[None], "gali", {})
    store = DocumentCache(tmp_path / "states", 2**30, print)
    states = DocumentStates(runs[torch.float16], "gali", store)
    cache = new_cache(loaded.model, torch.float16)
    with torch.inference_mode():
        prefill(loaded.model, torch.tensor([ids]), cache, [(0, len(ids))])
    states.save(ids, [], {}, cache, "lease")
    entry, = store.entries()
    stored = sum(x[:, :, : len(ids)].nbytes for layer in cache.layers for x in (layer.keys, layer.values))
    assert entry.identity["kv_dtype"] == "torch.float16" and stored < entry.size < 2 * stored  # 2 bytes an element
    restored, tokens = states.load(ids, [], [len(ids)], {})
    assert tokens == len(ids) and all(torch.equal(layer.keys, stored.keys) and layer.keys.dtype == torch.float16
                                      for layer, stored in zip(restored.layers, cache.layers, strict=True))
    assert DocumentStates(runs[None], "gali", store).load(ids, [], [len(ids)], {}) is None
