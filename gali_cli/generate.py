"""Generation in three layers: prefill and decode on tensors, a stream of small events, and the joined answer.

The prompt is prefilled in forwards of a bounded number of tokens (memory stays bounded; only the last position's
logits are computed), cut only where the method allows; then one token per forward is decoded until a stop token.
"""

import resource
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from .engine.seam.cache_argument import with_cache
from .engine.seam.kv_cache import new_cache, reserve
from .engine.seam.packed_modules import model_device
from .engine.seam.static_decode import static_decoder
from .errors import ConfigError
from .repetition import RepetitionGuard

Sampler = Callable[[torch.Tensor], int]
Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class TextPiece:
    """A piece of the answer, as soon as it decodes to whole characters."""

    text: str


@dataclass(frozen=True)
class Finished:
    """The end of a generation, with what it cost."""

    reason: str  # "stop" (a stop token), "length" (max_new_tokens) or "repetition" (see RepetitionGuard)
    prompt_tokens: int
    prefilled_tokens: int  # those of the prompt this call ran through the model; the others came from the cache
    generated_tokens: int
    prefill_seconds: float
    decode_seconds: float
    peak_memory_bytes: int
    answer_ids: tuple[int, ...] = ()  # the generated tokens, stop token left out
    decode_path: str = ""  # how the tokens after the first were decoded (`DecodePath`); "" when none was

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prefilled_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_second(self) -> float | None:
        """Tokens per second of decoding, or None below two tokens: the first token is sampled from the prefill's
        logits (its cost is the prefill's), each later one needs a forward of its own."""
        forwards = self.generated_tokens - 1
        return forwards / self.decode_seconds if forwards > 0 and self.decode_seconds else None


def make_sampler(temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0) -> Sampler:
    """A function from next-token logits (vocab,) to a token id. Temperature 0 is greedy; otherwise sampling is
    reproducible for a seed on a given kind of device. It runs where the logits are: only the chosen id crosses to
    the host, never the vocabulary's logits (a GPU's per-token copy of 128k floats)."""
    if temperature < 0:
        raise ConfigError(f"--temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ConfigError(f"--top-p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise ConfigError(f"--top-k must be >= 0, got {top_k}")
    if temperature == 0:
        return lambda logits: int(logits.argmax())
    generators: dict[torch.device, torch.Generator] = {}  # one stream per device, made on first use there

    def sample(logits: torch.Tensor) -> int:
        if logits.device not in generators:
            generators[logits.device] = torch.Generator(device=logits.device).manual_seed(seed)
        logits = logits.float() / temperature
        if top_k:
            kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if top_p < 1:
            sorted_logits, order = torch.sort(logits, descending=True)
            beyond = torch.softmax(sorted_logits, -1).cumsum(-1) > top_p
            beyond[1:] = beyond[:-1].clone()  # keep the token that crosses top_p
            beyond[0] = False
            logits = logits.index_fill(0, order[beyond], float("-inf"))
        return int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generators[logits.device]))

    return sample


def forward_spans(start: int, stop: int, step: int, boundaries: list[int] | None = None) -> list[tuple[int, int]]:
    """Cut tokens [start, stop) into forwards of about `step` tokens, ending only at `boundaries` if given.

    A forward is longer than `step` only when the next boundary is that far away.
    """
    if boundaries is None:
        return [(first, min(first + step, stop)) for first in range(start, stop, step)]
    spans, first, previous = [], start, start
    for boundary in boundaries:
        if boundary - first > step and previous > first:
            spans.append((first, previous))
            first = previous
        previous = boundary
    spans.append((first, stop))
    return spans


def prefill(
    model: PreTrainedModel,
    ids: torch.Tensor,
    cache: DynamicCache,
    spans: list[tuple[int, int]],
    progress: Progress | None = None,
) -> torch.Tensor:
    """Run the prompt `ids` (1, n) through the model span by span; returns the last position's logits (vocab,).

    `progress` hears (0, tokens) before the first forward, then (tokens done, tokens) after each. When it also has
    a `within` callback (a bar), that hears the same during a long forward, after each decoder layer, the tokens
    counted in proportion to the layers done: a bar moves steadily through a forward of thousands of tokens, while
    `progress` itself (which may time the forwards: estimate.PrefillClock) still hears only whole forwards."""
    logits, given = None, with_cache(model, cache)
    total = spans[-1][1] - spans[0][0]
    within = getattr(progress, "within", None)
    if progress:
        progress(0, total)
    for first, last in spans:
        watched = within if last - first >= WATCHED_FORWARD else None
        with _each_layer(model, watched, first - spans[0][0], last - first, total):
            logits = model(input_ids=ids[:, first:last], **given, use_cache=True, logits_to_keep=1).logits
        if progress:
            progress(last - spans[0][0], total)
    return logits[0, -1].float()


