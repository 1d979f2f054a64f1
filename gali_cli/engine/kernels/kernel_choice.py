"""What the choice of GALI's attention kernels depends on outside torch: $GALI_KERNEL, whether triton is installed,
the C compiler of the native kernel (the decision itself: plan.py).

Without torch: `gali info` and a mistyped GALI_KERNEL answer before anything heavy is imported.
"""

import functools
import importlib.util
import os
import shlex

from ...errors import ConfigError

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


def compiler() -> list[str]:
    """The C compiler command that builds the native noise kernel: $CC (may carry flags), else cc."""
    return shlex.split(os.environ.get("CC") or "cc")
