"""The one place a forward's attention plan is decided (`plan_for`): `plan.decide` from the tensors' device, dtype and
autograd, then the fast kernels' first-use checks, which run the routes they stand in for. Called once per forward by
its first layer (`contract.Forward.attention_plan`) and once per decoding step; every route takes the plan it gives.
"""

import dataclasses

import torch

from ...errors import ConfigError
from . import noisy_attention
from .dense import cpu_flash_available, cuda_partial_applies, cuda_partial_verified
from .plan import AttentionPlan, decide


def plan_for(query, key, value, dropout: float = 0.0, noise: bool = False) -> AttentionPlan:
    """The plan for attention over tensors like these (query (B, H, q, D), key/value (B, Hkv, T, D)), with the fast
    kernels' first-use checks done: a forward decides it once, from its first layer, and every layer follows it.

    Raises ConfigError where noise needs a kernel GALI_KERNEL forces and cannot run here.
    """
    # The one test of "gradients or dropout": autograd records an op on these tensors, or dropout is drawn.
    recorded = torch.is_grad_enabled() and any(tensor.requires_grad for tensor in (query, key, value))
    plan = decide(query.device.type, str(query.dtype).removeprefix("torch."), dropout == 0.0 and not recorded,
                  noise, cpu_flash_available())
    # Parts run in the queries' dtype, or rounded to the values' (dense.partial_attention): both are held to it.
    if plan.partial == "cuda" and not (cuda_partial_applies(query) and all(
            cuda_partial_verified(query.device, dtype) for dtype in {query.dtype, value.dtype})):
        plan = dataclasses.replace(plan, partial="explicit")
    return checked(plan, query, key) if noise else plan


def checked(plan: AttentionPlan, query, key) -> AttentionPlan:
    """`plan` with its noisy kernel held to the PyTorch path on first use (GALI_KERNEL=auto; a failed check warns
    once and takes the PyTorch path), or the ConfigError of a forced kernel that cannot run."""
    if plan.error is not None:
        raise ConfigError(plan.error)
    if plan.noisy == "triton":
        from ..kernels.triton_attention import supports  # imports triton: only where it runs

        if not supports(query, key):
            if not plan.checked:
                raise ConfigError(f"GALI_KERNEL=triton: the kernel needs a power-of-two head dim of 16..256 and "
                                  f"float16/bfloat16/float32, got {query.shape[-1]} and {query.dtype}")
            return dataclasses.replace(plan, noisy="torch", why="the fused kernel has no variant for these heads")
        heads_per_kv = query.shape[1] // key.shape[1]
        if plan.checked and not noisy_attention.kernel_verified(query.device, query.dtype, query.shape[-1],
                                                                heads_per_kv):
            return dataclasses.replace(plan, noisy="torch", why="the fused kernel failed its first-use check")
    if plan.noisy == "native" and plan.checked and not noisy_attention.native_verified():
        return dataclasses.replace(plan, noisy="torch", noisy_partial="explicit",
                                   why="the native kernel failed its first-use check")
    return plan
