"""Which path GALI's noisy attention takes, as $GALI_KERNEL asks, and that path in words for `gali info`.

Without torch: `gali info` and a mistyped GALI_KERNEL answer before anything heavy is imported.
"""

import functools
import importlib.metadata
import importlib.util
import os
import shlex

from ..errors import ConfigError

KERNEL_CHOICES = ("auto", "triton", "native", "torch")


def kernel_choice() -> str:
    """$GALI_KERNEL (auto, triton, native or torch; auto when unset), checked."""
    choice = os.environ.get("GALI_KERNEL", "auto").strip().lower() or "auto"
    if choice not in KERNEL_CHOICES:
        raise ConfigError(f"GALI_KERNEL must be one of {', '.join(KERNEL_CHOICES)}, got {choice!r}")
    return choice


@functools.cache
def triton_installed() -> bool:
    """Looked up once: every forward with noise, and `gali info`, ask."""
    return importlib.util.find_spec("triton") is not None


def noisy_attention_path(device_type: str) -> str:
    """Which path noisy GALI attention would take on a device of this type ("cuda", "cpu"), in words."""
    choice = kernel_choice()
    if choice == "torch":
        return "PyTorch (GALI_KERNEL=torch)"
    if device_type == "cpu" and choice in ("auto", "native"):
        checked = " and checked against PyTorch" if choice == "auto" else ""
        return f"native CPU kernel (built with {' '.join(compiler())}{checked} on first use)"
    if choice == "native":
        return "error: GALI_KERNEL=native runs on the CPU"
    if not triton_installed():
        return "PyTorch (triton is not installed)"
    if device_type != "cuda" and choice == "auto":
        return "PyTorch (the fused kernel needs CUDA)"
    if device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return "error: GALI_KERNEL=triton needs CUDA"
    checked = ", checked against PyTorch on first use" if choice == "auto" else ""
    return f"fused Triton kernel (triton {importlib.metadata.version('triton')}{checked})"


def compiler() -> list[str]:
    """The C compiler command that builds the native noise kernel: $CC (may carry flags), else cc."""
    return shlex.split(os.environ.get("CC") or "cc")
