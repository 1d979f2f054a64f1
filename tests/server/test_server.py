"""gali serve as clients see it: the official openai client (and raw HTTP, for what no client would send) against a
server on a free local port. The default tier runs the server in this process over a tiny random Llama (window 32);
the slow tier runs `gali serve -m demo` as a process, as the issue's done-when says."""

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import urlsplit
from urllib.request import urlopen

import openai
import pytest
from helpers.server import DOCUMENT, FOREVER, ask, client_for, gali_serve, long_answer, raw, serving, wait_until
from helpers.timing import scaled
from typer.testing import CliRunner

from gali_cli import cli
from gali_cli.config import MethodSettings
from gali_cli.doc_cache import DocumentCache
from gali_cli.engine.math import positions
from gali_cli.generate import TextPiece, make_sampler, stop_token_ids, stream_generate
from gali_cli.loading import load_model
from gali_cli.patching import apply_method, prefill_spans
from gali_cli.prompts import ServedPrompt, ask_instruction, raw_prompt, served_parts, served_prompt
from gali_cli.server import worker as worker_module
from gali_cli.server.guard import Reach
from gali_cli.server.reuse import States
from gali_cli.server.run import Server
from gali_cli.server.schemas import Message
from gali_cli.server.worker import ModelWorker


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load_model(str(tiny_model_dir), "none", "cpu", "float32")


@pytest.fixture(scope="module")
def served(loaded, tmp_path_factory):
    with serving(loaded, tmp_path_factory.mktemp("served-cache"), max_body_bytes=2**20) as server:
        yield server


def direct(loaded, messages: list[dict], max_tokens: int) -> tuple[str, ServedPrompt]:
    """The answer gali's own generation gives the prompt the server builds, read from scratch; and the prompt."""
    parsed = [Message.model_validate(message) for message in messages]
    parts, bos = served_parts(loaded.tokenizer, [message.role for message in parsed])
    prompt = served_prompt(loaded.tokenizer, parts, [m.text for m in parsed], [m.cuts() for m in parsed], bos)
    apply_method(loaded.model, "gali", MethodSettings(), len(prompt.ids))
    events = stream_generate(loaded.model, loaded.tokenizer, prompt.ids, make_sampler(), max_tokens,
                             stop_token_ids(loaded.model, loaded.tokenizer),
                             prefill_spans(loaded.model, "gali", 0, len(prompt.ids), prompt.cuts))
    return "".join(event.text for event in events if isinstance(event, TextPiece)), prompt


def test_models_and_health(served):
    client = client_for(served)
    assert [model.id for model in client.models.list()] == ["tiny"]
    assert client.models.retrieve("tiny").owned_by == "gali"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    status, _, health = raw(served, "GET", "/health")
    assert status == 200 and health["status"] == "ok" and health["method"] == "gali" and health["train_len"] == 32
    assert health["model_train_len"] == 32


@pytest.mark.parametrize("content", [
    [{"type": "text", "text": f"Part {index} of a long report. "} for index in range(1000)],  # the request
    "x" * 100_000,  # past the limit by characters alone: refused without tokenizing
])
def test_a_prompt_past_max_prompt_tokens_is_a_400_at_once(loaded, content):
    with serving(loaded, max_prompt_tokens=500) as server:
        client = client_for(server)
        assert client.models.retrieve("tiny").model_extra["max_prompt_tokens"] == 500
        assert raw(server, "GET", "/health")[2]["max_prompt_tokens"] == 500
        started = time.monotonic()
        with pytest.raises(openai.BadRequestError) as error:
            ask(client, content)
        assert time.monotonic() - started < scaled(5)
        assert error.value.code == "context_length_exceeded" and "500" in error.value.message
        assert server.worker.waiting == 0 and "queued" not in server.log[-1]
        assert ask(client, "Still there?", 2).usage.completion_tokens == 2


