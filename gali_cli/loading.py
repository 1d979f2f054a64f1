"""Loading a Llama and its tokenizer: hub id, local directory, GGUF file, the real small model or the bundled demo;
full precision or bitsandbytes."""

import copy
import ctypes
import functools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    BitsAndBytesConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

from .compat import no_hub_code_kwargs
from .errors import ConfigError, ModelLoadError
from .gguf_weights import load_gguf_weights
from .model.chat_template import check_chat_template
from .model.companions import GgufCompanions

# Where a model loads from is decided without torch (config.py, for gali info); the names stay importable from
# here, where the benchmarks and tests that load a model look.
from .model.config import (  # noqa: F401
    DEMO,
    GPU_DEFAULT_MODEL,
    SMOLLM2,
    SMOLLM2_INSTALL,
    ModelSource,
    default_model,
    demo_model_path,
    load_failure,
    read_model_config,
    resolve_source,
    smollm2_gguf,
)
from .model.families import default_train_len, family_of
from .model.gguf import GgufFile, GgufHeader, check_architecture, read_header, require_gguf_package
from .model.machine import choose_device, choose_dtype, cpu_bf16

QUANTIZATIONS = ("none", "8bit", "4bit")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")  # torch.save / pickle checkpoints: never opened


@dataclass
class LoadedModel:
    """A model ready for inference, and its tokenizer."""

    model: PreTrainedModel
    tokenizer: object  # a transformers tokenizer
    device: torch.device
    dtype: torch.dtype
    identity: dict = field(default_factory=dict)  # what the weights are and how they run (document cache key)
    kv_dtype: torch.dtype | None = None  # how its KV caches store keys and values (--kv-dtype; None: in `dtype`)

    @property
    def train_len(self) -> int:
        return default_train_len(self.model.config)

    @property
    def stored_dtype(self) -> torch.dtype:
        """The dtype its KV caches hold keys and values in: what bounds a prompt's memory, and keys stored states."""
        return self.kv_dtype or self.dtype


def resolve_device(device: str) -> torch.device:
    """auto: the first CUDA GPU when there is one, else the CPU; asking for CUDA without one is an error. The CPU
    asked for starts no CUDA (whose start prints torch's warnings where it fails, under a memory limit say)."""
    return torch.device(choose_device(device, device != "cpu" and torch.cuda.is_available()))


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """auto: bfloat16 where the device computes in it natively, else float16 on a GPU and float32 on a CPU."""
    native = torch.cuda.is_bf16_supported() if device.type == "cuda" else cpu_bf16()
    return DTYPES[choose_dtype(dtype, device.type, native)]


def load_config(name: str):
    """The model's config, checked to be a Llama gali can handle, with sane sizes (model_config.check_config),
    before any weight is read or anything is built from it."""
    source = resolve_source(name)
    read_model_config(name)  # the raw file checked first: transformers builds objects from what it says
    try:
        config = _gguf_config(source.gguf) if source.gguf else AutoConfig.from_pretrained(source.location,
                                                                                          trust_remote_code=False)
    except (OSError, ValueError) as error:
        raise ModelLoadError(load_failure(name, source.location, error)) from error
    family_of(config, name)
    return config


def _gguf_config(gguf: GgufFile):
    """A GGUF's config (a copy: transformers changes the one it loads with), its header checked first."""
    require_gguf_package()
    return copy.deepcopy(_checked_gguf_config(gguf))


@functools.lru_cache(maxsize=4)
def _checked_header(gguf: GgufFile) -> GgufHeader:
    header = read_header(gguf.path)
    check_architecture(gguf.path, header)
    return header


@functools.lru_cache(maxsize=4)
def _checked_gguf_config(gguf: GgufFile):
    _checked_header(gguf)
    return GgufCompanions().config(gguf)


