"""Questions about one document, answered from one model state: `gali summarize` and `gali ask` are one-turn
conversations, `gali chat` a long one.

The document is prefilled once, in forwards that always end where the document ends (prompts.py), so its keys and
values are the same whatever question follows: they come from the document cache when an earlier run stored them,
and each later turn only runs its own new tokens (the question, and the chat template's markers) through the model.
"""

from collections.abc import Callable, Iterator

import torch
import transformers
from transformers import DynamicCache

from . import __version__
from .config import MethodSettings
from .doc_cache import DocumentCache, entry_key
from .generate import (Finished, Progress, Sampler, TextPiece, forward_spans, stop_token_ids, stream_generate,
                       truncate_cache)
from .loading import LoadedModel
from .methods import METHODS, apply_method
from .prompts import Prompt, conversation_ids


class Conversation:
    """A document, the questions asked about it so far and their answers, and the model's cache of all of them."""

    def __init__(
        self,
        loaded: LoadedModel,
        method: str,
        settings: MethodSettings,
        document: str,
        document_name: str,
        system: str | None = None,
        store: DocumentCache | None = None,
        notice: Callable[[str], None] = lambda message: None,
    ) -> None:
        self.loaded, self.method, self.settings = loaded, method, settings
        self.document, self.document_name, self.system = document, document_name, system
        self.store = store if METHODS[method].prefix_reusable else None
        self.notice = notice
        self.questions: list[str] = []
        self.answers: list[list[int]] = []
        self.resolved: dict | None = None  # the method's settings as applied
        self.cache: DynamicCache | None = None
        self.cached_ids: list[int] = []  # the tokens whose K/V `cache` holds
        self.document_tokens = 0
        self.from_store = False  # whether the document's state came from the document cache
        self._turns = 0  # answers begun: a stopped answer's generator rolls back only while its turn is the last
        self._last_prompt: tuple[tuple[str, int], Prompt] | None = None

    def prompt(self, instruction: str) -> Prompt:
        """Token ids of the conversation with `instruction` as the next question (nothing is run; the last one is
        kept, so that asking right after does not tokenize a long document again)."""
        turn = (instruction, len(self.questions))
        if self._last_prompt is None or self._last_prompt[0] != turn:
            self._last_prompt = turn, conversation_ids(self.loaded.tokenizer, self.document,
                                                       [*self.questions, instruction], self.answers, self.system)
        return self._last_prompt[1]

    def ask(
        self, instruction: str, sampler: Sampler, max_new_tokens: int, progress: Progress | None = None
    ) -> Iterator[TextPiece | Finished]:
        """Answer `instruction` (the first one follows the document in the same user turn); yields the answer piece
        by piece, then `Finished`. The question and answer join the conversation once the answer is complete; an
        answer cut short (Ctrl-C, or a consumer that stops early) leaves the conversation as it was before it: at
        once when the interruption reaches the generator, and at the latest when the next answer begins."""
        model, tokenizer = self.loaded.model, self.loaded.tokenizer
        self._turns += 1
        turn = self._turns
        self._roll_back()  # what an answer left unfinished may have added, whether or not its generator was closed
        prompt = self.prompt(instruction)
        self.document_tokens = prompt.document_end
        resolved = apply_method(model, self.method, self.settings, len(prompt.ids))
        reusable = METHODS[self.method].prefix_reusable and resolved == self.resolved
        if self.cache is not None and not reusable:
            self.notice(f"reading the document again: {self.method}'s settings changed with the conversation's "
                        f"length ({len(prompt.ids)} tokens)" if METHODS[self.method].prefix_reusable else
                        f"reading the document again: {self.method} needs the whole input in one forward")
        if not reusable or prompt.ids[: len(self.cached_ids)] != self.cached_ids:
            self.cache, self.cached_ids = None, []
        self.resolved = resolved
        document_ids, key = prompt.ids[: prompt.document_end], None
        if self.cache is None:  # the document's state: from the store, or read in this turn (and stored after it)
            key = entry_key(self.identity(), document_ids) if self.store else None
            self.cache = self.store.load(key, document_ids, model) if self.store else None
            self.from_store = self.cache is not None
            self.cached_ids = document_ids if self.cache is not None else []
            self.cache = self.cache if self.cache is not None else DynamicCache(config=model.config)
        start, recorded = len(self.cached_ids), False
        try:
            for event in stream_generate(model, tokenizer, prompt.ids, sampler, max_new_tokens,
                                         stop_token_ids(model, tokenizer), self._spans(start, len(prompt.ids)),
                                         progress, self.cache):
                if isinstance(event, Finished):  # before yielding it: a consumer may stop at the last event
                    self._record(instruction, prompt.ids, list(event.answer_ids), key, document_ids, start)
                    recorded = True
                yield event
        finally:
            if not recorded and turn == self._turns:  # a later turn has already rolled this one back
                self._roll_back()

    def _roll_back(self) -> None:
        """Forget what an unfinished turn added to the cache. A forward stopped midway may have extended some
        layers and not others: every layer goes back to the tokens of the turns before."""
        kept = len(self.cached_ids)
        if kept == 0:
            self.cache, self.from_store = None, False
            return
        truncate_cache(self.cache, kept)

    def _record(self, instruction: str, ids: list[int], answer: list[int], key: str | None, document_ids: list[int],
                start: int) -> None:
        """The turn joins the conversation; a document read in this turn is stored for later runs."""
        self.questions.append(instruction)
        self.answers.append(answer)
        self.cached_ids = (ids + answer)[: self.cache.get_seq_length()]
        if self.store and not self.from_store and start == 0:
            self.store.save(key, document_ids, self.cache, {
                "document": self.document_name, "model": self.loaded.identity.get("model", "?"),
                "method": self.method})

    def _spans(self, start: int, stop: int) -> list[tuple[int, int]]:
        """Forwards over tokens [start, stop), always cut at the end of the document."""
        return prefill_spans(self.loaded, self.method, self.resolved, start, stop, [self.document_tokens])

    def identity(self) -> dict:
        """Everything a document's K/V depend on besides its tokens: model, weights, dtype, method, settings."""
        return state_identity(self.loaded, self.method, self.resolved)


def state_identity(loaded: LoadedModel, method: str, resolved: dict, kind: str = "gali-document-state") -> dict:
    """What prefilled keys and values depend on besides their tokens: versions, model, weights, dtype, method and
    its settings as applied (the document cache's key)."""
    return {"format": kind, "gali": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            **loaded.identity, "method": method, "settings": resolved}


def prefill_spans(loaded: LoadedModel, method: str, resolved: dict, start: int, stop: int, cuts: list[int]
                  ) -> list[tuple[int, int]]:
    """Forwards over tokens [start, stop): a bounded number of tokens each (about 8 GALI chunks, at least 256), cut
    where the method allows, and always at `cuts` (unless the method needs the whole input in one forward)."""
    ends = sorted({cut for cut in cuts if start < cut < stop} | {stop}) if METHODS[method].prefix_reusable else [stop]
    spans, first = [], start
    for last in ends:
        spans += model_spans(loaded, method, resolved, first, last)
        first = last
    return spans


def model_spans(loaded: LoadedModel, method: str, resolved: dict, start: int, stop: int) -> list[tuple[int, int]]:
    """Forwards over [start, stop) of about 8 GALI chunks (at least 256 tokens), cut only where `method` allows."""
    chunk = resolved.get("chunk_size") or loaded.train_len // 8
    boundaries = METHODS[method].boundaries
    return forward_spans(start, stop, max(256, 8 * chunk),
                         boundaries(loaded.model, start, stop) if boundaries else None)
