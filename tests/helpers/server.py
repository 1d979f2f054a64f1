"""gali serve for the tests: a server over a loaded model in a thread of this process, or `gali serve -m demo` as a
process; its clients (the official openai client, raw HTTP); and the model worker's jobs without HTTP."""

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import urlsplit

import openai

from gali_cli.config import MethodSettings
from gali_cli.doc_cache import DocumentCache
from gali_cli.generate import TextPiece, make_sampler, stop_token_ids, stream_generate
from gali_cli.patching import apply_method, prefill_spans
from gali_cli.prompts import ServedPrompt, question_starts, served_parts, served_prompt
from gali_cli.server.app import ServerSettings
from gali_cli.server.run import Server, address, bind
from gali_cli.server.worker import Job, ModelWorker, Sampling
from helpers.timing import scaled
from helpers.tiny_models import CORPUS

DOCUMENT = CORPUS * 7  # about 1,400 tokens: 44 times the tiny model's window
FOREVER = 100_000  # max_tokens of an answer that is still being written when the test acts (no stop token wins)


@contextmanager
def serving(loaded, store_dir: Path | None = None, queue_size: int = 8, **settings):
    """A gali server over `loaded` on a free port of 127.0.0.1, in a thread of this process."""
    store = DocumentCache(store_dir, 2**30, lambda message: None) if store_dir else None
    worker = ModelWorker(loaded, "gali", MethodSettings(), store, queue_size)
    listener = bind("127.0.0.1", 0)
    log: list[str] = []
    server = Server(worker, ServerSettings("tiny", **settings), log.append)
    worker.start()
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    try:
        yield SimpleNamespace(url=address(listener), worker=worker, server=server, thread=thread, log=log)
    finally:
        server.should_exit = True
        thread.join(scaled(30))
        worker.stop()


def client_for(server, api_key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=api_key, max_retries=0, timeout=scaled(120))


def raw(server, method: str, path: str, body: bytes | dict | None = None, headers: dict | None = None):
    """(status, headers, JSON or bytes) of one plain HTTP request; a body is sent as JSON unless `headers` say."""
    parts = urlsplit(server.url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=scaled(120))
    payload = json.dumps(body).encode() if isinstance(body, dict) else body
    json_type = {"Content-Type": "application/json"} if body is not None else {}
    connection.request(method, path, body=payload, headers={**json_type, **(headers or {})})
    response = connection.getresponse()
    data = response.read()
    connection.close()
    try:
        return response.status, {k.lower(): v for k, v in response.getheaders()}, json.loads(data)
    except ValueError:
        return response.status, {k.lower(): v for k, v in response.getheaders()}, data


def ask(client, content: str, max_tokens: int = 8, **options):
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}],
                                          max_tokens=max_tokens, **options)


def long_answer(server):
    """A streamed answer that goes on as long as the test needs, once the model is writing it (the first chunk,
    the role, comes before the job leaves the queue)."""
    stream = ask(client_for(server), "The roof", FOREVER, stream=True)
    next(stream), next(stream)
    assert server.worker.busy and server.worker.waiting == 0
    return stream


def wait_until(condition, seconds: float = 20.0) -> bool:
    """Whether `condition` holds within `seconds`, written for a quiet machine (scaled to this one's load)."""
    deadline = time.monotonic() + scaled(seconds)
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


@contextmanager
def gali_serve(*options: str, sigint_ignored: bool = False, env: dict | None = None):
    """`gali serve -m demo --port 0` as a process; yields (base URL, process, its stderr lines so far).
    `sigint_ignored`: started as a shell without job control starts `gali serve &`."""
    process = subprocess.Popen([sys.executable, "-m", "gali_cli", "serve", "-m", "demo", "--port", "0", *options],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                               preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint_ignored
                               else None)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(process.stderr), daemon=True)
    try:
        for line in process.stderr:
            lines.append(line)
            if found := re.search(r"http://127\.0\.0\.1:\d+", line):
                url = found.group()
                break
        else:
            raise AssertionError(f"gali serve did not start: {''.join(lines)}")
        reader.start()
        yield url, process, lines
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(scaled(30))


def question_prompt(loaded, text: str) -> ServedPrompt:
    parts, bos = served_parts(loaded.tokenizer, ["user"])
    return served_prompt(loaded.tokenizer, parts, [text], [question_starts(text)], bos)


def worker_job(prompt: ServedPrompt, max_new_tokens: int = 6) -> tuple[Job, list]:
    events: list = []
    job = Job(lambda tokenizer, check: prompt, Sampling(max_new_tokens, 0.0, 1.0, 0), "test", loop=None)
    job.emit = events.append  # no event loop here: the test reads the events directly
    return job, events


def fresh_answer(loaded, prompt: ServedPrompt, max_new_tokens: int = 6, method: str = "gali") -> str:
    apply_method(loaded.model, method, MethodSettings(), len(prompt.ids))
    events = stream_generate(loaded.model, loaded.tokenizer, prompt.ids, make_sampler(), max_new_tokens,
                             stop_token_ids(loaded.model, loaded.tokenizer),
                             prefill_spans(loaded.model, method, 0, len(prompt.ids), prompt.cuts))
    return "".join(event.text for event in events if isinstance(event, TextPiece))
