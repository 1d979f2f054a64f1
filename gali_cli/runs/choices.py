"""What a command chose on its command line, as typed data built before anything heavy loads: the model, the methods
and their settings (ModelChoice, checked against the model's config without torch), how documents are read (Reading),
how an answer is generated and shown (Answering), and where and how `gali serve` serves (Serving). No torch here, so
that the command line can refuse a bad option at once.
"""

import functools
from dataclasses import dataclass

from ..config import MAX_INPUT_BYTES, MethodSettings
from ..errors import ConfigError
from ..methods.registry import PREVIEWED, REGISTRY, parse_methods


@dataclass(frozen=True)
class ModelChoice:
    """Which model, which methods and their settings: everything needed before a document is read."""

    named_model: str | None  # -m; None: the default for the device (see `model`)
    quantize: str
    device: str
    dtype: str
    methods: tuple[str, ...]
    settings: MethodSettings
    threads: int | None = None  # --threads; None: gali_cli.threads chooses
    kv_dtype: str = "model"  # --kv-dtype (model/machine.py's KV_DTYPES)

    @classmethod
    def parse(cls, model: str | None, quantize: str, device: str, dtype: str, method: str,
              many_methods: bool = False, threads: int | None = None, kv_dtype: str = "model",
              **settings: object) -> "ModelChoice":
        """From the command line's values (`settings`: MethodSettings' fields; `many_methods`: whether --method may
        name several); a bad one raises ConfigError."""
        return cls(model or None, quantize, device, dtype, parse_methods(method, many_methods),
                   MethodSettings(**settings), threads, kv_dtype)

    @functools.cached_property
    def model(self) -> str:
        """The model named with -m, else the default for the device (model_config.default_model, which asks torch
        about GPUs only where it could see one), decided when a run needs the name."""
        if self.named_model:
            return self.named_model
        from ..model.config import default_model

        return default_model(self.device)

    def check(self) -> int:
        """The device, then settings that depend on the model (its window), checked from its config (read without
        torch: model/config.py) before any file is read or anything heavy is imported; returns the model's window."""
        from ..model.config import read_model_config

        self.check_device()
        window = read_model_config(self.model).train_len
        for method in self.methods:  # each method's own refusal first: it says why the method needs it
            if REGISTRY[method].window_preview:
                REGISTRY[method].window_preview(self.settings, window)
        if self.settings.train_len is not None and self.settings.train_len > window:
            raise ConfigError(f"--train-len ({self.settings.train_len}) exceeds the model's training window "
                              f"({window})")
        previewed = [method for method in self.methods if method in PREVIEWED]
        if previewed:  # their checks need transformers' config (and torch): only when they are chosen
            from ..loading import load_config
            from ..methods.resolving import preview_method

            config = load_config(self.model)
            for method in previewed:
                preview_method(config, method, self.settings)
        return window

    def check_device(self) -> None:
        """--device cuda without a GPU, and bitsandbytes' --quantize where the model would run on the CPU: there it
        ran several times slower than the float model and saved next to no memory (issue 50: a 7.6k-token question
        to Gemma 3 270M unanswered after 5 minutes, against 59 s; 2.26 GiB against 2.28), so it is refused with what
        to use instead. Asked without torch where no GPU can be there (model/machine.py)."""
        from ..model.machine import choose_device, cuda_available

        if choose_device(self.device, self.device != "cpu" and cuda_available()) == "cpu" and self.quantize != "none":
            raise ConfigError(f"--quantize {self.quantize} is for CUDA GPUs: on the CPU bitsandbytes runs several "
                              "times slower than the float model. Leave --quantize out, or give a GGUF file (-m "
                              "FILE.gguf)")

    @property
    def method(self) -> str:
        """The one method of an answering command."""
        if len(self.methods) != 1:
            raise ConfigError("--method takes one method here; lists and 'all' are for gali ppl")
        return self.methods[0]


@dataclass(frozen=True)
class Reading:
    """How documents are read: an encrypted PDF's password, the size past which an input is refused, the prompt
    length past which it is refused before any forward (None: what the free memory holds), and whether a PDF with
    text on fewer than half its pages is read."""

    password: str | None = None
    max_bytes: int = MAX_INPUT_BYTES
    max_prompt_tokens: int | None = None
    allow_partial: bool = False  # a PDF most of whose pages have no text is read all the same (--allow-partial)


@dataclass(frozen=True)
class Answering:
    """How an answer is generated and shown."""

    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    system: str | None
    stream: bool
    json_output: bool
    verbose: bool
    cache_dir: str | None = None
    no_cache: bool = False
    seed: int = 0  # sampling's

    def __post_init__(self) -> None:
        """top_p 0 keeps only the most likely token, which is greedy decoding: said so here, as `gali serve` says it
        (server/app.py), since the sampler takes top_p in (0, 1] and --help shows 0 as valid."""
        if self.top_p == 0:
            object.__setattr__(self, "temperature", 0.0)
            object.__setattr__(self, "top_p", 1.0)


@dataclass(frozen=True)
class Serving:
    """Where `gali serve` listens, who may use it, and what a request that leaves them out gets."""

    host: str
    port: int
    api_key: str | None
    model_name: str | None  # None: the --model value
    max_new_tokens: int
    temperature: float
    top_p: float
    queue_size: int
    max_request_mib: int
    cache_dir: str | None
    no_cache: bool
    allow_hosts: tuple[str, ...] = ()  # Host names served besides the local ones (guard.Reach)
    allow_origins: tuple[str, ...] = ()  # web origins let in (CORS)
    max_prompt_tokens: int | None = None  # None: what the machine can hold and read (estimate.readable_tokens)
