"""The ASGI application: OpenAI's routes over one ModelWorker.

Handlers validate a request completely (API key, body size, JSON, fields, model, its size in messages and parts,
the chat template) before it queues, so a bad request is a 4xx at once; then they only wait for the worker's events
and write them out, as one JSON document or as server-sent events. The event loop never runs model work, nor any
work that grows with a request: parsing and the chat template run on a thread (starlette's thread pool).
"""

import asyncio
import copy
import hmac
import json
import secrets
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..errors import ConfigError
from ..generate import TextPiece
from ..printable import printable
from ..prompts import ServedPrompt, longest_token, raw_prompt, served_parts, served_prompt, text_pieces
from .connections import ConnectionLimits
from .guard import Guard, Reach
from .schemas import APIError, ChatRequest, CompletionRequest, Reply, Usage, check_size, parse, read_json
from .worker import Done, Event, Failed, Job, ModelWorker, QueueFull, Sampling, Stopping, too_long_message

KEEP_ALIVE_SECONDS = 15.0  # a comment line on a silent stream (a long queue or prefill), so that proxies wait
LISTEN_SECONDS = 0.05  # how soon a waiting non-streamed request sees that its client went away


@dataclass(frozen=True)
class ServerSettings:
    """What the server was started with, beyond the model and the method."""

    name: str  # the model's name for clients ("model" in requests)
    api_key: str | None = None
    max_body_bytes: int = 32 * 2**20
    max_new_tokens: int = 1024  # when a request does not say (max_tokens)
    temperature: float = 0.0  # when a request does not say
    top_p: float = 1.0
    reach: Reach = field(default_factory=Reach)  # who may use it: the Host names and web origins served (guard.py)
    max_messages: int = 2048  # per chat request (OpenAI's own limit)
    max_parts: int = 2048  # text parts per chat request, in all its messages (a string content is one)
    max_prompt_tokens: int | None = None  # past it, 400 context_length_exceeded (None: no bound)
    connections: ConnectionLimits = field(default_factory=ConnectionLimits)
    # The bodies being read and parsed at once, in all requests: parsing takes many times a body's bytes (docs/serve.md
    # has the factor), so this bounds that memory whatever many clients send; past it, 503 and Retry-After.
    body_budget_bytes: int = 64 * 2**20
    created: int = field(default_factory=lambda: int(time.time()))


def check_api_key(key: str | None, setting: str = "--api-key") -> None:
    """A ConfigError for a key no client can send as meant: an empty one would let in anyone sending an empty Bearer
    token, and one with blank space around it or non-ASCII characters could never match (HTTP headers are ASCII;
    clients strip the blank space)."""
    if key is None:
        return
    if not key:
        raise ConfigError("--api-key '' would let in anyone sending an empty key: leave --api-key out to serve "
                          "without one (GALI_API_KEY='' also means no key)")
    if key != key.strip() or not key.isascii() or not key.isprintable():
        raise ConfigError(f"{setting}: a key must be printable ASCII without blank space around it (clients send "
                          "it in an HTTP header, which could never match this one)")


def create_app(worker: ModelWorker, settings: ServerSettings, log: Callable[[str], None]) -> Starlette:
    """The application; `log` gets one access-log line per request (with the error's message, for an error)."""
    api = _API(worker, settings)
    routes = [
        Route("/health", api.endpoint(api.health)),
        Route("/v1/models", api.endpoint(api.models)),
        Route("/v1/models/{model_id:path}", api.endpoint(api.model)),
        Route("/v1/chat/completions", api.endpoint(api.chat_completions), methods=["POST"]),
        Route("/v1/completions", api.endpoint(api.completions), methods=["POST"]),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error})
    return _AccessLog(Guard(app, settings.reach), log)