def test_a_long_count_neither_blocks_a_short_prompt_nor_outlives_its_client(loaded, monkeypatch):
    """Counting a huge prompt (--max-prompt-tokens raised) ran whole under the one counting lock: a 2-token request
    waited behind it, memory peaked at 5 GB, and neither the client leaving nor SIGTERM stopped it. It is counted a
    piece at a time with a copy of its own, and stops when `gone` says so; the count is the whole text's."""
    from gali_cli.server.app import _PromptBound
    from gali_cli.server.schemas import APIError

    bound = _PromptBound(loaded.tokenizer, 10**6)
    text = "The cat sat on the mat.\n" * 20_000  # 480,000 characters: several pieces
    whole = len(loaded.tokenizer(text, add_special_tokens=False)["input_ids"])
    with bound.counters[1][1]:  # a long count holds its copy: a short prompt is still counted at once
        checked = threading.Thread(target=bound.check, args=(["Hi there"],))
        checked.start()
        checked.join(scaled(10))
        assert not checked.is_alive(), "a short prompt waited behind a long count"
    _PromptBound(loaded.tokenizer, whole).check([text])  # the count in pieces is the whole text's
    with pytest.raises(APIError, match=f"at least {whole + 1}|at least {whole}"):
        _PromptBound(loaded.tokenizer, whole - 1).check([text])
    tokenized, calls = [], []
    tokenizer_call = type(loaded.tokenizer).__call__

    def recording(self, piece, *args, **kwargs):
        tokenized.append(len(piece))
        return tokenizer_call(self, piece, *args, **kwargs)

    monkeypatch.setattr(type(loaded.tokenizer), "__call__", recording)

    def gone() -> None:
        calls.append(1)
        if len(calls) == 3:
            raise APIError(499, "the client went away while its prompt was counted")

    with pytest.raises(APIError, match="went away"):
        bound.check([text], gone)
    assert max(tokenized) <= 2 * bound.PIECE and sum(tokenized) < len(text) // 2  # stopped early, in pieces


def test_the_worker_refuses_a_templated_prompt_past_the_limit_before_any_forward(loaded):
    """The chat template adds tokens the early count does not see: the exact count is checked before reading."""
    with serving(loaded, max_prompt_tokens=40) as server:
        text = "word " * 30  # about 30 tokens of text, over 40 with the template's
        status, _, body = raw(server, "POST", "/v1/chat/completions",
                              {"model": "tiny", "messages": [{"role": "user", "content": text}] * 2})
        assert status == 400 and body["error"]["code"] == "context_length_exceeded", body


def test_a_chat_answer_is_gali_reading_the_whole_prompt(served, loaded):
    """44 windows of text: every token is read (usage says so), and the answer is gali's own generation."""
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": f"Whole.\n{DOCUMENT}\n\nWhen does the lease end?"}]
    answer = client_for(served).chat.completions.create(model="tiny", messages=messages, max_tokens=12)
    expected, prompt = direct(loaded, messages, 12)
    assert answer.choices[0].message.content == expected and answer.choices[0].finish_reason == "length"
    assert answer.usage.prompt_tokens == len(prompt.ids) > 40 * 32 and answer.usage.completion_tokens == 12
    assert answer.object == "chat.completion" and answer.model == "tiny"


def test_a_streamed_chat_matches_the_whole_answer_and_ends_with_done(served):
    client = client_for(served)
    content = f"Stream.\n{DOCUMENT}\n\nWho repairs the roof?"
    whole = ask(client, content, 10).choices[0].message.content
    chunks = list(ask(client, content, 10, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices) == whole
    assert chunks[-2].choices[0].finish_reason == "length" and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 10
    status, headers, body = raw(served, "POST", "/v1/chat/completions", {
        "model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": True})
    events = body.decode().strip().split("\n\n")
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    assert events[-1] == "data: [DONE]" and all(event.startswith("data: ") for event in events)


def test_a_second_question_starts_from_the_documents_state(served, loaded):
    """The document is read once: the next question about it (and a conversation that goes on) reuses its state
    from memory, and after another document, from the document cache, with the answer a fresh read gives."""
    client = client_for(served)
    document = f"Reuse.\n{DOCUMENT}"
    first = ask(client, f"{document}\n\nWhen does the lease end?")
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    messages = [{"role": "user", "content": f"{document}\n\nWho pays the rent?"}]
    second = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8)
    expected, prompt = direct(loaded, messages, 8)
    assert second.choices[0].message.content == expected
    assert second.usage.prompt_tokens_details.cached_tokens == prompt.shared  # only the question is read
    turn = [*messages, {"role": "assistant", "content": second.choices[0].message.content},
            {"role": "user", "content": "And the roof?"}]
    third = client.chat.completions.create(model="tiny", messages=turn, max_tokens=8)
    assert third.choices[0].message.content == direct(loaded, turn, 8)[0]
    assert third.usage.prompt_tokens_details.cached_tokens > prompt.shared  # the first turn, question included
    ask(client, f"Another.\n{DOCUMENT}\n\nWhen?")  # another document takes the memory
    assert len(served.worker.states.store.entries()) >= 2
    messages = [{"role": "user", "content": f"{document}\n\nWhat does read return?"}]
    fourth = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8)
    expected, prompt = direct(loaded, messages, 8)
    assert fourth.choices[0].message.content == expected
    assert fourth.usage.prompt_tokens_details.cached_tokens == prompt.shared  # from the document cache
    assert "cached" in served.log[-1]