WATCHED_FORWARD = 256  # tokens: a forward this long reports its layers to a bar (a shorter one is over at once)


@contextmanager
def _each_layer(model: PreTrainedModel, report: Progress | None, done: int, tokens: int, total: int
                ) -> Iterator[None]:
    """`report(done + the share of `tokens` that the decoder layers done stand for, total)` after each layer of the
    model's forward in the block: a Python call per layer of a forward of hundreds of tokens or more, nothing beside
    its matrix products. On a GPU the layers are reported as they are queued, ahead of their kernels."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if report is None or not layers:
        yield
        return
    handles = [layer.register_forward_hook(
        lambda *_, index=index: report(done + tokens * (index + 1) // len(layers), total))
        for index, layer in enumerate(layers)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@dataclass
class DecodePath:
    """How `decode` made an answer's tokens after the first, in words, for -v and --json: "eager" (the model's own
    forward), or the static step's `StaticDecoder.description` once it agreed with the forward ("" until
    a second token is decoded)."""

    description: str = ""


def decode(
    model: PreTrainedModel,
    cache: DynamicCache,
    logits: torch.Tensor,
    sampler: Sampler,
    max_new_tokens: int,
    stop_ids: set[int],
    path: DecodePath | None = None,
    last_token: int | None = None,
) -> Iterator[int]:
    """Sample from `logits`, then one token per forward; yields token ids, stop tokens included. `path` is told how
    the tokens after the first are made. `last_token`: the token whose logits `logits` are, the cache's last (the
    prompt's): the static step is held to them, and no forward is spent checking it; without it, the static step's
    first step is held to a forward of its own."""
    device, given = model_device(model), with_cache(model, cache)
    static = static_decoder(model, cache)  # the static step where it pays, a CUDA graph on a GPU (static_decode.py)
    path = path if path is not None else DecodePath()

    def forward(token: int) -> torch.Tensor:
        step_ids = torch.tensor([[token]], device=device)
        return model(input_ids=step_ids, **given, use_cache=True).logits[0, -1].float()

    for step in range(max_new_tokens):
        token = sampler(logits)
        yield token
        if token in stop_ids or step == max_new_tokens - 1:
            return
        index = cache.get_seq_length()
        if static is not None and index >= static.capacity:  # past the rows reserved: the cache grows eagerly
            static = None
            if path.description:
                path.description += ", then eager past the rows reserved"
        if static is not None and not static.checked and last_token is not None:
            static = static if static.check(last_token, index - 1, logits) else None  # eager from here if they differ
            path.description = static.description() if static else "eager"
        if static is None:
            logits = forward(token)
            path.description = path.description or "eager"
        elif static.checked:
            logits = static.step(token, index)
        else:  # held to the model's own forward first; eager from here on if they differ
            logits = static.first_step(token, index, lambda: forward(token))  # noqa: B023
            static = static if static.checked else None
            path.description = static.description() if static else "eager"


# Rows of the cache made ready for the answer before it starts (the static step decodes within them; a longer answer
# goes on eagerly, the cache growing with it). Not --max-new-tokens itself: a limit of a million tokens (a server's
# client may ask for it) once allocated its rows up front, 24 GB for SmolLM2, and the kernel killed the process.
ANSWER_ROWS_RESERVED = 4096


@torch.inference_mode()  # the generator form: only this function's own steps run in inference mode, not the caller's
def stream_generate(
    model: PreTrainedModel,
    tokenizer,
    prompt_ids: list[int],
    sampler: Sampler,
    max_new_tokens: int,
    stop_ids: set[int],
    spans: list[tuple[int, int]],
    progress: Progress | None = None,
    cache: DynamicCache | None = None,
    after_prefill: Callable[[DynamicCache], None] | None = None,
) -> Iterator[TextPiece | Finished]:
    """Prefill `prompt_ids` along `spans`, then decode; yields the answer piece by piece, then `Finished`. An
    answer caught in a loop (RepetitionGuard) ends there, with the reason "repetition".

    A `cache` that already holds the prompt's first tokens (a document read before) is continued: `spans` then
    start where it ends. Either way the cache holds the prompt and the answer afterwards, for the next turn.
    `after_prefill(cache)` runs once the prompt is read, before the first token is decoded (the conversation stores
    the document's state there: an answer stopped by Ctrl-C does not lose the read); its time counts in neither
    rate.
    """
    device = model_device(model)
    ids = torch.tensor([prompt_ids], device=device)
    reset_peak_memory(device)
    started = time.perf_counter()
    cache = cache if cache is not None else new_cache(model)
    reserve(cache, len(prompt_ids) + min(max_new_tokens, ANSWER_ROWS_RESERVED))
    if spans[0][0] != cache.get_seq_length():
        raise ValueError(f"the cache holds {cache.get_seq_length()} tokens but the spans start at {spans[0][0]}")
    logits = prefill(model, ids, cache, spans, progress)
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # kernels run asynchronously: wait for them before reading the clock
    prefilled = time.perf_counter()
    if after_prefill:
        after_prefill(cache)
    decoding = time.perf_counter()
    detokenizer = _Detokenizer(tokenizer)
    generated, answer, reason, guard = 0, [], "length", RepetitionGuard()
    path = DecodePath()
    for token in decode(model, cache, logits, sampler, max_new_tokens, stop_ids, path, prompt_ids[-1]):
        generated += 1
        if token in stop_ids:
            reason = "stop"
            break
        answer.append(token)
        piece = detokenizer.add(token)
        if piece:
            yield TextPiece(piece)
        if guard.looping(token):
            reason = "repetition"
            break
    if tail := detokenizer.finish():
        yield TextPiece(tail)
    yield Finished(
        reason=reason,
        prompt_tokens=len(prompt_ids),
        prefilled_tokens=spans[-1][1] - spans[0][0],
        generated_tokens=generated,
        prefill_seconds=prefilled - started,
        decode_seconds=time.perf_counter() - decoding,
        peak_memory_bytes=peak_memory_bytes(device),
        answer_ids=tuple(answer),
        decode_path=path.description,
    )


def truncate_cache(cache: DynamicCache, tokens: int) -> None:
    """Keep the first `tokens` tokens of every layer of `cache`. A forward stopped midway may have extended some
    layers and not others: each is cut on its own."""
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys[:, :, :tokens], layer.values[:, :, :tokens]


def stop_token_ids(model: PreTrainedModel, tokenizer) -> set[int]:
    """Every id that ends an answer: the generation config's eos ids, the tokenizer's eos, and <|eot_id|>."""
    ids = model.generation_config.eos_token_id
    stops = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
    if tokenizer.eos_token_id is not None:
        stops.add(tokenizer.eos_token_id)
    eot = tokenizer.convert_tokens_to_ids("<|eot_id|>")
    if isinstance(eot, int) and eot != tokenizer.unk_token_id:
        stops.add(eot)
    return stops


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        for index in range(torch.cuda.device_count()):
            torch.cuda.reset_peak_memory_stats(index)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak GPU memory allocated by torch on CUDA (all GPUs); on CPU, the process's peak resident memory."""
    if device.type == "cuda":
        return sum(torch.cuda.max_memory_allocated(index) for index in range(torch.cuda.device_count()))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS reports bytes, Linux KiB


class _Detokenizer:
    """Turns tokens into text pieces, holding back a piece while it ends in a partial UTF-8 character.

    Each token decodes only the tokens not shown yet, after those of the last piece shown: their context, so that a
    tokenizer that drops a leading space at the start of what it decodes, or joins one to what follows, writes them
    as in the whole answer; the pieces join to the answer decoded as a whole. The cost per token stays the same
    however long the answer's lines, where decoding the whole line again for each token grew with the line
    (docs/performance.md, "The CLI's decoding against its step (2026-12-07)").
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []  # the last piece's tokens (the context), then those not shown yet
        self.context = 0  # how many of `ids` are the last piece's

    def add(self, token: int) -> str:
        self.ids.append(token)
        shown, text = self._decoded()
        if len(text) <= len(shown) or text.endswith("\ufffd"):
            return ""
        self.ids = self.ids[self.context :]
        self.context = len(self.ids)
        return text[len(shown) :]

    def finish(self) -> str:
        """Whatever is still held back when generation ends, less a last character the answer stopped inside
        (--max-new-tokens reached mid-character): its bytes would print as U+FFFD."""
        shown, text = self._decoded()
        return text[len(shown) :].rstrip("\ufffd")

    def _decoded(self) -> tuple[str, str]:
        """The context's text, and that of the context and the tokens after it."""
        decode = self.tokenizer.decode
        return decode(self.ids[: self.context], skip_special_tokens=True), decode(self.ids, skip_special_tokens=True)
