"""Which transformers releases gali has been tested with, and saying so (once) when another one is installed.

gali hooks into transformers (engine/seam/), and a minor release can change what the hooks rely on
without raising anything: 5.24 renamed the forward's cache argument, and every token decoded after a long prompt was
computed at position 0. So pyproject.toml admits only the releases on which the engine's equivalence tests passed
(`scripts/compat.py` runs them, one environment per release; docs/compatibility.md has the table), and a user who
forces another release is told once. Torch-free: `gali info` reports it without importing torch.
"""

import importlib.metadata
import warnings

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from .errors import GaliWarning

# Kept equal to the transformers requirement in pyproject.toml (tests/engine/seam/test_compat.py). Raise the upper
# bound only after `python scripts/compat.py` has passed on the new release and its row is in docs/compatibility.md.
TESTED_TRANSFORMERS = ">=5.6,<5.26"

_warned = False


def installed_transformers() -> str | None:
    """The installed transformers release, or None."""
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return None


def untested_release(version: str | None = None) -> str | None:
    """What to tell the user when transformers `version` (default: the installed one) is outside the tested range;
    None when it is inside (or not installed: loading says so)."""
    version = version if version is not None else installed_transformers()
    if version is None:
        return None
    try:
        tested = Version(version) in SpecifierSet(TESTED_TRANSFORMERS)
    except InvalidVersion:
        tested = False
    if tested:
        return None
    return (f"transformers {version} is outside the releases gali is tested with ({TESTED_TRANSFORMERS}): "
            f"`gali info --check` tests the seam on this install; pip install 'transformers{TESTED_TRANSFORMERS}' "
            "gets a tested one")


def no_hub_code_kwargs() -> dict[str, object]:
    """What every `from_pretrained` of a model gali loads passes besides trust_remote_code=False, so that
    transformers runs no code from the Hub: from 5.25 `use_kernels` defaults to on, and a CUDA machine with a network
    then downloads RMSNorm, activation and rotary kernels from the Hub and runs them, code the user never asked for,
    whose numbers differ between the unpatched model and gali's attention. Every release in the range knows
    `use_kernels` (off by default before 5.25, so passing it changes nothing there); a release whose models do not
    have it gets nothing, rather than a keyword it would pass on to the model's config."""
    from transformers import PreTrainedModel

    return {"use_kernels": False} if hasattr(PreTrainedModel, "set_use_kernels") else {}


def warn_if_untested() -> None:
    """Say once per process, as a GaliWarning, that the installed transformers is outside the tested range."""
    global _warned
    message = untested_release()
    if message and not _warned:
        _warned = True
        warnings.warn(message, GaliWarning, stacklevel=2)
