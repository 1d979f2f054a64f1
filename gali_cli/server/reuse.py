"""Which prefilled state a request starts from, so that a document asked several questions is read once.

The keys and values of a prompt's first r tokens can be taken from an earlier prefill that read the same r tokens
with the same method and settings and, for a method whose results depend on where forwards end (GALI: a chunk's
positions are set by its last token), ended its forwards at the same places before r and at r itself. The server
ends forwards at fixed places of every prompt (prompts.ServedPrompt.cuts, and GALI's chunk grid), so a request
starting from a reused state gets the same answer as one read from scratch, token for token.

Two sources: the state the worker kept from the last request, in memory, and the document cache on disk, where a
prompt's `shared` prefix (up to where its last question starts) is stored when it spared at least
STORE_MIN_TOKENS tokens of reading. The document cache is read and written as `gali ask` and `gali chat` do
(document_states.py): one key, so that a document one of them read is a cache hit for the other. Each lookup hashes
the prefix it looks for, so at most MAX_LOOKUPS of them are tried, the longest first: a prompt of thousands of
messages would otherwise hash itself once per message.
"""

from collections.abc import Callable
from dataclasses import dataclass

from transformers import DynamicCache

from ..doc_cache import DocumentCache
from ..document_states import DocumentStates
from ..engine.seam.kv_cache import new_cache
from ..generate import truncate_cache
from ..loading import LoadedModel
from ..methods.registry import REGISTRY
from ..patching import forward_ends
from ..prompts import ServedPrompt

STORE_MIN_TOKENS = 1024
MAX_LOOKUPS = 8  # prefixes of one prompt looked for in the document cache: the last cuts, where stored states end


@dataclass
class Prefilled:
    """A prefilled state kept for the next request."""

    cache: DynamicCache
    ids: list[int]  # the tokens whose keys and values `cache` holds
    cuts: list[int]  # where the prefill ended forwards, within them
    resolved: dict  # the method's settings as applied


def reusable_tokens(kept: Prefilled, prompt: ServedPrompt, grid: list[int] | None) -> int:
    """How many leading tokens of `prompt` have, in `kept`, the keys and values a fresh prefill would give them
    (at least one token is always left to read: its logits start the answer).

    `grid` lists the places up to the shared prefix where a forward may end without changing anything (GALI's
    chunk boundaries); None means anywhere, so cuts do not matter.
    """
    limit = 0
    for kept_id, new_id in zip(kept.ids, prompt.ids[:-1]):
        if kept_id != new_id:
            break
        limit += 1
    if grid is None:
        return limit
    kept_ends, new_ends, free = set(kept.cuts), set(prompt.cuts), set(grid)
    reusable = 0
    for end in sorted(kept_ends | new_ends | free):
        if end > limit or (end in kept_ends or end in free) != (end in new_ends or end in free):
            break  # a forward ended here in one prefill only: the tokens before it were read differently
        reusable = end
    return reusable


class States:
    """The worker's prefilled states: the last request's, and the document cache (None: --no-cache)."""

    def __init__(self, loaded: LoadedModel, method: str, store: DocumentCache | None) -> None:
        self.loaded, self.method = loaded, method
        self.documents = DocumentStates(loaded, method, store)
        self.kept: Prefilled | None = None

    @property
    def store(self) -> DocumentCache | None:
        return self.documents.store

    def start(self, prompt: ServedPrompt, resolved: dict, check: Callable[[], None]) -> tuple[DynamicCache, int]:
        """A KV cache holding the keys and values of the longest reusable prefix of `prompt`, and how many tokens
        that is. The kept state is handed over: it changes now. `check` runs before each lookup in the document
        cache, and raises to stop (a request cancelled meanwhile)."""
        model, method = self.loaded.model, REGISTRY[self.method]
        kept, self.kept = self.kept, None
        memory = 0
        if kept is not None and method.prefix_reusable and kept.resolved == resolved:
            memory = reusable_tokens(kept, prompt, self._grid(len(prompt.ids)))
        ends = [cut for cut in prompt.cuts if cut > memory and STORE_MIN_TOKENS <= cut < len(prompt.ids)]
        for end in reversed(ends[-MAX_LOOKUPS:]):
            check()
            stored = self.documents.load(prompt.ids, prompt.cuts, [end], resolved)
            if stored is not None:
                return stored
        if memory:
            truncate_cache(kept.cache, memory)
            return kept.cache, memory
        return new_cache(model, self.loaded.kv_dtype), 0

    def keep(self, cache: DynamicCache, prompt: ServedPrompt, read: int, resolved: dict) -> None:
        """Keep the state of the first `read` tokens of `prompt` (all of them, or as far as a stopped prefill got)
        for the next request; whatever the answer added is dropped."""
        if read <= 0 or not REGISTRY[self.method].prefix_reusable:
            return
        truncate_cache(cache, read)  # also evens out layers a failed forward left uneven
        self.kept = Prefilled(cache, prompt.ids[:read], [cut for cut in prompt.cuts if cut <= read], resolved)

    def store_shared(self, prompt: ServedPrompt, resolved: dict, reused: int, label: str) -> None:
        """Write the kept state of `prompt.shared` tokens to the document cache, when that spares a later request at
        least STORE_MIN_TOKENS tokens of reading and is not there yet."""
        shared = prompt.shared
        if self.kept is None or len(self.kept.ids) < shared or shared - reused < STORE_MIN_TOKENS:
            return
        self.documents.save(prompt.ids[:shared], prompt.cuts, resolved, self.kept.cache, label)

    def _grid(self, stop: int) -> list[int] | None:
        """Places in [1, stop) where a forward may end without changing the results (None: anywhere)."""
        ends = forward_ends(self.loaded.model, self.method, 0, stop)
        return ends[:-1] if ends is not None else None
