"""How a decoded token runs, decided beside the forward's plan (choice.py): whether the static step is asked for
($GALI_DECODE), whether it pays where it may run (`static_pays`), and how it attends over the cache
(`attention_route`: "triton", "native" or "torch", the native kernels built on first use). engine/seam/static_decode.py
builds the step from these, with the checks that need the loaded model and its cache (`why_not_static`); `gali info -v`
prints them (runs/info.py).

Importing this module imports no torch: the kernels' own checks are imported when a route is asked for.
"""

import functools
import os
import warnings

from ...errors import ConfigError, GaliWarning
from ..kernels.kernel_choice import kernel_choice, triton_installed

DECODE_CHOICES = ("auto", "eager", "static")
ROUTES = ("triton", "native", "torch")  # how a static step attends over the cache (`attention_route`)
ROUTE_WORDS = {"triton": "Triton attention", "native": "native attention", "torch": "PyTorch attention"}
# Why a model decodes eagerly, where the method or the rope decides it (static_decode.why_not_static, gali info -v):
DYNAMIC_ROPE = "dynamic NTK changes its frequencies with the length"
NOT_PAYING = "without a decoding kernel, the method's own step is faster here; GALI_DECODE=static forces the static one"


def no_static_step(method: str) -> str:
    """Why `method` decodes eagerly: its attention declares no placement for the static step."""
    return f"{method} has no static decoding step"


def decode_choice() -> str:
    """$GALI_DECODE (auto, eager or static; auto when unset), checked. auto: the static step where it pays
    (`static_pays`); static: wherever it can run (graphed on a GPU); eager: never."""
    choice = os.environ.get("GALI_DECODE", "auto").strip().lower() or "auto"
    if choice not in DECODE_CHOICES:
        raise ConfigError(f"GALI_DECODE must be one of {', '.join(DECODE_CHOICES)}, got {choice!r}")
    return choice


def attention_route(device, dtype, head_dim: int, group: int) -> str:
    """How a static step on `device` (a torch.device) in `dtype` (a torch.dtype) attends over the cache: "triton"
    (triton_decode's kernel, on CUDA with triton installed) or "native" (native_decode's, on the CPU in float32), each
    rotating every key as it reads it, where GALI_KERNEL is auto or names it and the heads fit the kernel; else
    "torch" (the keys rotated first, then static_decode.split_key_attention)."""
    choice = kernel_choice()
    if device.type == "cuda" and choice in ("auto", "triton") and triton_installed():
        from ..kernels.triton_decode import supports

        return "triton" if supports(dtype, head_dim) else "torch"
    if device.type == "cpu" and choice in ("auto", "native"):
        from ..kernels.native_decode import supports

        return "native" if supports(dtype, head_dim, group) and native_decode_available() else "torch"
    return "torch"


@functools.cache
def native_decode_available() -> bool:
    """Build (once per machine) and load the native kernels; a machine whose C compiler is missing or fails decodes
    with the PyTorch route, after one warning."""
    from ..kernels.native_library import load_kernel

    try:
        load_kernel()
    except Exception as failure:  # no compiler, a compiler error, a library that does not load
        message = " ".join(str(failure).split())[:200]
        warnings.warn(f"the native decoding kernel cannot be built here ({type(failure).__name__}: {message}); "
                      f"the decoding step rotates its keys in PyTorch", GaliWarning, stacklevel=2)
        return False
    return True


def static_pays(device_type: str, route: str, remaps_positions: bool) -> bool:
    """Whether GALI_DECODE=auto takes the static step (where it may run), as measured (docs/performance.md): on a GPU
    for every method (a graph replay); on a CPU, where nothing is graphed, for every method where the native kernel
    attends (float32: 1.2-1.35x the eager step of SelfExtend and GALI on SmolLM2, as fast as the unpatched step),
    else for the models whose cache holds rotated keys (the unpatched model, NTK, YaRN: 1.0-1.3x), not for the
    position-remapping methods (`remaps_positions`: an attention installed), whose eager step keeps its rotated keys
    from token to token and beats rotating them all in PyTorch past a few thousand tokens."""
    return device_type == "cuda" or route == "native" or not remaps_positions
