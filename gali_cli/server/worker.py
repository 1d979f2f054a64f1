"""The model worker: one thread that owns the model and answers queued requests one at a time.

The model is not thread-safe, and a forward would block the event loop, so requests become jobs in a bounded queue;
the worker tokenizes each job's prompt, applies the method for its length, starts from the best prefilled state
(reuse.py), and streams the answer back to the event loop through the job's asyncio queue. A job is cancelled
between two steps of any loop that grows with its request (messages tokenized, stored states looked up, forwards;
a client that went away, or the server stopping); the state it leaves is cut back to the tokens read completely,
for the next request. A job cancelled while it waits leaves the queue at once: it holds no place there.
"""

import asyncio
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from ..config import MethodSettings
from ..doc_cache import DocumentCache
from ..errors import GaliError, InputError
from ..generate import Finished, Sampler, TextPiece, make_sampler, stop_token_ids, stream_generate
from ..loading import LoadedModel
from ..methods.resolving import kept_window
from ..patching import apply_method, prefill_spans
from ..prompts import ServedPrompt
from .reuse import States


@dataclass(frozen=True)
class Sampling:
    """How one answer is generated."""

    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop: tuple[str, ...] = ()
    # A chat answer never ends before its first token: where the model's first pick is a stop token, its best other
    # token is taken (issue 50: after 81 s of reading, a 1-token empty answer reached the client without a word). A
    # raw completion may end at once: its text may be complete.
    no_empty_answer: bool = False


@dataclass(frozen=True)
class Done:
    """The end of an answer."""

    reason: str  # "stop" (a stop token or string), "length" or "repetition" (a loop, stopped)
    prompt_tokens: int
    cached_tokens: int  # of the prompt, taken from a prefilled state
    completion_tokens: int
    prefill_seconds: float  # from the job's start (tokenizing, finding a state, reading) to its first token
    decode_seconds: float
    note: str = ""  # for the access log: what the worker did that the client was not told


@dataclass(frozen=True)
class Failed:
    """A job that ended without an answer, as an HTTP status and a message."""

    status: int
    message: str
    kind: str = "server_error"
    code: str | None = None


Event = TextPiece | Done | Failed


def too_long_message(count: str | int, limit: int) -> str:
    """What a client whose prompt has `count` tokens, past `limit`, is told."""
    return f"the prompt has {count} tokens: this server reads at most {limit} (gali serve --max-prompt-tokens)"


class _Cancelled(Exception):
    pass