@pytest.mark.parametrize("start, ending", [("", "\n"), ("", "\r\n  \n\n"), ("", ""), (" " * 20, "\n"),
                                           ("\n \t\n", "")])
def test_a_document_sent_as_read_from_its_file_is_served_from_gali_asks_state(loaded, tiny_model_dir, tmp_path,
                                                                              start, ending):
    """open(path).read() keeps the file's final line break (and whatever blank space ends it), and whatever blank
    space starts it (the GPL begins with 20 spaces: issue 50 read it twice): the server serves the state `gali ask`
    stored all the same."""
    document = tmp_path / "lease.txt"
    document.write_bytes((start + DOCUMENT.strip() + ending).encode())
    stored = CliRunner().invoke(cli.app, ["ask", str(document), "Who pays the rent?", "-m", str(tiny_model_dir),
                                          "--max-new-tokens", "2", "--cache-dir", str(tmp_path / "cache")])
    assert stored.exit_code == 0, stored.stderr
    entry, = DocumentCache(tmp_path / "cache", 2**30, print).entries()
    with serving(loaded, tmp_path / "cache") as server:
        text = document.read_text()  # as open(path).read() gives it
        answer = ask(client_for(server), f"{text}\n\n{ask_instruction('When does the lease end?')}", 2)
    assert answer.usage.prompt_tokens_details.cached_tokens == entry.tokens


def test_a_chat_answer_never_ends_before_its_first_token(loaded, monkeypatch):
    """Issue 50: after 81 s of reading, the model's first token was its stop token, and the openai client got an
    empty answer ("stop", 1 token) without a word. A chat answer now goes on with the model's next best token, and
    the log says so; a raw completion may still end at once (its text may be complete)."""
    stops = stop_token_ids(loaded.model, loaded.tokenizer)

    def ends_at_once(*args):  # a model whose every pick is a stop token where it may be
        def sample(logits):
            allowed = [token for token in sorted(stops) if logits[token] > float("-inf")]
            return allowed[0] if allowed else int(logits.argmax())

        return sample

    monkeypatch.setattr(worker_module, "make_sampler", ends_at_once)
    messages = [{"role": "user", "content": f"{DOCUMENT}\n\nWhat are the action items?"}]
    with serving(loaded) as server:
        client = client_for(server)
        chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8)
        completion = client.completions.create(model="tiny", prompt="The end.", max_tokens=8)
    monkeypatch.undo()
    assert chat.choices[0].message.content == direct(loaded, messages, 1)[0]  # the best token that is no stop
    assert chat.usage.completion_tokens == 2 and chat.choices[0].finish_reason == "stop"
    chat_line, completion_line = [line for line in server.log if '"POST /v1/' in line]
    assert chat_line.endswith("stop (the model's first pick ended the answer at once: its next best went on)")
    assert completion.choices[0].text == "" and completion.usage.completion_tokens == 1
    assert completion_line.endswith(", stop")


def test_completions_from_text_and_from_token_ids(served, loaded):
    client = client_for(served)
    text = client.completions.create(model="tiny", prompt="def read(path):\n", max_tokens=6)
    prompt = raw_prompt(loaded.tokenizer, "def read(path):\n")
    apply_method(loaded.model, "gali", MethodSettings(), len(prompt.ids))
    events = stream_generate(loaded.model, loaded.tokenizer, prompt.ids, make_sampler(), 6,
                             stop_token_ids(loaded.model, loaded.tokenizer),
                             prefill_spans(loaded.model, "gali", 0, len(prompt.ids), prompt.cuts))
    assert text.choices[0].text == "".join(event.text for event in events if isinstance(event, TextPiece))
    assert text.object == "text_completion" and text.usage.prompt_tokens == len(prompt.ids)
    by_ids = client.completions.create(model="tiny", prompt=prompt.ids, max_tokens=6)
    assert by_ids.choices[0].text == text.choices[0].text
    streamed = client.completions.create(model="tiny", prompt="def read(path):\n", max_tokens=6, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed) == text.choices[0].text


