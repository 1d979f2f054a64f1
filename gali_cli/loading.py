"""Loading a Llama and its tokenizer: hub id, local directory or the bundled demo; full precision or bitsandbytes."""

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig, PreTrainedModel

from .engine.noisy_attention import noisy_attention_path
from .errors import ConfigError, ModelLoadError, UnsupportedModelError

DEMO = "demo"
QUANTIZATIONS = ("none", "8bit", "4bit")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


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


def demo_model_path() -> Path:
    """The bundled demo model (see benchmarks/train_demo_model.py)."""
    return Path(__file__).parent / "demo"


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


def model_source(name: str) -> str:
    """Where `name` loads from: the demo's directory, a local directory, or a hub id (checked for typos in paths)."""
    if name == DEMO:
        return str(demo_model_path())
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelLoadError(f"--model {name}: a model is a directory (with config.json), not a file")
        return str(path)
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise ModelLoadError(f"--model {name}: no such directory")
    return name


def load_config(name: str):
    """The model's config, checked to be a Llama gali can handle, before any weight is read."""
    source = model_source(name)
    try:
        config = AutoConfig.from_pretrained(source, trust_remote_code=False)
    except (OSError, ValueError) as error:
        raise ModelLoadError(_load_failure(name, source, error)) from error
    if config.model_type != "llama":
        raise UnsupportedModelError(f"{name} is a {config.model_type!r} model; gali supports Llama models only")
    return config


def load_model(
    name: str, quantize: str = "none", device: str = "auto", dtype: str = "auto", gpu: int | None = None
) -> LoadedModel:
    """Load a Llama for inference: bf16 on CUDA and fp32 on CPU by default, spread over all GPUs with
    device_map="auto" (or all on GPU `gpu`: one process per GPU under a launcher); bitsandbytes 8-bit, or 4-bit
    NF4 computing in bf16."""
    if quantize not in QUANTIZATIONS:
        raise ConfigError(f"--quantize must be one of {', '.join(QUANTIZATIONS)}; got {quantize!r}")
    target = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, target)
    config = load_config(name)
    source = model_source(name)
    quantization = None
    if quantize == "8bit":
        quantization = BitsAndBytesConfig(load_in_8bit=True)
    elif quantize == "4bit":
        quantization = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16
        )
    try:
        model = AutoModelForCausalLM.from_pretrained(
            source,
            config=config,
            dtype=torch_dtype,
            device_map=("auto" if gpu is None else {"": gpu}) if target.type == "cuda" else "cpu",
            quantization_config=quantization,
            trust_remote_code=False,
        )
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=False)
    except torch.cuda.OutOfMemoryError as error:
        raise ModelLoadError(f"CUDA ran out of memory loading {name}: try --quantize 4bit") from error
    except (OSError, ValueError, ImportError) as error:
        raise ModelLoadError(_load_failure(name, source, error)) from error
    model.eval()
    identity = {"model": name, "source": str(Path(source).resolve()) if Path(source).exists() else source,
                "weights": weights_fingerprint(source, config), "quantize": quantize, "dtype": str(torch_dtype),
                "device": target.type}
    return LoadedModel(model, tokenizer, target, torch_dtype, identity)


def weights_fingerprint(source: str, config) -> list:
    """What tells these weights from others under the same name: for a directory, its files' names, sizes and
    modification times (a retrained model in the same place changes them); for a hub id, the commit loaded."""
    path = Path(source)
    if not path.is_dir():
        return [getattr(config, "_commit_hash", None)]
    return sorted((entry.name, entry.stat().st_size, entry.stat().st_mtime_ns) for entry in os.scandir(path)
                  if entry.is_file() and entry.name.endswith((".safetensors", ".bin", ".json", ".model")))


def _load_failure(name: str, source: str, error: Exception) -> str:
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
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