class _PromptBound:
    """Refuses a prompt longer than `limit` tokens before it queues, with work bounded by the limit whatever the
    prompt's size: first by characters (no token is longer than the vocabulary's longest, so past limit * that many
    characters the prompt is surely over), then by counting tokens text by text, a piece at a time (text_pieces: the
    same count), stopping as soon as the count passes the limit or `gone` raises (the client left, the server
    stops). Copies of the tokenizer count (the worker's is not thread-safe): one for short prompts and one for long
    ones, so that a 2-token request never waits behind a long count, and a long count holds its copy one piece at a
    time (a 300 MB prompt counted whole held the lock for minutes, 5 GB, and SIGTERM's 30 s). The worker checks the
    exact count of the prompt as templated (worker.PromptTooLong)."""

    SHORT = 2**16  # characters: prompts up to this long are counted with the short prompts' copy
    PIECE = 2**16  # characters tokenized at a time: a piece takes milliseconds

    def __init__(self, tokenizer, limit: int | None) -> None:
        self.limit = limit
        if limit is not None:
            self.counters = [(copy.deepcopy(tokenizer), threading.Lock()) for _ in range(2)]  # short, long
            self.chars_per_token = longest_token(tokenizer)

    def check(self, texts: list[str], gone: Callable[[], None] = lambda: None) -> None:
        if self.limit is None:
            return
        characters = sum(map(len, texts))
        if characters > self.limit * self.chars_per_token:
            raise too_long(f"more than {self.limit}", self.limit)
        tokenizer, lock = self.counters[characters > self.SHORT]
        count = 0
        for text in texts:
            pieces = text_pieces(tokenizer, text, size=self.PIECE)  # it tokenizes too: resumed under the lock
            while True:
                gone()
                with lock:
                    piece = next(pieces, None)
                    if piece is None:
                        break
                    count += len(tokenizer(piece, add_special_tokens=False)["input_ids"])
                if count > self.limit:
                    raise too_long(f"at least {count}", self.limit)


def too_long(count: str | int, limit: int) -> APIError:
    """OpenAI's error for a prompt past the limit."""
    return APIError(400, too_long_message(count, limit), code="context_length_exceeded")