def test_sampling_options_stop_strings_and_seeds(served):
    client = client_for(served)
    greedy = ask(client, "The tenant pays", 12).choices[0].message.content
    stop = greedy[len(greedy) // 2: len(greedy) // 2 + 2]
    cut = ask(client, "The tenant pays", 12, stop=[stop, "never there"])
    assert cut.choices[0].message.content == greedy[: greedy.index(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = ask(client, "The tenant pays", 12, stop=stop, stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in streamed) == greedy[: greedy.index(stop)]
    sampled = [ask(client, "The tenant pays", 12, temperature=1.0, seed=seed).choices[0].message.content
               for seed in (7, 7, 8)]
    assert sampled[0] == sampled[1] != sampled[2]
    assert ask(client, "The tenant pays", 12, top_p=0.0, temperature=1.0).choices[0].message.content == greedy


MESSAGES = [{"role": "user", "content": "Hi"}]
BAD_REQUESTS = {
    "malformed JSON": (b'{"model": "tiny", "messages": [', 400, None),
    "not an object": (b"[1, 2]", 400, None),
    "not UTF-8": (b'{"model": "\xff"}', 400, None),
    "NaN": (b'{"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "temperature": NaN}', 400, None),
    "no messages": ({"model": "tiny"}, 400, "messages"),
    "empty messages": ({"model": "tiny", "messages": []}, 400, "messages"),
    "no model": ({"messages": MESSAGES}, 400, "model"),
    "a string for a number": ({"model": "tiny", "messages": MESSAGES, "max_tokens": "5"}, 400, "max_tokens"),
    "a boolean for a number": ({"model": "tiny", "messages": MESSAGES, "max_tokens": True}, 400, "max_tokens"),
    "no tokens wanted": ({"model": "tiny", "messages": MESSAGES, "max_tokens": 0}, 400, "max_tokens"),
    "too hot": ({"model": "tiny", "messages": MESSAGES, "temperature": 2.5}, 400, "temperature"),
    "top_p above 1": ({"model": "tiny", "messages": MESSAGES, "top_p": 1.5}, 400, "top_p"),
    "a seed too large": ({"model": "tiny", "messages": MESSAGES, "seed": 2**64}, 400, "seed"),
    "a tool's message": ({"model": "tiny", "messages": [{"role": "tool", "content": "x"}]}, 400, "messages.0.role"),
    "no content": ({"model": "tiny", "messages": [{"role": "assistant", "content": None}]}, 400,
                   "messages.0.content"),
    "an image": ({"model": "tiny", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}]}]}, 400, "messages.0.content"),
    "five stop strings": ({"model": "tiny", "messages": MESSAGES, "stop": list("abcde")}, 400, "stop"),
    "two choices": ({"model": "tiny", "messages": MESSAGES, "n": 2}, 400, "n"),
    "tools": ({"model": "tiny", "messages": MESSAGES, "tools": [{"type": "function"}]}, 400, "tools"),
    "penalties": ({"model": "tiny", "messages": MESSAGES, "presence_penalty": 1}, 400, "presence_penalty"),
    "another model": ({"model": "gpt-4o", "messages": MESSAGES}, 404, "model"),
}