def load_model(
    name: str, quantize: str = "none", device: str = "auto", dtype: str = "auto", gpu: int | None = None,
    notice: Callable[[str], None] | None = None,
) -> LoadedModel:
    """Load a Llama for inference: by default in bf16 where the device computes in it (else fp16 on CUDA, fp32 on
    CPU), spread over all GPUs with device_map="auto" (or all on GPU `gpu`: one process per GPU under a launcher);
    bitsandbytes 8-bit, or 4-bit NF4 computing in bf16. A GGUF's weights are read from the file itself, kept in
    their quantized blocks on the CPU in float32 (gguf_weights.py), its config and tokenizer from the user cache
    (companions.py). `notice` hears about slow first-time work."""
    if quantize not in QUANTIZATIONS:
        raise ConfigError(f"--quantize must be one of {', '.join(QUANTIZATIONS)}; got {quantize!r}")
    target = resolve_device(device)
    source = resolve_source(name)
    if source.gguf is not None:
        if quantize != "none":
            raise ConfigError(f"--quantize {quantize} applies to float checkpoints: {name} is a GGUF file, whose "
                              "weights gali keeps in their own quantized blocks")
        return _load_gguf(name, source.gguf, target, dtype, gpu, notice)
    torch_dtype = resolve_dtype(dtype, target)
    config = load_config(name)
    location = source.location
    check_weights(name, location, config)
    tokenizer = load_tokenizer(name, location)  # before the weights: a broken tokenizer fails in a second
    quantization = None
    if quantize == "8bit":
        quantization = BitsAndBytesConfig(load_in_8bit=True)
    elif quantize == "4bit":
        quantization = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16
        )
    try:
        model, report = AutoModelForCausalLM.from_pretrained(
            location,
            config=config,
            dtype=torch_dtype,
            device_map=("auto" if gpu is None else {"": gpu}) if target.type == "cuda" else "cpu",
            quantization_config=quantization,
            trust_remote_code=False,
            **no_hub_code_kwargs(),  # no kernels fetched from the Hub (transformers 5.25 turned them on)
            use_safetensors=True,  # a hub repository with pickle checkpoints only is refused, not unpickled
            ignore_mismatched_sizes=True,  # reported below with the missing and unexpected weights, by name
            output_loading_info=True,
        )
    except torch.cuda.OutOfMemoryError as error:
        raise ModelLoadError(f"CUDA ran out of memory loading {name}: try --quantize 4bit") from error
    except (OSError, ValueError, ImportError, SafetensorError) as error:
        raise ModelLoadError(load_failure(name, source.location, error)) from error
    check_loading_report(name, report)
    model.eval()
    where = source.location
    identity = {"model": name, "source": str(Path(where).resolve()) if Path(where).exists() else where,
                "weights": weights_fingerprint(where, config), "quantize": quantize, "dtype": str(torch_dtype),
                "device": target.type}
    return LoadedModel(model, tokenizer, target, torch_dtype, identity)


def _load_gguf(name: str, gguf: GgufFile, target: torch.device, dtype: str, gpu: int | None,
               notice: Callable[[str], None] | None) -> LoadedModel:
    """A GGUF: its header checked, config and tokenizer from the user cache (read from the file once), weights from
    the file. On the CPU it computes in float32 unless another dtype is asked for (its blocks are float32 grids)."""
    companions = GgufCompanions(notice=notice)
    companions.check()
    config = load_config(name)
    torch_dtype = DTYPES[dtype] if dtype in DTYPES else (torch.float32 if target.type == "cpu" else
                                                         resolve_dtype(dtype, target))
    tokenizer = load_tokenizer(name, str(companions.directory_for(gguf)), as_saved=True)
    device = torch.device("cuda", gpu if gpu is not None else 0) if target.type == "cuda" else target
    try:
        model = load_gguf_weights(gguf.path, _checked_header(gguf), config, device, torch_dtype, notice)
    except torch.cuda.OutOfMemoryError as error:
        raise ModelLoadError(f"CUDA ran out of memory loading {name}") from error
    identity = {"model": name, "source": str(gguf.path), "weights": [gguf.fingerprint()], "quantize": "none",
                "dtype": str(torch_dtype), "device": target.type}
    return LoadedModel(model, tokenizer, target, torch_dtype, identity)


def load_tokenizer(name: str, location: str, as_saved: bool = False):
    """The model's tokenizer, its chat template compiled; whatever the tokenizers library or jinja2 make of a
    broken file (an empty tokenizer.json, a template that does not parse) is a ModelLoadError naming the model.
    `as_saved`: the folder holds a tokenizer as a load made it (a model cache entry: companions.py), which
    transformers' generic class reads straight into the Rust tokenizer, where the class the model's type names
    would rebuild it from Python copies of its vocabulary (Gemma 3's: 0.3 GB)."""
    folder = Path(location)
    if (folder / "tokenizer.json").is_file() and (folder / "tokenizer.json").stat().st_size == 0:
        raise ModelLoadError(f"cannot load model {name!r}: its tokenizer.json is empty")
    try:
        loader = PreTrainedTokenizerFast if as_saved else AutoTokenizer
        tokenizer = loader.from_pretrained(location, trust_remote_code=False)
    except Exception as error:  # tokenizers raises a bare Exception for a file it cannot parse
        raise ModelLoadError(f"cannot load model {name!r}: its tokenizer cannot be read "
                             f"({_first_line(error)})") from error
    if isinstance(tokenizer, bool) or not callable(tokenizer):  # transformers returns odd things for odd folders
        raise ModelLoadError(f"cannot load model {name!r}: it has no tokenizer transformers can read")
    tokenizer.name_or_path = name  # what a chat template's failure is blamed on (a GGUF's would be its cache entry)
    check_chat_template(name, tokenizer)
    _release_freed_memory()
    return tokenizer


