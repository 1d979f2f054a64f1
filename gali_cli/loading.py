"""Loading a Llama and its tokenizer: hub id, local directory or the bundled demo; full precision or bitsandbytes."""

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig, PreTrainedModel

from .errors import ConfigError, ModelLoadError, UnsupportedModelError

DEMO = "demo"
DEFAULT_MODEL = "meta-llama/Meta-Llama-3-8B-Instruct"
QUANTIZATIONS = ("none", "8bit", "4bit")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class LoadedModel:
    """A model ready to use, with the facts about it that gali reports."""

    model: PreTrainedModel
    tokenizer: object  # a transformers tokenizer
    name: str  # as the user gave it
    source: str  # the directory or hub id it was loaded from
    device: torch.device
    dtype: torch.dtype
    quantization: str

    @property
    def train_len(self) -> int:
        return self.model.config.max_position_embeddings


def demo_model_path() -> Path:
    """The bundled demo model (see benchmarks/train_demo_model.py)."""
    return Path(__file__).parent / "demo"


def resolve_device(device: str) -> torch.device:
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


def load_model(name: str, quantize: str = "none", device: str = "auto", dtype: str = "auto") -> LoadedModel:
    """Load a Llama for inference: bf16 on CUDA and fp32 on CPU by default, spread over all GPUs with
    device_map="auto"; bitsandbytes 8-bit, or 4-bit NF4 computing in bf16."""
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
            device_map="auto" if target.type == "cuda" else "cpu",
            quantization_config=quantization,
            trust_remote_code=False,
        )
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=False)
    except torch.cuda.OutOfMemoryError as error:
        raise ModelLoadError(f"CUDA ran out of memory loading {name}: try --quantize 4bit") from error
    except (OSError, ValueError, ImportError) as error:
        raise ModelLoadError(_load_failure(name, source, error)) from error
    model.eval()
    return LoadedModel(model, tokenizer, name, source, target, torch_dtype, quantize)


def _load_failure(name: str, source: str, error: Exception) -> str:
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if source == name and not Path(name).expanduser().exists():
        return (
            f"cannot load model {name!r}: it is not a local directory, and the Hugging Face hub does not have it "
            f"or cannot be reached (offline?) - {reason}"
        )
    return f"cannot load model {name!r} from {source}: {reason}"
