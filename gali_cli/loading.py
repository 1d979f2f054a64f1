"""Loading a Llama and its tokenizer: hub id, local directory, GGUF file, the real small model or the bundled demo;
full precision or bitsandbytes."""

import copy
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig, PreTrainedModel

from .errors import ConfigError, ModelLoadError, UnsupportedModelError
from .gguf import GgufFile, check_llama, read_header, require_gguf_package
from .machine import choose_device, choose_dtype
from .model_cache import DequantizedModels
# Where a model loads from is decided without torch (model_config.py, for gali info); the names stay importable from
# here, where the benchmarks and tests that load a model look.
from .model_config import (  # noqa: F401
    DEMO, GPU_DEFAULT_MODEL, SMOLLM2, SMOLLM2_INSTALL, ModelSource, default_model, demo_model_path, load_failure,
    resolve_source, smollm2_gguf,
)
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


def resolve_device(device: str) -> torch.device:
    """auto: the first CUDA GPU when there is one, else the CPU; asking for CUDA without one is an error."""
    return torch.device(choose_device(device, torch.cuda.is_available()))


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """auto: bfloat16 on a GPU that has it (else float16), float32 on CPU."""
    return DTYPES[choose_dtype(dtype, device.type, device.type == "cuda" and torch.cuda.is_bf16_supported())]


def load_config(name: str):
    """The model's config, checked to be a Llama gali can handle, before any weight is read."""
    source = resolve_source(name)
    try:
        config = _gguf_config(source.gguf) if source.gguf else AutoConfig.from_pretrained(source.location,
                                                                                          trust_remote_code=False)
    except (OSError, ValueError) as error:
        raise ModelLoadError(load_failure(name, source.location, error)) from error
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
    quantization = None
    if quantize == "8bit":
        quantization = BitsAndBytesConfig(load_in_8bit=True)
    elif quantize == "4bit":
        quantization = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16
        )
    try:
        model = AutoModelForCausalLM.from_pretrained(
            location,
            config=config,
            dtype=torch_dtype,
            device_map=("auto" if gpu is None else {"": gpu}) if target.type == "cuda" else "cpu",
            quantization_config=quantization,
            trust_remote_code=False,
        )
        tokenizer = AutoTokenizer.from_pretrained(location, trust_remote_code=False)
    except torch.cuda.OutOfMemoryError as error:
        raise ModelLoadError(f"CUDA ran out of memory loading {name}: try --quantize 4bit") from error
    except (OSError, ValueError, ImportError) as error:
        raise ModelLoadError(load_failure(name, source.location, error)) from error
    model.eval()
    where = source.location
    identity = {"model": name, "source": str(Path(where).resolve()) if Path(where).exists() else where,
                "weights": [source.gguf.fingerprint()] if source.gguf else weights_fingerprint(where, config),
                "quantize": quantize, "dtype": str(torch_dtype), "device": target.type}
    return LoadedModel(model, tokenizer, target, torch_dtype, identity)


def weights_fingerprint(source: str, config) -> list:
    """What tells these weights from others under the same name: for a directory, its files' names, sizes and
    modification times (a retrained model in the same place changes them); for a hub id, the commit loaded."""
    path = Path(source)
    if not path.is_dir():
        return [getattr(config, "_commit_hash", None)]
    return sorted((entry.name, entry.stat().st_size, entry.stat().st_mtime_ns) for entry in os.scandir(path)
                  if entry.is_file() and entry.name.endswith((".safetensors", ".bin", ".json", ".model")))
