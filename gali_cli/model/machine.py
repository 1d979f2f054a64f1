"""What this machine offers a model: torch's build, the GPUs, the libraries. Read without importing torch where
torch cannot see a GPU anyway, so that `gali info` answers at once on a machine without one.

Where a GPU may be there (a CUDA or ROCm build of torch, and the GPU driver's device files), only torch can say what
it sees (driver, CUDA_VISIBLE_DEVICES, compute capability), and it is imported and asked.
"""

import ast
import importlib.metadata
import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .. import compat
from ..errors import ConfigError

DTYPES = ("bfloat16", "float16", "float32")
# --kv-dtype: how the KV cache stores keys and values. model: in the dtype the model computes in (the default); the
# 16-bit types halve a float32 model's cache, and move answers at near ties (docs/performance.md, "16-bit KV cache").
KV_DTYPES = ("model", "float16", "bfloat16")
# Device files a GPU driver creates on Linux: NVIDIA's, WSL's (CUDA through DirectX), AMD's (ROCm).
_CUDA_DEVICE_FILES, _ROCM_DEVICE_FILES = ("/dev/nvidiactl", "/dev/dxg"), ("/dev/kfd",)


@dataclass(frozen=True)
class TorchBuild:
    """torch's version and the GPU runtime it was built for, from its version.py (not imported)."""

    version: str
    cuda: str | None
    hip: str | None


@dataclass(frozen=True)
class Gpus:
    """The GPUs torch would use: name and memory each, and whether the first computes in bfloat16."""

    devices: tuple[dict, ...] = ()
    bf16: bool = False


def torch_build() -> TorchBuild | None:
    """The installed torch's build, read from torch/version.py as literals; None without torch."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    values = {}
    try:
        tree = ast.parse((Path(spec.submodule_search_locations[0]) / "version.py").read_text())
    except (OSError, SyntaxError):
        return None
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else getattr(
            node, "target", None)
        if isinstance(target, ast.Name) and getattr(node, "value", None) is not None:
            try:
                values[target.id] = ast.literal_eval(node.value)
            except ValueError:
                pass
    if not isinstance(values.get("__version__"), str):
        return None
    return TorchBuild(values["__version__"], values.get("cuda"), values.get("hip"))


def gpu_possible(build: TorchBuild | None) -> bool:
    """Whether torch could see a GPU here: it was built for CUDA or ROCm and, on Linux, the driver is there."""
    if build is None or (build.cuda is None and build.hip is None):
        return False
    if not sys.platform.startswith("linux"):
        return True
    files = _CUDA_DEVICE_FILES if build.cuda is not None else _ROCM_DEVICE_FILES
    return any(os.path.exists(path) for path in files)


def gpus() -> Gpus:
    """The GPUs torch sees; without importing torch where it cannot see any."""
    if not gpu_possible(torch_build()):
        return Gpus()
    import torch

    if not torch.cuda.is_available():
        return Gpus()
    devices = tuple({"name": torch.cuda.get_device_name(i),
                     "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1)}
                    for i in range(torch.cuda.device_count()))
    return Gpus(devices, torch.cuda.is_bf16_supported())


def cuda_available() -> bool:
    """Whether torch sees a CUDA (or ROCm) GPU; without importing torch where it cannot see any."""
    if not gpu_possible(torch_build()):
        return False
    import torch

    return torch.cuda.is_available()


def choose_device(device: str, cuda_available: bool) -> str:
    """auto: "cuda" when there is a GPU, else "cpu"; asking for CUDA without one is an error."""
    if device == "auto":
        return "cuda" if cuda_available else "cpu"
    if device == "cuda" and not cuda_available:
        raise ConfigError("--device cuda: no CUDA GPU is available (use --device cpu)")
    if device not in ("cuda", "cpu"):
        raise ConfigError(f"--device must be auto, cuda or cpu, got {device!r}")
    return device


def cpu_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether the CPU has AMX's bfloat16 tiles (Intel Sapphire Rapids and later), from the flags Linux lists;
    elsewhere, or unreadable, False. That is where PyTorch's bfloat16 matrix products beat float32 (issue 26's
    trial: docs/notes/2026-11-performance-history.md, "bfloat16 on the CPU (issue 26)"). AVX-512 BF16 alone is not
    enough: on a Xeon VM that shows it but hides AMX, a SmolLM2 prefill took longer in bfloat16
    (docs/performance.md, "bfloat16 on the CPU").

    GALI_CPU_BF16=1 or 0 overrides the flags (a virtual machine may hide them; the tests pin float32 with 0)."""
    override = os.environ.get("GALI_CPU_BF16")
    if override in ("0", "1"):
        return override == "1"
    try:
        with open(cpuinfo, encoding="ascii", errors="replace") as file:
            for line in file:
                name, _, value = line.partition(":")
                if name.strip() == "flags":
                    return "amx_bf16" in value.split()
    except OSError:
        pass
    return False