class _API:
    def __init__(self, worker: ModelWorker, settings: ServerSettings) -> None:
        self.worker, self.settings = worker, settings
        self.bound = _PromptBound(worker.loaded.tokenizer, settings.max_prompt_tokens)
        self._reading = 0  # bytes of the bodies being read or parsed now (body_budget_bytes)

    def endpoint(self, handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        """`handler` with its errors as OpenAI-style JSON: an APIError as itself, anything else a 500."""

        async def run(request: Request) -> Response:
            try:
                return await handler(request)
            except Exception as error:  # the server keeps serving; the client learns what happened
                if not isinstance(error, APIError):
                    error = APIError(500, f"{type(error).__name__}: {error}", "server_error")
                request.state.note = error.message
                return _error_response(error)

        return run

    async def health(self, request: Request) -> Response:
        worker = self.worker
        facts = {"model": self.settings.name, "method": worker.method, "train_len": worker.window,
                 "model_train_len": worker.loaded.train_len,
                 "max_prompt_tokens": self.settings.max_prompt_tokens,
                 "busy": worker.busy, "waiting": worker.waiting, "queue_size": worker.queue_size}
        if worker.stopping:
            return JSONResponse({"status": "stopping", **facts}, 503)
        return JSONResponse({"status": "ok", **facts})

    async def models(self, request: Request) -> Response:
        self._authorize(request)
        return JSONResponse({"object": "list", "data": [self._card()]})

    async def model(self, request: Request) -> Response:
        self._authorize(request)
        self._check_model(request.path_params["model_id"])
        return JSONResponse(self._card())

    async def chat_completions(self, request: Request) -> Response:
        self._authorize(request)
        async with self._received(request) as body:
            chat, tokenize, label = await self._prepared(request, self._chat, body)
        return await self._answer(request, chat, Reply(True, self.settings.name), tokenize, label)

    async def _prepared(self, request: Request, prepare: Callable, body: bytes):
        """`prepare(body, gone)` on a thread, where `gone()` raises once the client has left or the server stops,
        so that the prompt's count (_PromptBound) ends with them."""
        left = threading.Event()
        listening = asyncio.ensure_future(_gone(request))
        listening.add_done_callback(lambda task: task.cancelled() or left.set())

        def gone() -> None:
            if left.is_set():
                raise APIError(499, "the client went away while its prompt was counted", "invalid_request_error")
            if self.worker.stopping:
                raise APIError(503, "the server is stopping", "server_error")

        try:
            return await run_in_threadpool(prepare, body, gone)
        finally:
            listening.cancel()

    def _chat(self, body: bytes, gone: Callable[[], None]) -> tuple[ChatRequest, Callable[..., ServedPrompt], str]:
        """The chat request in `body`, how to tokenize its prompt, and its label (on a thread: it grows with the
        request, bounded by the limits)."""
        data = read_json(body)
        check_size(data, self.settings.max_messages, self.settings.max_parts)
        chat = parse(ChatRequest, data)
        self._check_model(chat.model)
        chat.check_supported()
        self.bound.check([message.text for message in chat.messages], gone)
        roles = ["system" if message.role == "developer" else message.role for message in chat.messages]
        try:
            parts, bos = served_parts(self.worker.loaded.tokenizer, roles)
        except Exception as error:  # a template raises what it likes (raise_exception, TypeError...)
            raise APIError(400, f"the model's chat template refuses these messages: {error}",
                           param="messages") from error
        texts = [message.text for message in chat.messages]
        tokenize = partial(served_prompt, parts=parts, texts=texts, text_cuts=[m.cuts() for m in chat.messages],
                           bos=bos)
        label = next((text for text, role in zip(texts, roles) if role != "system"), texts[0])
        return chat, tokenize, label

    async def completions(self, request: Request) -> Response:
        self._authorize(request)
        async with self._received(request) as body:
            completion, tokenize, label = await self._prepared(request, self._completion, body)
        return await self._answer(request, completion, Reply(False, self.settings.name), tokenize, label)

    def _completion(self, body: bytes, gone: Callable[[], None]
                    ) -> tuple[CompletionRequest, Callable[..., ServedPrompt], str]:
        """The completion request in `body`, how to tokenize its prompt, and its label (on a thread, as _chat)."""
        completion = parse(CompletionRequest, read_json(body))
        self._check_model(completion.model)
        completion.check_supported()
        prompt = completion.prompt
        limit = self.settings.max_prompt_tokens
        if isinstance(prompt, str):
            self.bound.check([prompt], gone)
            return completion, (lambda tokenizer, check: raw_prompt(tokenizer, prompt)), prompt
        vocabulary = self.worker.loaded.model.config.vocab_size
        if not all(0 <= token < vocabulary for token in prompt):
            raise APIError(400, f"prompt: token ids must be in [0, {vocabulary})", param="prompt")
        if limit is not None and len(prompt) > limit:
            raise too_long(len(prompt), limit)
        return completion, (lambda tokenizer, check: ServedPrompt(list(prompt), [len(prompt)], 0)), f"{prompt[:8]}..."

    async def _answer(self, request: Request, generation: ChatRequest | CompletionRequest, reply: Reply,
                      tokenize: Callable[..., ServedPrompt], label: str) -> Response:
        """Queue the job, then answer as one document or as a stream of events."""
        job = Job(tokenize, self._sampling(generation), f"gali serve: {' '.join(label[:200].split())[:60]}",
                  asyncio.get_running_loop(), self.settings.max_prompt_tokens)
        self._queueing(lambda: self.worker.submit(job))
        request.state.note = "queued"
        if generation.stream:
            usage = generation.stream_options is not None and generation.stream_options.include_usage
            return StreamingResponse(self._stream(request, job, reply, usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await self._whole(request, job, reply)

    async def _whole(self, request: Request, job: Job, reply: Reply) -> Response:
        """The answer as one JSON document, once it is complete."""
        pieces = []
        try:
            async for event in _events(job, request, listen=True):
                if isinstance(event, TextPiece):
                    pieces.append(event.text)
                elif isinstance(event, Done):
                    request.state.note = _note(event)
                    return JSONResponse(reply.whole("".join(pieces), event.reason, _usage(event)))
                elif isinstance(event, Failed):
                    request.state.note = f"failed: {event.message}"
                    raise APIError(event.status, event.message, event.kind, code=event.code)
            request.state.note = "cancelled: the client went away"
            return Response(status_code=499)  # nobody reads it
        finally:
            job.cancel()  # a client that went away stops the generation; harmless once it is done

    async def _stream(self, request: Request, job: Job, reply: Reply, usage: bool) -> AsyncIterator[bytes]:
        request.state.note = "cancelled: the client went away"
        try:
            if reply.chat:
                yield _data(reply.chunk("", first=True))
            async for event in _events(job, request, listen=False):
                if event is None:
                    yield b": keep-alive\n\n"
                elif isinstance(event, TextPiece):
                    yield _data(reply.chunk(event.text))
                elif isinstance(event, Done):
                    request.state.note = _note(event)
                    yield _data(reply.chunk("", event.reason))
                    if usage:
                        yield _data(reply.usage_chunk(_usage(event)))
                    yield b"data: [DONE]\n\n"
                else:
                    request.state.note = f"failed: {event.message}"
                    yield _data(APIError(event.status, event.message, event.kind, code=event.code).body())
        finally:
            job.cancel()

    def _sampling(self, generation: ChatRequest | CompletionRequest) -> Sampling:
        """The request's sampling, with the server's defaults where it says nothing. top_p = 0 keeps only the most
        likely token (greedy); without a seed, sampling is seeded at random, as OpenAI's is."""
        settings = self.settings
        temperature = settings.temperature if generation.temperature is None else generation.temperature
        top_p = settings.top_p if generation.top_p is None else generation.top_p
        seed = secrets.randbits(63) if generation.seed is None else generation.seed
        return Sampling(generation.max_new_tokens or settings.max_new_tokens, temperature if top_p > 0 else 0.0,
                        top_p if top_p > 0 else 1.0, seed, tuple(generation.stop or ()),
                        no_empty_answer=isinstance(generation, ChatRequest))

    def _queueing(self, step: Callable[[], None]) -> None:
        """`step` (a look at the queue, or a job put in it), its refusal as the client's error: 429 or 503."""
        try:
            step()
        except QueueFull as full:
            raise APIError(429, f"{self.worker.queue_size} requests are already waiting for the model; retry "
                                f"in {full.retry_after} s", "rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(full.retry_after)}) from None
        except Stopping:
            raise APIError(503, "the server is shutting down", "server_error", code="shutting_down") from None

    @asynccontextmanager
    async def _received(self, request: Request) -> AsyncIterator[bytes]:
        """The body, for as long as the caller parses it: read only when the queue has room, and counted against
        the body budget, which it holds until the caller is done (so many large bodies at once are refused with 503
        instead of parsed together)."""
        self._queueing(self.worker.check_room)
        held = 0

        def hold(size: int) -> None:
            nonlocal held
            if self._reading + size - held > self.settings.body_budget_bytes and held < size:
                raise APIError(503, "the server is reading other large requests; retry in 1 s", "server_error",
                               code="server_busy", headers={"Retry-After": "1"})
            self._reading += size - held
            held = size

        try:
            yield await self._body(request, hold)
        finally:
            self._reading -= held

    async def _body(self, request: Request, hold: Callable[[int], None]) -> bytes:
        """The body, refused (413) as soon as it passes the size limit; `hold` is told the bytes it will take (the
        declared length first, then as it arrives) and refuses when they do not fit the budget."""
        limit, declared = self.settings.max_body_bytes, request.headers.get("content-length")
        too_large = APIError(413, f"the request body is larger than the server's limit of {limit} bytes "
                                  "(gali serve --max-request-mib)", code="request_too_large")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            raise too_large if declared.isdigit() else APIError(400, "Content-Length is not a number")
        hold(int(declared or 0))
        body = bytearray()
        try:
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    raise too_large
                hold(max(len(body), int(declared or 0)))
        except ClientDisconnect:  # or closed for sending it too slowly (connections.py): nobody reads the answer
            raise APIError(499, "the client went away before its body was complete", code="client_closed") from None
        return bytes(body)

    def _authorize(self, request: Request) -> None:
        key = self.settings.api_key
        if key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
            raise APIError(401, "this server needs an API key: Authorization: Bearer KEY", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})

    def _check_model(self, name: str) -> None:
        if name != self.settings.name:
            raise APIError(404, f"the model {name!r} does not exist: this server serves {self.settings.name!r}",
                           param="model", code="model_not_found")

    def _card(self) -> dict:
        return {"id": self.settings.name, "object": "model", "created": self.settings.created, "owned_by": "gali",
                "max_prompt_tokens": self.settings.max_prompt_tokens}


async def _events(job: Job, request: Request, listen: bool) -> AsyncIterator[Event | None]:
    """The job's events until its last; None after each silent KEEP_ALIVE_SECONDS. With `listen`, a client that went
    away ends the iteration within LISTEN_SECONDS, so that its job leaves the queue (a stream's disconnect is noticed
    by Starlette itself)."""
    loop = asyncio.get_running_loop()
    heard, getter = loop.time(), None
    gone = asyncio.ensure_future(_gone(request)) if listen else None
    try:
        while True:
            getter = getter or asyncio.ensure_future(job.events.get())  # kept across timeouts: no event is lost
            done, _ = await asyncio.wait({getter}, timeout=LISTEN_SECONDS)
            if gone is not None and gone.done():
                return
            if not done:
                if loop.time() - heard >= KEEP_ALIVE_SECONDS:
                    heard = loop.time()
                    yield None
                continue
            event, getter, heard = getter.result(), None, loop.time()
            yield event
            if isinstance(event, (Done, Failed)):
                return
    finally:
        for task in (getter, gone):
            if task is not None:
                task.cancel()


async def _gone(request: Request) -> None:
    """Return when the client has gone away (its body was read: what it sends next is its disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _usage(done: Done) -> Usage:
    return Usage(done.prompt_tokens, done.cached_tokens, done.completion_tokens)


def _note(done: Done) -> str:
    return (f"prompt {done.prompt_tokens} tokens ({done.cached_tokens} cached, read in {done.prefill_seconds:.2f} "
            f"s), {done.completion_tokens} generated in {done.decode_seconds:.2f} s, {done.reason}"
            + (f" ({done.note})" if done.note else ""))


def _data(document: dict) -> bytes:
    return f"data: {json.dumps(document, ensure_ascii=False)}\n\n".encode()


def _error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), error.status, headers=error.headers)


async def _http_error(request: Request, error: Exception) -> Response:
    """Starlette's own errors (no such route, wrong method) in OpenAI's shape."""
    status = getattr(error, "status_code", 500)
    message = (f"no such endpoint: {request.method} {request.url.path}" if status == 404 else
               f"{request.method} is not allowed on {request.url.path}" if status == 405 else str(error))
    return _error_response(APIError(status, message, code="not_found" if status == 404 else None,
                                    headers=dict(getattr(error, "headers", None) or {})))


class _AccessLog:
    """One line per request, once its response is complete: client, method, path, status, seconds, and what the
    handler noted (tokens read and generated, or why it failed)."""

    def __init__(self, app: ASGIApp, log: Callable[[str], None]) -> None:
        self.app, self.log = app, log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started, status = time.perf_counter(), None

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            host, port = scope.get("client") or ("-", 0)
            note = scope.get("state", {}).get("note")
            line = (f'{host}:{port} "{scope["method"]} {scope["path"]}" {status or "-"} '
                    f'{time.perf_counter() - started:.2f} s' + (f" - {note}" if note else ""))
            self.log(printable(line))  # the path and the note carry the client's text