@pytest.mark.parametrize("name", BAD_REQUESTS)
def test_bad_chat_requests_get_openai_style_errors(served, name):
    body, status, param = BAD_REQUESTS[name]
    got, _, error = raw(served, "POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    assert got == status, error
    assert isinstance(error["error"]["message"], str) and error["error"]["type"] and error["error"]["param"] == param


@pytest.mark.parametrize("body, param", [
    ({"model": "tiny", "prompt": ["one", "two"]}, "prompt"),
    ({"model": "tiny", "prompt": []}, "prompt"),
    ({"model": "tiny", "prompt": [1, 99999]}, "prompt"),
    ({"model": "tiny", "prompt": "Hi", "echo": True}, "echo"),
    ({"model": "tiny", "prompt": "Hi", "best_of": 3}, "best_of"),
])
def test_bad_completion_requests(served, body, param):
    status, _, error = raw(served, "POST", "/v1/completions", body)
    assert status == 400 and error["error"]["param"] == param


def test_oversized_bodies_wrong_routes_and_the_server_keeps_serving(served):
    big = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x" * 2**20}]}).encode()
    status, _, error = raw(served, "POST", "/v1/chat/completions", big)
    assert status == 413 and error["error"]["code"] == "request_too_large"
    status, headers, error = raw(served, "POST", "/v1/chat/completions", b"{}", {"Content-Length": "nine"})
    assert status == 400 and headers["content-type"] == "application/json"  # uvicorn's own 400, as OpenAI's JSON
    assert error["error"]["code"] == "invalid_http"
    status, _, error = raw(served, "GET", "/v1/chat/completions")
    assert status == 405 and "error" in error
    status, _, error = raw(served, "POST", "/v1/embeddings", {"model": "tiny", "input": "x"})
    assert status == 404 and error["error"]["code"] == "not_found"
    client = client_for(served)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        ask(client, "Hi", temperature=9)
    with pytest.raises(openai.NotFoundError, match="gpt-4o"):
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert ask(client, "Still there?").choices[0].finish_reason == "length"


def test_an_api_key_is_required_when_set(loaded):
    with serving(loaded, api_key="sekret") as server:
        assert [model.id for model in client_for(server, "sekret").models.list()] == ["tiny"]
        with pytest.raises(openai.AuthenticationError):
            client_for(server, "wrong").models.list()
        status, headers, error = raw(server, "POST", "/v1/chat/completions", {"model": "tiny", "messages": MESSAGES})
        assert status == 401 and error["error"]["code"] == "invalid_api_key" and headers["www-authenticate"]
        assert raw(server, "GET", "/health")[0] == 200
        assert ask(client_for(server, "sekret"), "Hi", 2).usage.completion_tokens == 2


def test_a_client_that_goes_away_stops_its_generation(served, loaded):
    client = client_for(served)
    stream = long_answer(served)
    stream.close()
    assert wait_until(lambda: not served.worker.busy), "the model kept generating for nobody"
    assert wait_until(lambda: "cancelled" in served.log[-1])
    # the same without streaming: the connection closes while the answer is being written
    parts = urlsplit(served.url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port)
    connection.request("POST", "/v1/chat/completions", json.dumps(
        {"model": "tiny", "messages": [{"role": "user", "content": "The roof"}], "max_tokens": FOREVER}),
        {"Content-Type": "application/json"})
    assert wait_until(lambda: served.worker.busy)
    connection.close()
    assert wait_until(lambda: not served.worker.busy), "the model kept generating for nobody"
    # the state the cancelled answers left is rolled back: the next answer is the one a fresh read gives
    answer = ask(client, "The roof", 8)
    assert answer.choices[0].message.content == direct(loaded, [{"role": "user", "content": "The roof"}], 8)[0]


def test_six_clients_at_once_all_get_their_own_answer(served):
    questions = [f"{DOCUMENT}\n\nQuestion {index}: who pays?" for index in range(6)]
    answers: dict[int, str] = {}

    def one(index: int) -> None:
        answers[index] = ask(client_for(served), questions[index], 6).choices[0].message.content

    threads = [threading.Thread(target=one, args=(index,)) for index in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(scaled(120))
    assert sorted(answers) == list(range(6))
    assert all(answers[index] == ask(client_for(served), questions[index], 6).choices[0].message.content
               for index in (0, 5))


def test_a_full_queue_answers_429_with_retry_after(loaded):
    with serving(loaded, queue_size=1) as server:
        client, running = client_for(server), long_answer(server)
        waiting: list = []
        thread = threading.Thread(target=lambda: waiting.append(ask(client_for(server), "Hi", 3)))
        thread.start()
        assert wait_until(lambda: server.worker.waiting == 1)
        with pytest.raises(openai.RateLimitError) as refused:
            ask(client, "Hi", 3)
        assert int(refused.value.response.headers["retry-after"]) >= 1
        assert refused.value.body["code"] == "queue_full"
        running.close()
        thread.join(scaled(60))
        assert waiting[0].choices[0].finish_reason == "length"


def test_stopping_ends_the_requests_in_flight(loaded):
    with serving(loaded, queue_size=4) as server:
        running = long_answer(server)
        outcome: list = []

        def queued() -> None:
            try:
                ask(client_for(server), "Hi", 3)
            except openai.APIStatusError as error:
                outcome.append(error.status_code)

        thread = threading.Thread(target=queued)
        thread.start()
        assert wait_until(lambda: server.worker.waiting == 1)
        server.server.handle_exit(signal.SIGTERM, None)
        with pytest.raises(openai.APIError, match="shutting down"):
            for _ in running:
                pass
        thread.join(scaled(30))
        server.thread.join(scaled(30))
        assert outcome == [503] and not server.thread.is_alive() and server.worker.join(0)
        assert server.log[-1] == "stopped"


def test_stopping_waits_for_a_document_cache_write_to_finish(loaded, tmp_path, monkeypatch):
    writing, write = threading.Event(), States.store_shared

    def slow_write(self, *args) -> None:
        writing.set()
        time.sleep(1.0)  # the signal arrives meanwhile
        write(self, *args)

    monkeypatch.setattr(States, "store_shared", slow_write)
    with serving(loaded, tmp_path) as server:
        thread = threading.Thread(target=lambda: ask(client_for(server), f"Saved.\n{DOCUMENT}\n\nWhen?", 2))
        thread.start()
        assert writing.wait(scaled(60))
        server.server.handle_exit(signal.SIGTERM, None)
        server.thread.join(scaled(30))
        thread.join(scaled(30))
        assert not server.thread.is_alive()
    entries = DocumentCache(tmp_path, 2**30, print).entries()
    assert len(entries) == 1 and entries[0].tokens > 1024 and entries[0].document.startswith("gali serve: Saved.")
    assert not list(tmp_path.glob(".partial-*"))


# ---- the real process: `gali serve -m demo` -------------------------------------------------------------------


@pytest.mark.slow
def test_gali_serve_demo_streams_a_document_16_windows_long_to_six_clients_and_stops_on_sigterm():
    """The issue's done-when: the official client streams a chat over a document 16x the demo's window, six
    concurrent requests complete, bad requests get 4xx JSON while it keeps serving, SIGTERM ends it."""
    document = Path(positions.__file__).read_text() * 3
    with gali_serve() as (url, process, lines):
        server = SimpleNamespace(url=url)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=scaled(600))
        stream = client.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": f"{document}\n\nWhat does chunk_plan return?"}],
            max_tokens=16, stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices).strip()
        assert chunks[-1].usage.prompt_tokens > 16 * 256
        results: list = []
        threads = [threading.Thread(target=lambda index=index: results.append(client.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": f"{document}\n\nQuestion {index}?"}], max_tokens=8)))
            for index in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(scaled(600))
        assert len(results) == 6 and all(result.usage.prompt_tokens > 16 * 256 for result in results)
        assert max(result.usage.prompt_tokens_details.cached_tokens for result in results) > 16 * 256
        for body, status in ((b"{", 400), ({"model": "demo", "messages": []}, 400), ({"model": "x", "messages": [
                {"role": "user", "content": "Hi"}]}, 404)):
            got, _, error = raw(server, "POST", "/v1/chat/completions", body)
            assert got == status and error["error"]["message"]
        assert client.models.list().data[0].id == "demo"
        running = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "def"}],
                                                 max_tokens=FOREVER, stream=True)
        next(running)
        process.send_signal(signal.SIGTERM)
        with pytest.raises(openai.APIError):
            for _ in running:
                pass
        assert process.wait(scaled(60)) == -signal.SIGTERM
    cache = Path(os.environ["GALI_CACHE_DIR"])  # this test's own (conftest)
    assert list(cache.glob("*.safetensors")) and not list(cache.glob(".partial-*"))
    log = "".join(lines)
    assert '"POST /v1/chat/completions" 200' in log and "stopped" in log and "Traceback" not in log


