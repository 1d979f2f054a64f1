"""gali: read documents longer than a Llama's training window with Greedy Attention Logit Interpolation.

The public names load lazily, so that `gali` starts (and stops on Ctrl-C) before torch is imported.
"""

import importlib

__version__ = "0.1.0"
_PUBLIC = {
    "GaliConfig": ".config",
    "MethodSettings": ".config",
    "GaliError": ".errors",
    "ConfigError": ".errors",
    "InputError": ".errors",
    "ModelLoadError": ".errors",
    "UnsupportedModelError": ".errors",
    "apply_gali": ".patching",
    "remove_gali": ".patching",
    "gali_settings": ".patching",
    "apply_method": ".patching",
    "remove_method": ".patching",
    "with_cache": ".engine.seam.cache_argument",
}
__all__ = [  # the keys of _PUBLIC, sorted; a literal so that linters and IDEs can read it
    "ConfigError",
    "GaliConfig",
    "GaliError",
    "InputError",
    "MethodSettings",
    "ModelLoadError",
    "UnsupportedModelError",
    "apply_gali",
    "apply_method",
    "gali_settings",
    "remove_gali",
    "remove_method",
    "with_cache",
]


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'gali_cli' has no attribute {name!r}")
    return getattr(importlib.import_module(_PUBLIC[name], __name__), name)