@dataclass(eq=False)
class Job:
    """One request for the model: its prompt (tokenized on the worker's thread: the tokenizer is not thread-safe
    either; called as tokenize(tokenizer, check=job.check), it runs `check` between steps), how to sample, and
    where its events go."""

    tokenize: Callable[..., ServedPrompt]
    sampling: Sampling
    label: str  # what the document cache lists for a stored prefix
    loop: asyncio.AbstractEventLoop
    max_prompt_tokens: int | None = None  # past it, the job fails before any forward
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """Stop generating at the next forward (harmless once the job is done)."""
        self.cancelled.set()

    def check(self) -> None:
        """Raise _Cancelled once the job is cancelled: called between two steps of the work it asks for."""
        if self.cancelled.is_set():
            raise _Cancelled()

    def emit(self, event: Event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            self.cancel()


class QueueFull(Exception):
    """More jobs wait than the queue holds; `retry_after` is a guess, in seconds, of when one will be free."""

    def __init__(self, retry_after: int) -> None:
        super().__init__(f"retry after {retry_after} s")
        self.retry_after = retry_after


class Stopping(Exception):
    """The worker takes no more jobs: the server is shutting down."""


class _StopMatcher:
    """How much of one stop string the text so far ends with, updated a character at a time (Knuth-Morris-Pratt):
    constant work per character on average, whatever the stop string's length, so a long one costs no more per token."""

    def __init__(self, stop: str) -> None:
        self.stop, self.matched = stop, 0
        self.fallback = [0] * len(stop)  # fallback[i]: the longest proper prefix of stop[:i + 1] that ends it
        length = 0
        for index in range(1, len(stop)):
            while length and stop[index] != stop[length]:
                length = self.fallback[length - 1]
            length += stop[index] == stop[length]
            self.fallback[index] = length

    def step(self, char: str) -> bool:
        """Take one more character; True when the text now ends with the whole stop string."""
        matched = self.matched
        if matched == len(self.stop):
            matched = self.fallback[matched - 1]
        while matched and char != self.stop[matched]:
            matched = self.fallback[matched - 1]
        self.matched = matched + (char == self.stop[matched])
        return self.matched == len(self.stop)


class StopStrings:
    """Cuts the answer at the first stop string to end in it, holding back text that may be the start of one. Each
    character is looked at once per stop string: the work per token is linear in the token's text."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.matchers, self.pending = [_StopMatcher(stop) for stop in stops], ""

    def feed(self, text: str) -> tuple[str, bool]:
        """The text that can be sent now, and whether a stop string was reached (the text then ends before it)."""
        pending = self.pending + text
        for end, char in enumerate(text, start=len(self.pending) + 1):
            completed = [len(matcher.stop) for matcher in self.matchers if matcher.step(char)]
            if completed:
                self.pending = ""
                return pending[: end - max(completed)], True
        held = max((matcher.matched for matcher in self.matchers), default=0)  # the start of a stop string
        self.pending = pending[len(pending) - held:] if held else ""
        return pending[: len(pending) - held], False

    def finish(self) -> str:
        """What was held back, at the end of the answer."""
        ready, self.pending = self.pending, ""
        return ready


class ModelWorker:
    """The model's thread and its queue of at most `queue_size` waiting jobs."""

    def __init__(self, loaded: LoadedModel, method: str, settings: MethodSettings, store: DocumentCache | None,
                 queue_size: int) -> None:
        self.loaded, self.method, self.settings = loaded, method, settings
        self.states = States(loaded, method, store)
        self.stop_ids = stop_token_ids(loaded.model, loaded.tokenizer)
        self.queue_size = queue_size
        self._jobs: deque[Job] = deque()
        self._changed = threading.Condition(threading.RLock())  # reentrant: stop() may run in a signal handler
        self._stopping = threading.Event()
        self._current: Job | None = None
        self._seconds_per_job = 1.0  # a running mean, for Retry-After
        self._thread = threading.Thread(target=self._serve, name="gali-model", daemon=True)

    @property
    def window(self) -> int:
        return kept_window(self.method, self.settings.train_len, self.loaded.train_len)

    @property
    def waiting(self) -> int:
        """Jobs waiting whose clients are still there."""
        with self._changed:
            return sum(not job.cancelled.is_set() for job in self._jobs)

    @property
    def busy(self) -> bool:
        return self._current is not None

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def start(self) -> None:
        self._thread.start()

    def check_room(self) -> None:
        """QueueFull when the queue is full, Stopping when the server is shutting down: asked before a request's body
        is read, so that a request that could not queue costs no reading nor parsing."""
        with self._changed:
            self._check_room()

    def submit(self, job: Job) -> None:
        """Queue `job`; raises QueueFull when the queue is full and Stopping when the server is shutting down."""
        with self._changed:
            self._check_room()
            self._jobs.append(job)
            self._changed.notify()

    def _check_room(self) -> None:
        if self.stopping:
            raise Stopping()
        self._leave_cancelled()
        if len(self._jobs) >= self.queue_size:
            wait = self._seconds_per_job * (len(self._jobs) + 1)
            raise QueueFull(max(1, min(60, math.ceil(wait))))

    def stop(self) -> None:
        """Take no more jobs, end the one running at its next step and fail the waiting ones (503). Safe to call
        from a signal handler: it sets flags, queues events, and holds the queue's lock (reentrant, and never held
        long by the thread) for a moment."""
        self._stopping.set()
        if self._current is not None:
            self._current.cancel()
        with self._changed:
            self._fail_waiting()
            self._changed.notify()  # wakes the thread up to leave

    def _fail_waiting(self) -> None:
        with self._changed:
            while self._jobs:
                self._jobs.popleft().emit(Failed(503, "the server is shutting down"))

    def _leave_cancelled(self) -> None:
        """Drop the waiting jobs whose clients went away (a few: the queue is bounded)."""
        with self._changed:
            for job in [job for job in self._jobs if job.cancelled.is_set()]:
                self._jobs.remove(job)

    def _next(self) -> Job | None:
        """The next job whose client is still there; None once the server stops."""
        with self._changed:
            while not self.stopping:
                self._leave_cancelled()
                if self._jobs:
                    return self._jobs.popleft()
                self._changed.wait()
            return None

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the thread to finish its forward (and any document-cache write); True when it has."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _serve(self) -> None:
        while (job := self._next()) is not None:
            self._current, started = job, time.perf_counter()
            try:
                self._answer(job)
            except Exception as error:  # one request's failure must not stop the server
                job.emit(Failed(400, str(error), "invalid_request_error") if isinstance(error, GaliError) else
                         Failed(500, f"{type(error).__name__}: {error}"))
            finally:
                self._current = None
                self._seconds_per_job = 0.8 * self._seconds_per_job + 0.2 * (time.perf_counter() - started)
        self._fail_waiting()  # those queued as the server stopped

    def _answer(self, job: Job) -> None:
        loaded, sampling, counts = self.loaded, job.sampling, _Counts(job)
        try:
            prompt = job.tokenize(loaded.tokenizer, check=job.check)
            if not prompt.ids:
                raise InputError("the prompt has no tokens")
            limit = job.max_prompt_tokens
            if limit is not None and len(prompt.ids) > limit:
                job.emit(Failed(400, too_long_message(len(prompt.ids), limit), "invalid_request_error",
                                "context_length_exceeded"))
                return
            sampler = make_sampler(sampling.temperature, sampling.top_p, 0, sampling.seed)
            resolved = apply_method(loaded.model, self.method, self.settings, len(prompt.ids))
            cache, reused = self.states.start(prompt, resolved, job.check)
            counts.reused = counts.read = reused
            sampler = counts.counted(sampler, self.stop_ids if sampling.no_empty_answer else set())
            events = stream_generate(loaded.model, loaded.tokenizer, prompt.ids, sampler,
                                     sampling.max_new_tokens, self.stop_ids,
                                     prefill_spans(loaded.model, self.method, reused, len(prompt.ids), prompt.cuts),
                                     counts.progress, cache)
            try:
                reason = _relay(job, events, StopStrings(sampling.stop))
            finally:
                events.close()
                self.states.keep(cache, prompt, counts.read, resolved)
        except _Cancelled:
            if self.stopping:
                job.emit(Failed(503, "the server is shutting down"))
            return
        prefilled = counts.prefilled or time.perf_counter()
        job.emit(Done(reason, len(prompt.ids), reused, counts.generated, prefilled - counts.started,
                      time.perf_counter() - prefilled, counts.note))
        if not self.stopping:
            self.states.store_shared(prompt, resolved, reused, job.label)


class _Counts:
    """What a job has done so far: tokens read completely (the prefill's progress, which also checks whether the
    job was cancelled between two forwards) and tokens sampled, and when."""

    def __init__(self, job: Job) -> None:
        self.job, self.reused, self.read, self.generated = job, 0, 0, 0
        self.started, self.prefilled = time.perf_counter(), None
        self.note = ""

    def progress(self, done: int, total: int) -> None:
        self.read = self.reused + done  # the prefill started after the reused tokens
        self.job.check()

    def counted(self, sampler: Sampler, not_first: set[int]) -> Sampler:
        """`sampler`, counting its tokens; the first one marks the end of the prefill, and is sampled again without
        the `not_first` tokens (the stop tokens of a chat answer: Sampling.no_empty_answer) if it is one of them."""

        def sample(logits: torch.Tensor) -> int:
            self.prefilled = self.prefilled or time.perf_counter()
            self.generated += 1
            token = sampler(logits)
            if self.generated == 1 and token in not_first:
                self.note = "the model's first pick ended the answer at once: its next best went on"
                banned = torch.tensor(sorted(not_first), device=logits.device)
                token = sampler(logits.index_fill(0, banned, float("-inf")))
            return token

        return sample


def _relay(job: Job, events: Iterator[TextPiece | Finished], stops: StopStrings) -> str:
    """Send the answer's pieces to the job until the end, a stop string or a cancellation; returns the finish
    reason."""
    reason = "length"
    for event in events:
        job.check()
        if isinstance(event, TextPiece):
            text, stopped = stops.feed(event.text)
            if text:
                job.emit(TextPiece(text))
            if stopped:
                return "stop"
        else:
            reason = event.reason
    if tail := stops.finish():
        job.emit(TextPiece(tail))
    return reason
