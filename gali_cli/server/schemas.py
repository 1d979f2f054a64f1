"""What clients send and get back, in OpenAI's shapes, and the errors they get.

Requests are validated strictly, as OpenAI does: a string is not a number and a number is not a boolean, so a
mistyped field is an error rather than a guess. Fields this server has no use for (user, metadata, store...) are
accepted and ignored; features it does not have (tools, several choices, log probabilities, penalties) are refused
with a message, never silently dropped.
"""

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..prompts import question_starts

MAX_COMPLETION_TOKENS = 1 << 20
MAX_STOPS = 4  # stop strings per request, as OpenAI takes
MAX_STOP_CHARS = 256  # per stop string: a held-back tail is at most this long
_Request = TypeVar("_Request", bound=BaseModel)


class APIError(Exception):
    """An error as OpenAI reports it: an HTTP status and {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def read_json(body: bytes) -> dict:
    """The request body as a JSON object; anything else is a 400: JSON nested deeper than Python's parser goes, or
    text with a lone surrogate ("\\ud800" is valid JSON but no Unicode: no tokenizer or reply could take it)."""
    try:
        data = json.loads(body, parse_constant=_no_constant)
        json.dumps(data, ensure_ascii=False).encode()  # every string written out as UTF-8, as the model reads it
    except UnicodeEncodeError as error:
        raise APIError(400, f"the body is not valid Unicode: a lone surrogate "
                            f"{error.object[error.start:error.end]!r} in a string") from None
    except ValueError as error:  # UnicodeDecodeError and JSONDecodeError included
        raise APIError(400, f"the body is not valid JSON: {error}") from None
    except RecursionError:
        raise APIError(400, "the body nests arrays and objects deeper than the server reads") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the body must be a JSON object, not {type(data).__name__}")
    return data


def check_size(data: dict, max_messages: int, max_parts: int) -> None:
    """A 400 when a chat request's JSON has more messages, or text parts in all its messages, than the server takes:
    counted before validation, whose time (spent holding the GIL) grows with them."""
    messages = data.get("messages")
    if not isinstance(messages, list):
        return  # validation says what is wrong
    if len(messages) > max_messages:
        raise APIError(400, f"messages: this server takes at most {max_messages} messages per request, not "
                            f"{len(messages)}", param="messages", code="too_many_messages")
    parts = sum(len(content) if isinstance(content := message.get("content"), list) else 1
                for message in messages if isinstance(message, dict))
    if parts > max_parts:
        raise APIError(400, f"messages: this server takes at most {max_parts} text parts per request (in all "
                            f"its messages), not {parts}", param="messages", code="too_many_parts")


def parse(model: type[_Request], data: dict) -> _Request:
    """`data` validated as `model`; the first problem becomes a 400 naming the field (e.g. messages.0.role)."""
    try:
        return model.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        param = ".".join(str(part) for part in first["loc"]) or None
        message = first["msg"].removeprefix("Value error, ")
        raise APIError(400, f"{param}: {message}" if param else message, param=param) from None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Generation(_Strict):
    """What both endpoints take: the model, sampling, stop strings, streaming."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1, le=MAX_COMPLETION_TOKENS)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    stop: list[str] | None = None
    n: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    logit_bias: Any = None
    logprobs: Any = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_strings(cls, value: Any) -> Any:
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else value
        if not isinstance(stops, list) or len(stops) > MAX_STOPS or not all(isinstance(s, str) and s for s in stops):
            raise ValueError(f"must be a non-empty string or a list of up to {MAX_STOPS} of them")
        if any(len(stop) > MAX_STOP_CHARS for stop in stops):
            raise ValueError(f"each stop string may be at most {MAX_STOP_CHARS} characters long")
        return stops

    def refusals(self) -> dict[str, bool]:
        """Features this server does not have, by field: True where the request asks for one."""
        return {"n": self.n not in (None, 1), "presence_penalty": self.presence_penalty not in (None, 0),
                "frequency_penalty": self.frequency_penalty not in (None, 0), "logit_bias": bool(self.logit_bias),
                "logprobs": self.logprobs not in (None, False)}

    def check_supported(self) -> None:
        """Raise a 400 naming the first feature the request asks for that this server does not have."""
        for name, refused in self.refusals().items():
            if refused:
                raise APIError(400, f"{name}: not supported by gali serve (leave it out)", param=name)

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_tokens


class Message(_Strict):
    """A chat message; its content is kept as its text parts (a string is one part)."""

    role: Literal["system", "developer", "user", "assistant"]
    content: list[str]

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [value]
        if not isinstance(value, list) or not value:
            raise ValueError("must be a string or a non-empty list of text parts")
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"only text parts ({{'type': 'text', 'text': ...}}) are supported, got {kind!r}")
        return [part["text"] for part in value]

    @property
    def text(self) -> str:
        """The parts joined by line breaks, with blank space around a document before its question dropped (see
        _tidied)."""
        return _tidied("\n".join(self.content)).text

    def cuts(self) -> list[int]:
        """Character offsets where the prefill ends a forward: the last part's start (a client's question after
        its document), and where a question may follow a document (prompts.question_starts). A few at most: each
        is tokenized again (prompts.served_prompt), so one per part would make a many-part message quadratic."""
        joined = "\n".join(self.content)
        tidied = _tidied(joined)
        last = tidied.offset(len(joined) - len(self.content[-1]))
        return sorted(({last} - {0}) | set(question_starts(tidied.text)))


