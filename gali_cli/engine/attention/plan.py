"""Which attention a forward takes: one `AttentionPlan`, decided once per forward, that the implementations follow
without checking again, and that `gali info` prints (`describe`), so the words cannot drift from the decision.

The plan follows from the device, the dtype, whether autograd or dropout is at work (the fast routes are forward
only: this is the one place that asks), whether noise is added, which kernels exist here and $GALI_KERNEL; the
fast kernels' first-use checks (held to PyTorch on first use, once per process) are part of the decision.

`decide` needs no torch (`gali info` answers from it before torch loads); `choice.plan_for` decides from a layer's
tensors, with the kernels' first-use checks, which run the routes: so the routes import this module, and the choice
imports the routes.
"""

import dataclasses
import os
from dataclasses import dataclass

from ..kernels.kernel_choice import compiler, kernel_choice
from ..kernels.kernel_choice import triton_installed as _triton_installed  # a name of this module: tests replace it

# The routes, in words. Causal attention of a chunk with fewer queries than keys (dense.CAUSAL):
CAUSAL_WORDS = {
    "lower-right": "torch's lower-right causal bias (memory-efficient kernel, no mask)",
    "split": "mask-free, by torch's CPU flash kernel (keys before the chunk, then its causal square)",
    "masked": "a (queries x keys) bool mask",
}
# Attention over part of the keys with its log-sum-exp (dense.PARTIAL):
PARTIAL_WORDS = {"flash": "torch's CPU flash kernel",
                 "cuda": "torch's memory-efficient CUDA kernel (in the model's dtype; rotations in float32)",
                 "explicit": "explicit float32 logits, a tile at a time"}
# The same, in the few words of `gali info`'s attention line:
SUMMARY_WORDS = {"flash": "torch's CPU flash kernel", "cuda": "torch's memory-efficient CUDA kernel",
                 "explicit": "explicit float32 logits"}
NOISY_SUMMARY_WORDS = {"native": "the native CPU kernel", "triton": "the fused Triton kernel",
                       "torch": "PyTorch (explicit logits)"}
# Noisy attention over keys every query sees (noisy_attention.NOISY_PARTIAL), for decoding and the CPU's split:
NOISY_PARTIAL_WORDS = {"native": "the native CPU kernel", "explicit": "explicit float32 logits"}


@dataclass(frozen=True)
class AttentionPlan:
    """The routes one forward's attention takes, for every layer and chunk."""

    device: str  # device type: "cuda", "cpu", ...
    dtype: str  # "float32", "bfloat16", ...
    forward_only: bool  # no autograd and no dropout: the forward-only fast routes may run
    noise: bool  # whether noise is added (some chunk, or the decode step, is noisy)
    causal: str  # chunks with fewer queries than keys: a key of CAUSAL_WORDS
    partial: str  # parts with their log-sum-exp: a key of PARTIAL_WORDS
    noisy: str | None = None  # noisy chunks: "triton", "native" or "torch" (the PyTorch path); None without noise
    noisy_partial: str | None = None  # noisy parts: a key of NOISY_PARTIAL_WORDS; None without noise
    why: str = ""  # why the noisy route is the one it is, in words
    checked: bool = False  # the noisy kernel is held to the PyTorch path on first use (GALI_KERNEL=auto)
    error: str | None = None  # a kernel GALI_KERNEL forces that cannot run here: raised where noise would run

    @property
    def split(self) -> bool:
        """GALI's chunks split on the CPU (gali_attention.split_gali_attention): the keys before each chunk by one
        call each, noisy ones by the native kernel, and the chunks' own causal squares batched."""
        return self.causal == "split" and (not self.noise or self.noisy_partial == "native")

    def noisy_words(self) -> str:
        """The path of noisy attention, in words (`gali info`'s noisy_attention)."""
        if self.error is not None:
            return f"error: {self.why}"
        if self.noisy == "native":
            checked = " and checked against PyTorch" if self.checked else ""
            return f"native CPU kernel (built with {' '.join(compiler())}{checked} on first use)"
        if self.noisy == "triton":
            import importlib.metadata

            checked = ", checked against PyTorch on first use" if self.checked else ""
            return f"fused Triton kernel (triton {importlib.metadata.version('triton')}{checked})"
        return f"PyTorch ({self.why})"

    def summary(self) -> str:
        """The plan in a few plain words (`gali info`'s attention line): the kernel most attention runs on, whether
        GALI's chunks are split, and what adds the noise (describe() has every route)."""
        words = [SUMMARY_WORDS[self.partial] + (", GALI's chunks split" if self.split else "")]
        if not self.noise:
            words.append("no noise")
        elif self.error is not None:
            words.append(f"noise: cannot run ({self.why})")
        else:
            words.append(f"noise by {NOISY_SUMMARY_WORDS.get(self.noisy or 'torch')}")
        return "; ".join(words)

    def describe(self) -> str:
        """Every route a forward takes under this plan, in words (`gali info`, `gali info --check`)."""
        mode = "forward only" if self.forward_only else "with autograd or dropout"
        words = [f"{self.device}, {self.dtype}, {mode}", f"causal chunks: {CAUSAL_WORDS[self.causal]}",
                 f"parts: {PARTIAL_WORDS[self.partial]}"]
        if self.split:
            words.append("GALI's chunks split (keys before each chunk, then the chunks' own squares in one call)")
        if self.noise:
            words += [f"noisy chunks: {self.noisy_words()}", f"noisy parts: {NOISY_PARTIAL_WORDS[self.noisy_partial]}"]
        else:
            words.append("no noise")
        return "; ".join(words)


