"""Questions about one document, answered from one model state: `gali summarize` and `gali ask` are one-turn
conversations, `gali chat` a long one.

The document is prefilled once, in forwards that always end where the first instruction starts, after the document
and the blank line that follows it (prompts.py), so the keys and values of those tokens are the same whatever
question follows: they come from the document cache when an earlier run stored them (or `gali serve`, which ends
its forwards at the same place: document_states.py), and each later turn only runs its own new tokens (the
question, and the chat template's markers) through the model.
"""

from collections.abc import Callable, Iterator

import torch
from transformers import DynamicCache

from .config import MethodSettings
from .doc_cache import DocumentCache
from .document_states import DocumentStates
from .engine.seam.kv_cache import new_cache
from .engine.seam.packed_modules import model_device
from .generate import (
    Finished,
    Progress,
    Sampler,
    TextPiece,
    prefill,
    stop_token_ids,
    stream_generate,
    truncate_cache,
)
from .loading import LoadedModel
from .methods.registry import REGISTRY
from .patching import apply_method, prefill_spans
from .prompts import Prompt, ask_instruction, check_prompt_characters, check_prompt_length, conversation_ids, text_ids


class Conversation:
    """A document, the questions asked about it so far and their answers, and the KV cache of all of them."""

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
        chat: bool = True,  # False: a raw text prompt, without the chat template (prompts.conversation_ids)
        max_prompt_tokens: int | None = None,  # a longer prompt is refused before any forward (InputError)
    ) -> None:
        self.max_prompt_tokens = max_prompt_tokens
        self.loaded, self.method, self.settings, self.chat = loaded, method, settings, chat
        self.document, self.document_name, self.system = document, document_name, system
        self.states = DocumentStates(loaded, method, store)
        self.notice = notice
        self.questions: list[str] = []
        self.answers: list[list[int]] = []
        self.resolved: dict | None = None  # the method's settings as applied
        self.cache: DynamicCache | None = None
        self.cached_ids: list[int] = []  # the tokens whose keys and values the KV cache `cache` holds
        self.document_tokens = 0  # the document's state: its tokens up to where the first instruction starts
        self.from_store = False  # whether the document's state came from the document cache
        self._turns = 0  # answers begun: a stopped answer's generator rolls back only while its turn is the last
        self._last_prompt: tuple[tuple[str, int], Prompt] | None = None

    def prompt(self, instruction: str) -> Prompt:
        """Token ids of the conversation with `instruction` as the next question (nothing is run; the last one is
        kept, so that asking right after does not tokenize a long document again)."""
        turn = (instruction, len(self.questions))
        if self._last_prompt is None or self._last_prompt[0] != turn:
            characters = len(self.document) + sum(map(len, self.questions)) + len(instruction)
            check_prompt_characters(self.loaded.tokenizer, characters, self.max_prompt_tokens, self.document_name)
            self._last_prompt = turn, conversation_ids(self.loaded.tokenizer, self.document,
                                                       [*self.questions, instruction], self.answers, self.system,
                                                       self.chat)
        check_prompt_length(len(self._last_prompt[1].ids), self.max_prompt_tokens, self.document_name)
        return self._last_prompt[1]

    @torch.inference_mode()
    def read(self, progress: Progress | None = None) -> None:
        """Take in the document before any question (`gali chat` reads, then prompts: the wait comes before asking,
        not after): its state from the document cache, else read now and stored. The first question then runs only
        its own tokens. A method that needs the whole input in one forward has nothing to read ahead."""
        if self.questions or self.cache is not None or not REGISTRY[self.method].prefix_reusable:
            return
        model = self.loaded.model
        prompt = self.prompt(ask_instruction("?"))  # the tokens before question_start are those of any question
        self.document_tokens = prompt.question_start
        self.resolved = apply_method(model, self.method, self.settings, len(prompt.ids))
        document_ids = prompt.ids[: self.document_tokens]
        stored = self.states.load(prompt.ids, [], [self.document_tokens], self.resolved)
        self.from_store = stored is not None
        if stored:
            self.cache = stored[0]
            if progress:
                progress(self.document_tokens, self.document_tokens)
        else:
            self.cache = new_cache(model, self.loaded.kv_dtype)
            prefill(model, torch.tensor([document_ids], device=model_device(model)), self.cache,
                    prefill_spans(model, self.method, 0, self.document_tokens, [self.document_tokens]), progress)
            self.states.save(document_ids, [], self.resolved, self.cache, self.document_name)
        self.cached_ids = document_ids

    def ask(
        self, instruction: str, sampler: Sampler, max_new_tokens: int, progress: Progress | None = None,
        answer_prefix: str = "",
    ) -> Iterator[TextPiece | Finished]:
        """Answer `instruction` (the first one follows the document in the same user turn); yields the answer piece
        by piece, then `Finished`. The question and answer join the conversation once the answer is complete; an
        answer cut short (Ctrl-C, or a consumer that stops early) leaves the conversation as it was before it: at
        once when the interruption reaches the generator, and at the latest when the next answer begins.
        `answer_prefix` is text the answer starts with, after the template's assistant turn (`gali eval`'s RULER
        tasks: "The special magic number ... is"); it joins the conversation as the answer's first tokens."""
        model, tokenizer = self.loaded.model, self.loaded.tokenizer
        self._turns += 1
        turn = self._turns
        self._roll_back()  # what an answer left unfinished may have added, whether or not its generator was closed
        prompt = self.prompt(instruction)
        prefix = text_ids(tokenizer, answer_prefix) if answer_prefix else []
        ids = prompt.ids + prefix
        self.document_tokens = prompt.question_start
        resolved = apply_method(model, self.method, self.settings, len(ids))
        reusable = REGISTRY[self.method].prefix_reusable and resolved == self.resolved
        if self.cache is not None and not reusable:
            self.notice(f"reading the document again: {self.method}'s settings changed with the conversation's "
                        f"length ({len(ids)} tokens)" if REGISTRY[self.method].prefix_reusable else
                        f"reading the document again: {self.method} needs the whole input in one forward")
        if not reusable or prompt.ids[: len(self.cached_ids)] != self.cached_ids:
            self.cache, self.cached_ids = None, []
        self.resolved = resolved
        if self.cache is None:  # the document's state: from the document cache, or read in this turn (stored after)
            stored = self.states.load(prompt.ids, [], [self.document_tokens], resolved)
            self.from_store = stored is not None
            self.cached_ids = prompt.ids[: self.document_tokens] if stored else []
            self.cache = stored[0] if stored else new_cache(model, self.loaded.kv_dtype)
        start, recorded = len(self.cached_ids), False
        spans = prefill_spans(model, self.method, start, len(ids), [self.document_tokens])
        # A document read in this turn is stored as soon as it is read (no forward ended before it, but where GALI's
        # chunks end), before the answer: Ctrl-C during the answer keeps the read.
        store = start == 0 and not self.from_store
        document = prompt.ids[: self.document_tokens]
        try:
            for event in stream_generate(model, tokenizer, ids, sampler, max_new_tokens,
                                         stop_token_ids(model, tokenizer), spans, progress, self.cache,
                                         after_prefill=(lambda cache: self.states.save(
                                             document, [], resolved, cache, self.document_name)) if store else None):
                if isinstance(event, Finished):  # before yielding it: a consumer may stop at the last event
                    self._record(instruction, prompt, prefix + list(event.answer_ids))
                    recorded = True
                yield event
        finally:
            if not recorded and turn == self._turns:  # a later turn has already rolled this one back
                self._roll_back()

    def _roll_back(self) -> None:
        """Forget what an unfinished turn added to the KV cache. A forward stopped midway may have extended some
        layers and not others: every layer goes back to the tokens of the turns before."""
        kept = len(self.cached_ids)
        if kept == 0:
            self.cache, self.from_store = None, False
            return
        truncate_cache(self.cache, kept)

    def _record(self, instruction: str, prompt: Prompt, answer: list[int]) -> None:
        """The turn joins the conversation."""
        self.questions.append(instruction)
        self.answers.append(answer)
        self.cached_ids = (prompt.ids + answer)[: self.cache.get_seq_length()]
