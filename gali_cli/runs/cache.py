"""gali cache list / clear: the document cache's entries, and emptying it."""

from .. import display
from ..display import print_json, say
from ..errors import GaliError
from .common import entry_point, store


@entry_point
def list_cache(cache_dir: str | None, json_output: bool) -> None:
    """The cached document states, most recently used first."""
    cache = store(cache_dir)
    entries = cache.entries()
    if json_output:
        print_json({"directory": str(cache.directory), "limit_bytes": cache.limit,
                    "entries": [{"document": entry.document, "model": entry.model, "method": entry.method,
                                 "tokens": entry.tokens, "bytes": entry.size, "last_used": entry.last_used,
                                 "path": str(entry.path)} for entry in entries]})
    else:
        display.print_cache_entries(entries, cache.directory, cache.limit)


@entry_point
def clear_cache(cache_dir: str | None) -> None:
    """Delete every cached document state, and say how much that freed; GaliError if some could not be deleted."""
    cache = store(cache_dir)
    cleared = cache.clear()
    removed = (f"{len(cleared.removed)} cached document state{'s' if len(cleared.removed) != 1 else ''} "
               f"({cleared.removed_bytes / 2**20:.1f} MiB)")
    if not cleared.kept:
        say(f"Removed {removed} from {cache.directory}.")
        return
    path, _, reason = cleared.kept[0]
    if path == cache.directory:
        raise GaliError(f"cannot clear the document cache: {cache.directory}: {reason}")
    raise GaliError(f"removed {removed} from {cache.directory}, but not the other {len(cleared.kept)} "
                    f"({cleared.kept_bytes / 2**20:.1f} MiB): {reason} ({path})")