def test_the_window_served_is_the_one_the_method_keeps_to(loaded):
    """--train-len narrows the window gali keeps positions within; /health and the start line say that one."""
    assert ModelWorker(loaded, "gali", MethodSettings(train_len=16), None, 2).window == 16
    assert ModelWorker(loaded, "self-extend", MethodSettings(train_len=16), None, 2).window == 16
    assert ModelWorker(loaded, "original", MethodSettings(train_len=16), None, 2).window == 32  # it ignores it
    assert ModelWorker(loaded, "gali", MethodSettings(), None, 2).window == 32


@pytest.mark.slow
def test_gali_serve_says_the_window_of_train_len():
    with gali_serve("--train-len", "64") as (url, process, lines):
        assert "(gali, 64-token window of --train-len, the model's 256, prompts up to " in "".join(lines)
        health = json.loads(urlopen(f"{url}/health", timeout=scaled(60)).read())
        assert health["train_len"] == 64 and health["model_train_len"] == 256
        process.send_signal(signal.SIGINT)
        assert process.wait(scaled(60)) == 130


@pytest.mark.slow
def test_gali_serve_takes_its_port_before_loading_and_ctrl_c_stops_it(tmp_path):
    with gali_serve("--api-key", "sekret") as (url, process, _lines):
        port = urlsplit(url).port
        taken = subprocess.run([sys.executable, "-m", "gali_cli", "serve", "-m", "demo", "--port", str(port)],
                               capture_output=True, text=True, timeout=scaled(120))
        assert taken.returncode == 1 and "cannot listen" in taken.stderr and len(taken.stderr.splitlines()) == 1
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
        process.send_signal(signal.SIGINT)
        assert process.wait(scaled(60)) == 130


