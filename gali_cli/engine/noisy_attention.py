"""GALI's logit noise (paper Alg. 3) and the two paths of noisy attention: explicit float32 logits a tile of queries
at a time (PyTorch), or the fused Triton kernel; which one runs ($GALI_KERNEL, first-use check), and in words for
`gali info` (kernel_choice.py).

Shapes: B batch, H query heads, Hkv key/value heads, q queries (the last q of the T keys), D head dim.
"""

import functools
import os
import warnings
from collections.abc import Callable

import torch

from ..errors import ConfigError, GaliWarning
from .dense import grouped_logits, mask_future, needs_grad, tiled_attention
from .kernel_choice import kernel_choice
from .kernel_choice import triton_installed as _triton_installed  # a name of this module: tests replace it
from .noise import Noise, standard_normal

# (query, key, value, group, grouped, scale, noise, dropout) -> (B, H, q, D)
NoisyAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, int, float, Noise, float], torch.Tensor]


def add_noise(logits: torch.Tensor, query_index: torch.Tensor, group: int, grouped: int, noise: Noise) -> None:
    """Add N(0, sigma^2) in place to scaled logits (B, H, n, T) wherever c != 0 (before the causal mask).

    sigma = (i - j) / T * scale, i the query's and j the key's token index, T the number of keys (paper Alg. 3).
    c != 0 exactly for the grouped keys j < grouped whose position j / group is not an integer.
    """
    batch, heads, _, kv_len = logits.shape
    key_index = torch.arange(grouped, device=logits.device)
    sigma = (query_index.unsqueeze(-1) - key_index).float() * (noise.scale / kv_len)  # (n, grouped)
    sigma = sigma * (key_index % group != 0)
    logits[..., :grouped] += standard_normal(noise, batch, heads, query_index, grouped) * sigma


def noisy_route(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout: float = 0.0) -> NoisyAttention:
    """Which path noisy attention takes for tensors like these: decided once per forward, at its first noisy chunk.

    The fused kernel where it applies (see `fused_kernel_applies`), else the PyTorch path. The kernel is forward
    only: under autograd or dropout the PyTorch path runs (and a kernel route still steps aside for a layer that
    needs gradients). Both give the same noise.
    """
    if dropout != 0.0 or needs_grad(query, key, value) or not fused_kernel_applies(query, key):
        return tiled_noisy_attention
    from .triton_attention import noisy_gali_attention

    def fused_noisy_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group: int, grouped: int,
                              scale: float, noise: Noise, dropout: float = 0.0) -> torch.Tensor:
        if dropout != 0.0 or needs_grad(query, key, value):
            return tiled_noisy_attention(query, key, value, group, grouped, scale, noise, dropout)
        return noisy_gali_attention(query, key, value, group, grouped, scale, noise)

    return fused_noisy_attention


def noisy_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    group: int,
    grouped: int,
    scale: float,
    noise: Noise,
    dropout: float = 0.0,
) -> torch.Tensor:
    """Causal GALI attention with logit noise of rotated queries (B, H, q, D), the last q of the mixed keys
    (B, Hkv, T, D), by the path `noisy_route` picks for them (a chunked forward picks it once instead)."""
    route = noisy_route(query, key, value, dropout)
    return route(query, key, value, group, grouped, scale, noise, dropout)


def tiled_noisy_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    group: int,
    grouped: int,
    scale: float,
    noise: Noise,
    dropout: float = 0.0,
) -> torch.Tensor:
    """The PyTorch path of `noisy_attention`, and the kernel's reference: explicit logits, a tile at a time."""
    first = key.shape[2] - query.shape[2]  # token index of the first query

    def logits(rows: slice) -> torch.Tensor:
        scores = grouped_logits(query[:, :, rows], key, scale)
        query_index = torch.arange(first + rows.start, first + rows.stop, device=key.device)
        add_noise(scores, query_index, group, grouped, noise)
        mask_future(scores, query_index)
        return scores

    return tiled_attention(logits, value, query.shape[1], query.shape[2], dropout)


def fused_kernel_applies(query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether noisy attention runs the fused Triton kernel, as $GALI_KERNEL says.

    auto (default): on CUDA, when triton is installed, the shapes suit it, and the kernel passed its check on this
    device (`kernel_verified`). triton: always (errors if it cannot; on the CPU only under TRITON_INTERPRET=1, which
    the tests use). torch: never, the PyTorch path.
    """
    choice = kernel_choice()
    if choice == "torch" or (choice == "auto" and query.device.type != "cuda"):
        return False
    if not _triton_installed():
        if choice == "triton":
            raise ConfigError("GALI_KERNEL=triton, but triton is not installed (pip install triton)")
        return False
    from .triton_attention import supports

    if choice == "triton":
        if query.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ConfigError(f"GALI_KERNEL=triton needs a CUDA device, the model is on {query.device.type}")
        if not supports(query, key):
            raise ConfigError(f"GALI_KERNEL=triton: the kernel needs a power-of-two head dim of 16..256 and "
                              f"float16/bfloat16/float32, got {query.shape[-1]} and {query.dtype}")
        return True
    heads_per_kv = query.shape[1] // key.shape[1]
    return supports(query, key) and kernel_verified(query.device, query.dtype, query.shape[-1], heads_per_kv)


@functools.cache
def kernel_verified(device: torch.device, dtype: torch.dtype, head_dim: int, heads_per_kv: int) -> bool:
    """Run the kernel once on a small problem of the model's head dim (which picks the compiled variant and its tiles)
    and head grouping, and compare it with the PyTorch path, so that a GPU, driver or triton version the kernel was
    never tried on falls back to the PyTorch path (with a warning) instead of failing or answering wrongly."""
    from .triton_attention import noisy_gali_attention

    generator = torch.Generator().manual_seed(0)
    shapes = ((1, 2 * heads_per_kv, 70, head_dim), (1, 2, 200, head_dim), (1, 2, 200, head_dim))
    query, key, value = (torch.randn(shape, generator=generator).to(device, dtype) for shape in shapes)
    noise = Noise(seed=1, layer=0, scale=1.0)
    try:
        fused = noisy_gali_attention(query, key, value, 3, 96, 0.125, noise).float()
    except Exception as error:  # compilation or launch failures of every kind
        warnings.warn(f"the fused GALI kernel does not run here ({type(error).__name__}: {error}); noisy attention "
                      f"uses the slower PyTorch path", GaliWarning, stacklevel=2)
        return False
    reference = tiled_noisy_attention(query, key, value, 3, 96, 0.125, noise).float()
    error = (fused - reference).abs().max().item()
    tolerance = (1e-4 if dtype == torch.float32 else 2e-2) * max(1.0, reference.abs().max().item())
    if not error <= tolerance:  # also catches NaN
        warnings.warn(f"the fused GALI kernel disagrees with the PyTorch path on this device (max error {error:.2g}); "
                      f"noisy attention uses the PyTorch path", GaliWarning, stacklevel=2)
        return False
    return True