def choose_dtype(dtype: str, device_type: str, bf16_supported: bool) -> str:
    """auto: bfloat16 where the device computes in it fast (`bf16_supported`: a GPU that has it, or a CPU with AMX),
    else float16 on a GPU and float32 on a CPU.

    On the CPU it halves the weights' memory; perplexity on prose barely moves (docs/performance.md, "bfloat16 on
    the CPU")."""
    if dtype == "auto":
        if device_type != "cuda":
            return "bfloat16" if bf16_supported else "float32"
        return "bfloat16" if bf16_supported else "float16"
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype must be auto, {', '.join(DTYPES)}; got {dtype!r}")
    return dtype


def kv_override(kv_dtype: str) -> str | None:
    """The dtype --kv-dtype stores keys and values in where it overrides the model's compute dtype; None for
    `model` (the default, which changes nothing: identities leave it out, so what was stored before it still
    matches)."""
    return None if kv_dtype == KV_DTYPES[0] else kv_dtype


def kv_storage(kv_dtype: str, dtype: str) -> str:
    """The dtype the KV cache stores keys and values in: --kv-dtype's, or for `model` the compute dtype `dtype` (as
    `choose_dtype` resolved it)."""
    return kv_override(kv_dtype) or dtype


def environment_facts(device: str, dtype: str, noisy_attention: Callable[[str, str], str]) -> dict:
    """Where a model would run: device and dtype as resolved, GPUs, bitsandbytes, noisy attention's path (as
    `noisy_attention(device, dtype)` names it: the engine's words, which this layer does not import), library
    versions (`gali info`; keys as its --json has always had them)."""
    found = gpus()
    target = choose_device(device, bool(found.devices))
    build = torch_build()
    resolved = choose_dtype(dtype, target, found.bf16 if target == "cuda" else cpu_bf16())
    return {"device": target, "dtype": resolved, "cuda": list(found.devices),
            "bitsandbytes": _bitsandbytes(imported_torch="torch" in sys.modules),
            "noisy_attention": noisy_attention(target, resolved),
            "torch": build.version if build else "not installed", "transformers": _version("transformers"),
            "transformers_tested": _tested_transformers()}


def _tested_transformers() -> str:
    """Whether the installed transformers is one gali's equivalence tests passed on (compat.py)."""
    version = compat.installed_transformers()
    if version is None:
        return "not installed"
    tested = compat.TESTED_TRANSFORMERS
    return f"no: gali is tested with {tested}" if compat.untested_release(version) else f"yes ({tested})"


def _bitsandbytes(imported_torch: bool) -> str:
    """bitsandbytes' version; where torch is imported already (a GPU machine), bitsandbytes is imported too, to
    report a broken install (e.g. CUDA libraries it cannot find) as what it is."""
    version = _version("bitsandbytes")
    if version == "not installed":
        return "unavailable (not installed: pip install bitsandbytes)"
    if imported_torch:
        try:
            import bitsandbytes  # noqa: F401
        except Exception as error:  # any import failure means "not usable", and we say why
            return f"unavailable ({type(error).__name__}: {error})"
    return f"bitsandbytes {version}"


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"
