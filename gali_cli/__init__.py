"""gali: read documents longer than a Llama's training window with Greedy Attention Logit Interpolation."""

from .config import GaliConfig
from .errors import ConfigError, GaliError, UnsupportedModelError
from .methods.gali import apply_gali, gali_settings, remove_gali

__all__ = [
    "ConfigError",
    "GaliConfig",
    "GaliError",
    "UnsupportedModelError",
    "apply_gali",
    "gali_settings",
    "remove_gali",
]
__version__ = "0.1.0"