class _Tidied(NamedTuple):
    """A message's text as served, and what was dropped of the text as sent: `lead` characters of blank space
    before its document, and `dropped` after it, from `dropped_at` (an offset in the text as sent)."""

    text: str
    lead: int = 0
    dropped_at: int = 0
    dropped: int = 0

    def offset(self, sent: int) -> int:
        """Where the offset `sent` of the text as sent falls in the text as served; within the blank space after the
        document, at the question's start (a cut inside it would end a forward where gali ask's prompt ends none)."""
        if self.dropped_at and sent > self.dropped_at:
            sent = max(sent - self.dropped, self.dropped_at + 2)
        return max(0, sent - self.lead)


def _tidied(text: str) -> _Tidied:
    """`text` with the blank space around a document before its question dropped, and the blank space between
    them made one blank line, as `gali ask` sets them (its document stripped, then "\n\nquestion"): a file sent
    as read, with its final line break and whatever blank space it starts with (the GPL's 20 spaces, issue 50),
    shares the state gali ask stored. A message without a blank line before its last words is left as it is."""
    stripped = text.rstrip()
    blank = stripped.rfind("\n\n")
    if blank <= 0:
        return _Tidied(text)
    end = len(text[:blank].rstrip())  # the document's end
    lead = end - len(text[:end].lstrip())
    if lead == end:  # blank space alone before the blank line: no document
        return _Tidied(text)
    question_start = blank + 2  # the last blank line's end: "doc\n\n\nq" ends its blank space at q
    return _Tidied(text[lead:end] + "\n\n" + text[question_start:], lead, end, question_start - (end + 2))


class ChatRequest(_Generation):
    """A chat completion request; its size in messages and text parts is checked against the server's limits
    (check_size) before it is validated."""

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_COMPLETION_TOKENS)
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    response_format: Any = None
    top_logprobs: Any = None

    def refusals(self) -> dict[str, bool]:
        return {**super().refusals(), "tools": bool(self.tools), "functions": bool(self.functions),
                "tool_choice": self.tool_choice not in (None, "none", "auto"),
                "response_format": self.response_format not in (None, {"type": "text"}),
                "top_logprobs": self.top_logprobs not in (None, 0)}

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Generation):
    prompt: str | list[int]
    echo: Any = None
    suffix: Any = None
    best_of: Any = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
            value = value[0]  # a batch of one
        if isinstance(value, str):
            return value
        if isinstance(value, list) and value and all(type(token) is int for token in value):
            return value
        if isinstance(value, list) and len(value) > 1 and all(isinstance(item, (str, list)) for item in value):
            raise ValueError("one prompt per request (send several requests; they queue)")
        raise ValueError("must be a string or a non-empty list of token ids")

    def refusals(self) -> dict[str, bool]:
        return {**super().refusals(), "echo": bool(self.echo), "suffix": bool(self.suffix),
                "best_of": self.best_of not in (None, 1)}


@dataclass(frozen=True)
class Usage:
    """Tokens read (all of the prompt: nothing is truncated), of which `cached` came from a prefilled state, and
    tokens generated."""

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int

    def body(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


@dataclass(frozen=True)
class Reply:
    """The JSON of one response: a chat completion (message, deltas) or a text completion."""

    chat: bool
    model: str
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        if not self.id:
            object.__setattr__(self, "id", f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}")

    @staticmethod
    def finish_reason(reason: str) -> str:
        """OpenAI's word for why an answer ended: a loop gali stopped (generate.RepetitionGuard) is a "stop", as a
        stop string is; the server's log says which."""
        return "stop" if reason == "repetition" else reason

    def whole(self, text: str, finish_reason: str, usage: Usage) -> dict:
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}} if self.chat else
                  {"index": 0, "text": text})
        return self._envelope("chat.completion" if self.chat else "text_completion",
                              [{**choice, "logprobs": None, "finish_reason": self.finish_reason(finish_reason)}],
                              usage=usage.body())

    def chunk(self, text: str, finish_reason: str | None = None, first: bool = False) -> dict:
        """A streamed piece of the answer (the first chat chunk also names the role; the last has a finish_reason
        and no text)."""
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else {"content": text} if text else {}
            choice = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": text}
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion",
                              [{**choice, "logprobs": None,
                                "finish_reason": finish_reason and self.finish_reason(finish_reason)}])

    def usage_chunk(self, usage: Usage) -> dict:
        """The chunk stream_options.include_usage asks for: no choices, the usage."""
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [], usage=usage.body())

    def _envelope(self, kind: str, choices: list[dict], **extra) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices,
                **extra}
