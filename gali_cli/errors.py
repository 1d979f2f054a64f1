"""The errors gali raises on purpose: each message says what to change."""


class GaliError(Exception):
    """Base class: a problem the user can act on (the CLI prints it as one line)."""


class ConfigError(GaliError, ValueError):
    """A setting that makes no sense, e.g. a local window wider than the training window."""


class UnsupportedModelError(GaliError):
    """A model GALI cannot be applied to; the message names what is unsupported."""


class InputError(GaliError):
    """A document that cannot be read: missing, empty, binary, corrupt, encrypted, or without text."""


class ModelLoadError(GaliError):
    """A model that cannot be found or loaded, or that does not fit in memory."""


class GaliWarning(UserWarning):
    """Something the user should know that does not stop the run (the CLI prints it as one line on stderr)."""