def decide(device: str, dtype: str, forward_only: bool, noise: bool, cpu_flash: bool = True,
           interpreted: bool | None = None) -> AttentionPlan:
    """The plan for attention on a device of this type, in this dtype, before the kernels' first-use checks.

    Args:
        forward_only: neither autograd nor dropout is at work.
        cpu_flash: torch has its CPU flash kernel with log-sum-exp (assumed where torch is not imported).
        interpreted: Triton runs interpreted on the CPU (TRITON_INTERPRET=1; read from the environment when None).
    """
    cpu = device == "cpu"
    if device == "cuda":
        causal = "lower-right"
    else:  # the split: float32 only (in bfloat16 the mask is faster), forward only (autograd would drop the lse's)
        causal = "split" if cpu and dtype == "float32" and forward_only and cpu_flash else "masked"
    if forward_only and ((cpu and cpu_flash) or device == "cuda"):
        partial = "flash" if cpu else "cuda"
    else:
        partial = "explicit"
    plan = AttentionPlan(device, dtype, forward_only, noise, causal, partial)
    if not noise:
        return plan
    if interpreted is None:
        interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    noisy, why, checked, error = _noisy_route(kernel_choice(), device, forward_only, interpreted)
    return dataclasses.replace(plan, noisy=noisy, noisy_partial="native" if noisy == "native" else "explicit",
                               why=why, checked=checked, error=error)


def _noisy_route(choice: str, device: str, forward_only: bool,
                 interpreted: bool) -> tuple[str, str, bool, str | None]:
    """(route, why, checked on first use, error) of noisy attention, as $GALI_KERNEL (`choice`) asks."""
    if not forward_only:
        return "torch", "autograd or dropout: the kernels are forward only", False, None
    if choice == "torch":
        return "torch", "GALI_KERNEL=torch", False, None
    if choice == "native" and device != "cpu":
        return "torch", "GALI_KERNEL=native runs on the CPU", False, (
            f"GALI_KERNEL=native runs on the CPU; the model is on {device}")
    if device == "cpu" and choice in ("auto", "native"):
        return "native", "", choice == "auto", None
    if choice == "triton" and device != "cuda" and not interpreted:
        return "torch", "GALI_KERNEL=triton needs CUDA", False, (
            f"GALI_KERNEL=triton needs a CUDA device, the model is on {device}")
    if not _triton_installed():
        if choice == "triton":
            return "torch", "GALI_KERNEL=triton, but triton is not installed", False, (
                "GALI_KERNEL=triton, but triton is not installed (pip install triton)")
        return "torch", "triton is not installed", False, None
    if device != "cuda" and choice == "auto":
        return "torch", "the fused kernel needs CUDA", False, None
    return "triton", "", choice == "auto", None
