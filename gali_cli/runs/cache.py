"""gali cache list / clear / prune: the document cache's entries and the model cache's (GGUF tokenizers, and the
float copies older gali versions wrote), and emptying them."""

from .. import display, tables
from ..display import print_json, say
from ..errors import GaliError
from ..model.companions import GgufCompanions, ModelEntry
from .common import entry_point, store


@entry_point
def list_cache(cache_dir: str | None, json_output: bool) -> None:
    """The cached document states, then the model cache's entries, most recently used first."""
    cache, models = store(cache_dir), GgufCompanions()
    entries, copies = cache.entries(), models.entries()
    cache.warn_about_foreign_files()
    models.warn_about_foreign_files()
    if json_output:
        print_json({"directory": str(cache.directory), "limit_bytes": cache.limit,
                    "entries": [{"document": entry.document, "model": entry.model, "method": entry.method,
                                 "tokens": entry.tokens, "bytes": entry.size, "last_used": entry.last_used,
                                 "differs_by": entry.differences(entries), "identity": entry.identity,
                                 "path": str(entry.path)} for entry in entries],
                    "models_directory": str(models.directory),
                    "models": [{"gguf": copy.gguf, "dtype": copy.dtype, "transformers": copy.transformers,
                                "bytes": copy.size, "last_used": copy.last_used, "usable": copy.usable,
                                "unusable_because": copy.reason_unusable, "path": str(copy.path)}
                               for copy in copies]})
    else:
        tables.print_cache_entries(entries, cache.directory, cache.limit)
        tables.print_model_entries(copies, models.directory)


@entry_point
def clear_cache(cache_dir: str | None, models: bool = False) -> None:
    """Delete every cached document state (with `models`, every model cache entry instead), and say how much that
    freed; GaliError if some could not be deleted."""
    if models:
        copies = GgufCompanions()
        _say_removed(copies.clear(), copies)
        return
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


@entry_point
def prune_cache() -> None:
    """Delete the model cache entries this installation cannot use: written by another transformers release or an
    older gali (float copies of whole models), or from a GGUF file that is gone or changed since."""
    copies = GgufCompanions()
    _say_removed(copies.prune(), copies)


def _say_removed(removal: tuple[list[ModelEntry], list[ModelEntry]], copies: GgufCompanions) -> None:
    """One line on what was freed; GaliError naming what could not be deleted."""
    removed, kept = removal
    freed = (f"{len(removed)} model cache entr{'ies' if len(removed) != 1 else 'y'} "
             f"({sum(entry.size for entry in removed) / 2**20:.1f} MiB)")
    where = display.short_path(str(copies.directory))
    if kept:
        raise GaliError(f"removed {freed} from {where}, but not the other {len(kept)}: {kept[0].path} could not be "
                        "deleted")
    say(f"Removed {freed} from {where}.")