def _release_freed_memory() -> None:
    """Hand the free pages of the C heap back to the system (glibc's malloc_trim; nothing where the C library has
    none). The Rust tokenizer parses tokenizer.json into a tree that it frees once built, below what it keeps
    (Gemma 3's: 0.2 GB freed, 0.1 GB kept); those pages would stay with the process (docs/performance.md)."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None) if os.name == "posix" else None
    if trim is not None:
        trim(0)


def check_weights(name: str, source: str, config=None) -> None:
    """Refuse a local model directory whose weights are pickle checkpoints only (unpickling can run code, so they
    are never opened) or whose safetensors files are damaged or cut short, before transformers reads any of them;
    with `config`, one whose tensors' shapes do not match it (check_shapes), before anything is allocated."""
    folder = Path(source)
    if not folder.is_dir():
        return  # a hub id: from_pretrained(use_safetensors=True) refuses pickles there
    files = sorted(folder.glob("*.safetensors"))
    pickles = sorted(path.name for path in folder.iterdir() if path.suffix in PICKLE_SUFFIXES and path.is_file())
    if not files and pickles:
        raise ModelLoadError(
            f"cannot load model {name!r}: {pickles[0]} is a pickle checkpoint, which gali never opens (unpickling "
            f"can run code); convert it to safetensors once, e.g. python -c \"from transformers import "
            f"AutoModelForCausalLM as M; M.from_pretrained('{folder}', use_safetensors=False)"
            f".save_pretrained('{folder}')\""
        )
    shapes = {}
    for path in files:
        try:
            with safe_open(path, framework="pt") as file:  # reads and checks the header: tensors must cover the file
                shapes.update((key, tuple(file.get_slice(key).get_shape())) for key in file.keys())  # noqa: SIM118 - not a dict
        except (SafetensorError, OSError) as error:
            raise ModelLoadError(f"cannot load model {name!r}: {path.name} is damaged or incomplete "
                                 f"({_first_line(error)}); copy or download it again") from error
    if config is not None and shapes:
        check_shapes(name, config, shapes)


def check_shapes(name: str, config, shapes: dict[str, tuple[int, ...]]) -> None:
    """The config against the tensors the checkpoint declares: no more parameters than the weights hold (give or
    take an untied output layer), and the embedding and the first layer's projections in the shapes the config
    gives them. transformers allocates what the config says before it compares, so a config of a thousand layers
    over a two-layer checkpoint would be built first; smaller differences are named by check_loading_report."""
    def refuse(detail: str) -> ModelLoadError:
        return ModelLoadError(f"cannot load model {name!r}: its config.json does not match its weights ({detail})")

    if getattr(config, "quantization_config", None):
        return  # a pre-quantized checkpoint packs its weights in other shapes
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    hidden, heads, kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    described = config.vocab_size * hidden * 2 + hidden + config.num_hidden_layers * (
        hidden * head_dim * 2 * (heads + kv_heads) + 3 * hidden * config.intermediate_size + 2 * hidden)
    stored = sum(math.prod(shape) for shape in shapes.values())
    if described > 2 * stored + 2**20:
        raise refuse(f"it describes {described:,} parameters in {config.num_hidden_layers} layers and the weights "
                     f"hold {stored:,}")
    expected = {"embed_tokens.weight": (config.vocab_size, hidden),
                "layers.0.self_attn.q_proj.weight": (heads * head_dim, hidden),
                "layers.0.self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
                "layers.0.mlp.gate_proj.weight": (config.intermediate_size, hidden)}
    for suffix, shape in expected.items():
        found = [key for key in (f"model.{suffix}", suffix) if key in shapes]
        if found and shapes[found[0]] != shape:
            raise refuse(f"{found[0]} is {list(shapes[found[0]])}, the config makes it {list(shape)}")


def check_loading_report(name: str, report: dict) -> None:
    """ModelLoadError naming the weights that the checkpoint lacks, has in excess, or has in another shape: with
    any of them the model would run on random weights."""
    problems = []
    for kind, keys in (("missing", report.get("missing_keys")), ("unexpected", report.get("unexpected_keys")),
                       ("of the wrong shape", [key for key, *_ in report.get("mismatched_keys") or ()])):
        if keys:
            keys = sorted(keys)
            listed = ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
            problems.append(f"{len(keys)} {kind} ({listed})")
    if problems:
        raise ModelLoadError(f"cannot load model {name!r}: its weights do not match its config.json: "
                             f"{'; '.join(problems)}")


def weights_fingerprint(source: str, config) -> list:
    """What tells these weights from others under the same name: for a directory, its files' names, sizes and
    modification times (a retrained model in the same place changes them); for a hub id, the commit loaded."""
    path = Path(source)
    if not path.is_dir():
        return [getattr(config, "_commit_hash", None)]
    return sorted((entry.name, entry.stat().st_size, entry.stat().st_mtime_ns) for entry in os.scandir(path)
                  if entry.is_file() and entry.name.endswith((".safetensors", ".bin", ".json", ".model")))


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
