"""Prefilled states in the document cache: one key, one load and one store for `gali ask`/`gali chat`
(conversation.py) and `gali serve` (server/reuse.py), so that either starts from a document the other has read.

A state is the KV cache of a prompt's first n tokens. Its keys and values depend on those tokens, on the model (its
identity, weights, dtype, the versions that run it), on the dtype the KV cache stores them in (--kv-dtype), on the
method and its settings as applied, and, for a method whose results depend on where forwards end (GALI: a chunk's
positions are set by its last token), on where the prefill ended forwards before n, except where the method lets a
forward end anyway (GALI's chunk boundaries). The key holds exactly these. `gali ask` and `gali serve` cut a
document's prompt at the same places (prompts.py: where the document ends and where the question starts), so a
document read by one is a cache hit for the other.
"""

import json

import torch
import transformers
from transformers import DynamicCache

from . import __version__
from .doc_cache import DocumentCache, entry_key
from .loading import LoadedModel
from .methods.registry import REGISTRY
from .patching import forward_ends


def state_identity(loaded: LoadedModel, method: str, resolved: dict) -> dict:
    """What prefilled keys and values depend on besides their tokens and cuts: versions, model, weights, dtype, the
    dtype they are stored in where it is not the model's (--kv-dtype: float32 rows are no float16 run's, nor the
    reverse; left out otherwise, so entries stored before the option still match), method and its settings as
    applied."""
    stored = {"kv_dtype": str(loaded.stored_dtype)} if loaded.stored_dtype != loaded.dtype else {}
    return {"format": "gali-prefilled-state", "gali": __version__, "torch": torch.__version__,
            "transformers": transformers.__version__, **loaded.identity, **stored,
            "method": method, "settings": resolved}


class DocumentStates:
    """The document cache as a run with one model and method uses it (None: --no-cache, or a method whose results
    depend on one forward over the whole input, so that no prefix can be reused)."""

    def __init__(self, loaded: LoadedModel, method: str, store: DocumentCache | None) -> None:
        self.loaded, self.method = loaded, method
        self.store = store if store is not None and REGISTRY[method].prefix_reusable else None

    def key(self, ids: list[int], cuts: list[int], resolved: dict) -> str:
        """The document cache's name for the state of `ids`, prefilled with forwards that ended at `cuts` (and
        wherever the method allows) under the method's settings `resolved`."""
        return entry_key(self._identity(ids, cuts, resolved), ids)

    def _identity(self, ids: list[int], cuts: list[int], resolved: dict) -> dict:
        """What the state of `ids` depends on: `state_identity`, and the `cuts` that ended a forward where the method
        would not have (they change the state)."""
        free = forward_ends(self.loaded.model, self.method, 0, len(ids))
        ended = [] if free is None else sorted({cut for cut in cuts if 0 < cut < len(ids)} - set(free))
        return {**state_identity(self.loaded, self.method, resolved), "cuts": ended}

    def load(self, ids: list[int], cuts: list[int], ends: list[int], resolved: dict
             ) -> tuple[DynamicCache, int] | None:
        """The longest stored state of `ids[:end]`, `end` one of `ends`, with how many tokens it holds; None when
        the document cache holds none of them."""
        if self.store is None:
            return None
        for end in sorted(set(ends), reverse=True):
            cache = self.store.load(self.key(ids[:end], cuts, resolved), ids[:end], self.loaded.model,
                                    self.loaded.kv_dtype)
            if cache is not None:
                return cache, end
        return None

    def save(self, ids: list[int], cuts: list[int], resolved: dict, cache: DynamicCache, label: str) -> None:
        """Store the state of `ids` (the first len(ids) tokens of the KV cache `cache`) unless the document cache
        holds it already."""
        if self.store is None:
            return
        identity = self._identity(ids, cuts, resolved)
        key = entry_key(identity, ids)
        if not self.store.path(key).exists():
            self.store.save(key, ids, cache, {"document": label, "model": self.loaded.identity.get("model", "?"),
                                              "method": self.method,
                                              "identity": json.dumps(identity, sort_keys=True, default=str)})