@pytest.mark.parametrize("sig, ending", [(signal.SIGINT, KeyboardInterrupt), (signal.SIGTERM, SystemExit)])
def test_a_signal_ignored_at_start_still_ends_the_server_as_it_says(monkeypatch, sig, ending):
    """`gali serve &` from a shell without job control starts with SIGINT ignored: uvicorn stopped on it, restored
    SIG_IGN and raised it again into nothing, and gali exited 0, not 130 (docs/serve.md)."""
    server = Server.__new__(Server)  # only what capture_signals needs: no worker, no app
    server._captured_signals, server.should_exit, server.force_exit = [], False, False
    before = signal.signal(sig, signal.SIG_IGN)
    try:
        with pytest.raises(ending) as stopped, server.capture_signals():
            uvicorn_exit = super(Server, server).handle_exit
            uvicorn_exit(sig, None)  # as uvicorn's handler does when the signal comes
        assert signal.getsignal(sig) is signal.SIG_IGN  # left as it was found
        if ending is SystemExit:
            assert stopped.value.code == 143
    finally:
        signal.signal(sig, before)


@pytest.mark.slow
def test_gali_serve_started_with_sigint_ignored_exits_130_on_it():
    with gali_serve(sigint_ignored=True) as (url, process, lines):
        assert urlopen(f"{url}/health", timeout=scaled(60)).status == 200
        process.send_signal(signal.SIGINT)
        assert process.wait(scaled(60)) == 130
    assert "stopped" in "".join(lines) and "Traceback" not in "".join(lines)


def test_the_access_log_escapes_the_clients_path(served):
    """`%0A` in a path must not forge a log line, nor `%1B[2J` clear the operator's terminal."""
    before = len(served.log)
    status, _, _ = raw(served, "GET", "/v1/models/evil%0AGET%20/forged%20200%1B%5B2J")
    assert status in (401, 404)
    # the line is written once the response is complete: after the client has it
    deadline = time.monotonic() + scaled(10)
    while not any("/v1/models/evil" in line for line in served.log[before:]) and time.monotonic() < deadline:
        time.sleep(0.01)
    line = next(line for line in served.log[before:] if "/v1/models/evil" in line)
    assert "\n" not in line and "\x1b" not in line and "evil\\nGET /forged 200\\x1b[2J" in line


CHAT = {"model": "tiny", "messages": MESSAGES, "max_tokens": 1}


