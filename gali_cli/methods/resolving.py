"""What the commands ask of a method by its name: the window it keeps positions within, and its settings before
an input is read (`gali info`, and the checks before a document is read)."""

from transformers import PretrainedConfig

from ..config import MethodSettings
from ..errors import ConfigError
from ..model.families import default_train_len
from .registry import REGISTRY, get_method


def preview_method(config: PretrainedConfig, name: str, settings: MethodSettings) -> dict | None:
    """The settings method `name` would run a model with this config with, as far as they are known before the
    input (None when the method does not say); a ConfigError for settings that make no sense for the model."""
    method = get_method(name)
    train_len = train_len_of(config, settings)
    return method.resolve(config, settings, train_len, None) if REGISTRY[name].previewable else None


def kept_window(name: str, train_len: int | None, model_window: int) -> int:
    """The window method `name` keeps positions within: `train_len` (--train-len) where given, though the original
    model ignores it, else the model's: what an input's length is told against."""
    return train_len if train_len is not None and REGISTRY[name].honours_train_len else model_window


def train_len_of(config: PretrainedConfig, settings: MethodSettings) -> int:
    """--train-len, or the model's own window (model/families.py); never past that window."""
    window = default_train_len(config)
    train_len = settings.train_len if settings.train_len is not None else window
    if train_len > window:
        raise ConfigError(f"--train-len ({train_len}) exceeds the model's training window ({window})")
    return train_len
