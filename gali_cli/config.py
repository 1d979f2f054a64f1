"""GALI's settings, validated once, with messages that name the CLI flag to change."""

from dataclasses import dataclass, replace

from .errors import ConfigError


@dataclass(frozen=True)
class GaliConfig:
    """Settings of Greedy Attention Logit Interpolation (paper §3).

    Args:
        train_len: L_tr, the window the model was trained on. Positions stay in [0, train_len - 1] (they reach
            train_len only with local_window = 0, where Alg. 2 leaves no exact tail).
            None means the model's `max_position_embeddings`; a smaller value narrows the interval range,
            which the paper finds can help.
        chunk_size: s, tokens per chunk beyond train_len; each chunk gets its own interpolated positions.
            None means train_len // 4 (docs/benchmarks.md says why).
        local_window: L_w, the newest tokens of every chunk that keep exact, un-interpolated positions.
            None means train_len // 2: the exact tail must hold at least a chunk (docs/benchmarks.md).
        noise: add the paper's Gaussian logit noise where logits are interpolated.
        noise_scale: multiplies the noise's standard deviation (i - j) / T.
        seed: makes the noise reproducible.
    """

    train_len: int | None = None
    chunk_size: int | None = None
    local_window: int | None = None
    noise: bool = True
    noise_scale: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        _check_int("--train-len", self.train_len, minimum=2)
        _check_int("--chunk-size", self.chunk_size, minimum=1)
        _check_int("--local-window", self.local_window, minimum=0)
        _check_int("--seed", self.seed, minimum=0)
        if isinstance(self.noise_scale, bool) or not isinstance(self.noise_scale, (int, float)):
            raise ConfigError(f"--noise-scale must be a number, got {self.noise_scale!r}")
        if not 0 <= self.noise_scale < float("inf"):
            raise ConfigError(f"--noise-scale must be a finite number >= 0, got {self.noise_scale}")
        if self.train_len is not None and self.local_window is not None and self.local_window >= self.train_len:
            raise ConfigError(
                f"--local-window ({self.local_window}) must be smaller than --train-len ({self.train_len}): "
                "interpolated positions have to fit between them"
            )

    def resolved(self, model_train_len: int) -> "GaliConfig":
        """This config with every None filled in, for a model trained on `model_train_len` tokens."""
        train_len = self.train_len if self.train_len is not None else model_train_len
        if train_len > model_train_len:
            raise ConfigError(
                f"--train-len ({train_len}) exceeds the model's training window ({model_train_len}); "
                "GALI only reuses positions the model was trained on"
            )
        return replace(
            self,
            train_len=train_len,
            chunk_size=self.chunk_size if self.chunk_size is not None else max(1, train_len // 4),
            local_window=self.local_window if self.local_window is not None else train_len // 2,
        )


def _check_int(flag: str, value: object, minimum: int) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{flag} must be a whole number, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{flag} must be >= {minimum}, got {value}")


@dataclass(frozen=True)
class MethodSettings:
    """The settings of every length-extrapolation method; each method reads its own. None means the method's
    default, usually relative to train_len and to the input's length (see gali_cli.methods)."""

    train_len: int | None = None
    chunk_size: int | None = None  # gali
    local_window: int | None = None  # gali, chunk-llama
    noise: bool = True  # gali
    noise_scale: float = 1.0  # gali
    seed: int = 0  # gali's noise
    factor: float | None = None  # ntk, dynamic-ntk, yarn
    group_size: int | None = None  # self-extend
    neighbor_window: int | None = None  # self-extend
    dca_chunk_size: int | None = None  # chunk-llama

    def __post_init__(self) -> None:
        self.gali()  # validates the settings GALI shares
        _check_int("--group-size", self.group_size, minimum=1)
        _check_int("--neighbor-window", self.neighbor_window, minimum=1)
        _check_int("--dca-chunk-size", self.dca_chunk_size, minimum=1)
        if self.factor is not None and (isinstance(self.factor, bool) or not isinstance(self.factor, (int, float))
                                        or not 1 <= self.factor < float("inf")):
            raise ConfigError(f"--factor must be a number >= 1, got {self.factor!r}")

    def gali(self) -> GaliConfig:
        return GaliConfig(self.train_len, self.chunk_size, self.local_window, self.noise, self.noise_scale, self.seed)