@pytest.mark.parametrize("headers, status, code", [
    ({"Host": "evil.example", "Content-Type": "text/plain"}, 403, "host_not_allowed"),  # what the trial sent
    ({"Host": "evil.example:{port}"}, 403, "host_not_allowed"),  # a DNS-rebinding page: its own name
    ({"Host": "localhost:1"}, 403, "host_not_allowed"),  # another port's name
    ({"Content-Type": "text/plain"}, 415, "unsupported_media_type"),  # a page's "simple" cross-origin POST
    ({"Content-Type": "application/x-www-form-urlencoded"}, 415, "unsupported_media_type"),  # curl -d's default
    ({"Origin": "https://evil.example"}, 403, "origin_not_allowed"),
    ({"Origin": "null"}, 403, "origin_not_allowed"),  # a sandboxed frame or a file:// page
])
def test_a_web_page_cannot_drive_the_server(served, headers, status, code):
    """Only the user's own programs: a foreign Host (DNS rebinding), a page's origin or a body that is not JSON are
    refused before the model sees anything, in OpenAI's error shape."""
    port = str(urlsplit(served.url).port)
    headers = {name: value.replace("{port}", port) for name, value in headers.items()}
    before = served.worker.waiting + served.worker.busy
    got, _, error = raw(served, "POST", "/v1/chat/completions", json.dumps(CHAT).encode(), headers)
    assert (got, error["error"]["code"]) == (status, code), error
    assert served.worker.waiting + served.worker.busy == before
    assert raw(served, "OPTIONS", "/v1/chat/completions", None, {
        "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})[0] == 403  # no CORS by default


@pytest.mark.parametrize("host", ["127.0.0.1:{port}", "localhost:{port}", "LOCALHOST:{port}", "[::1]:{port}"])
def test_the_local_names_of_the_server_are_served(served, host):
    port = str(urlsplit(served.url).port)
    status, _, body = raw(served, "POST", "/v1/chat/completions", CHAT, {"Host": host.replace("{port}", port)})
    assert status == 200, body


def test_allowed_hosts_and_origins_widen_the_reach(loaded):
    """--allow-host and --allow-origin: a proxy's name is served, and a page of an allowed origin gets its
    preflight answered and may read the response."""
    reach = Reach(extra_hosts=frozenset({"gali.example"}), origins=frozenset({"http://localhost:3000"}))
    with serving(loaded, reach=reach) as server:
        assert raw(server, "POST", "/v1/chat/completions", CHAT, {"Host": "gali.example"})[0] == 200
        assert raw(server, "POST", "/v1/chat/completions", CHAT, {"Host": "other.example"})[0] == 403
        status, headers, _ = raw(server, "OPTIONS", "/v1/chat/completions", None, {
            "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
        assert status == 204 and headers["access-control-allow-origin"] == "http://localhost:3000"
        assert "POST" in headers["access-control-allow-methods"]
        assert headers["access-control-allow-headers"] == "authorization, content-type"
        status, headers, _ = raw(server, "POST", "/v1/chat/completions", CHAT, {"Origin": "http://localhost:3000"})
        assert status == 200 and headers["access-control-allow-origin"] == "http://localhost:3000"
        assert raw(server, "POST", "/v1/chat/completions", CHAT, {"Origin": "http://localhost:4000"})[0] == 403
        assert "access-control-allow-origin" not in raw(server, "GET", "/health")[1]  # no Origin: no CORS


@pytest.mark.parametrize("body", [
    b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}',  # a lone surrogate: not Unicode
    b'{"model": "\\udfff", "messages": [{"role": "user", "content": "Hi"}]}',
    b'{"model": "tiny", "metadata": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",  # deeper than any parser goes
])
def test_bodies_no_parser_can_take_are_a_400(served, body):
    status, _, error = raw(served, "POST", "/v1/chat/completions", body)
    assert status == 400 and error["error"]["type"] == "invalid_request_error", error
    assert ask(client_for(served), "Still there?").choices[0].finish_reason == "length"


@pytest.mark.parametrize("body, shown", [
    ({"model": "evil\n\x1b[2J", "messages": MESSAGES}, "the model 'evil\\n\\x1b[2J' does not exist"),  # 404
    ({"model": "tiny", "messages": [{"role": "user", "content": [{"type": "evil\u202e\x1b[2J"}]}]},
     "got 'evil\\u202e\\x1b[2J'"),  # 400
])
def test_request_text_an_error_quotes_is_logged_escaped(served, body, shown):
    """Model names and values from a request reach the access log through the error's message: escaped there."""
    before = len(served.log)
    assert raw(served, "POST", "/v1/chat/completions", body)[0] in (400, 404)
    assert wait_until(lambda: len(served.log) > before)
    line = served.log[-1]
    assert shown in line and "\x1b" not in line and "\n" not in line
