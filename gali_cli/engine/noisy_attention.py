"""GALI's logit noise (paper Alg. 3) and the three paths of noisy attention: explicit float32 logits a tile of queries
at a time (PyTorch, the reference), the fused Triton kernel (CUDA), or the native CPU kernel (native_noise.py);
which one runs ($GALI_KERNEL, first-use checks; in words for `gali info`: kernel_choice.py).

Shapes: B batch, H query heads, Hkv key/value heads, q queries (the last q of the T keys), D head dim.
"""

import functools
import os
import warnings
from collections.abc import Callable

import torch

from ..errors import ConfigError, GaliWarning
from .dense import (
    Partial,
    flash_partial,
    grouped_logits,
    mask_future,
    merge_partials,
    needs_grad,
    tiled_attention,
)
from .kernel_choice import kernel_choice
from .kernel_choice import triton_installed as _triton_installed  # a name of this module: tests replace it
from .noise import Noise, standard_normal

# (query, key, value, group, grouped, scale, noise, dropout) -> (B, H, q, D)
NoisyAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, int, float, Noise, float], torch.Tensor]
# (query, key, value, scale, noise, first_query, group, grouped, total_keys) -> Partial over keys all queries see
NoisyPartial = Callable[..., Partial]


def add_noise(
    logits: torch.Tensor, query_index: torch.Tensor, group: int, grouped: int, noise: Noise,
    total_keys: int | None = None,
) -> None:
    """Add N(0, sigma^2) in place to scaled logits (B, H, n, >= grouped) of keys 0.. wherever c != 0 (before the mask).

    sigma = (i - j) / T * scale, i the query's and j the key's token index, T the number of keys of the chunk
    (`total_keys`, by default the logits' width; paper Alg. 3). c != 0 exactly for the grouped keys j < grouped
    whose position j / group is not an integer.
    """
    batch, heads = logits.shape[:2]
    total_keys = total_keys or logits.shape[-1]
    key_index = torch.arange(grouped, device=logits.device)
    sigma = (query_index.unsqueeze(-1) - key_index).float() * (noise.scale / total_keys)  # (n, grouped)
    sigma = sigma * (key_index % group != 0)
    logits[..., :grouped] += standard_normal(noise, batch, heads, query_index, grouped) * sigma


def noisy_route(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout: float = 0.0) -> NoisyAttention:
    """Which path noisy attention takes for tensors like these: decided once per forward, at its first noisy chunk.

    The fused Triton kernel where it applies (see `fused_kernel_applies`), else the native CPU kernel where it
    applies (`native_kernel_applies`), else the PyTorch path. Both fast paths are forward only: under autograd or dropout
    the PyTorch path runs (and a fast route still steps aside for a layer that needs gradients). All give the same
    noise.
    """
    if dropout != 0.0 or needs_grad(query, key, value):
        return tiled_noisy_attention
    if not fused_kernel_applies(query, key):
        return native_noisy_attention if native_kernel_applies(query) else tiled_noisy_attention
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


def noisy_partial_route(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> NoisyPartial:
    """How a noisy part over keys every query sees (`NoisyPartial`) is computed, for decoding and for the CPU's split
    chunks: the native CPU kernel where it applies, else explicit logits (the fused Triton kernel has no log-sum-exp
    output). Decided once per forward."""
    if not needs_grad(query, key, value) and native_kernel_applies(query):
        from .native_noise import noisy_partial

        return noisy_partial
    return explicit_noisy_partial


def explicit_noisy_partial(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    noise: Noise,
    first_query: int,
    group: int,
    grouped: int,
    total_keys: int,
) -> Partial:
    """Noisy attention of queries (B, H, q, D) over keys [0, n) they all see, from explicit logits (the reference of
    native_noise.noisy_partial, which documents the arguments)."""
    logits = grouped_logits(query, key, scale)  # (B, H, q, n)
    query_index = torch.arange(first_query, first_query + query.shape[2], device=query.device)
    add_noise(logits, query_index, group, min(grouped, logits.shape[-1]), noise, total_keys)
    lse = torch.logsumexp(logits, dim=-1)
    probs = torch.exp(logits - lse.unsqueeze(-1)).view(query.shape[0], key.shape[1], -1, key.shape[2])
    output = torch.matmul(probs, value.float()).view(query.shape).to(value.dtype)
    return Partial(output, lse)


def native_noisy_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    group: int,
    grouped: int,
    scale: float,
    noise: Noise,
    dropout: float = 0.0,
) -> torch.Tensor:
    """The CPU path of `noisy_attention`: the keys before the chunk (which every query sees; the grouped ones get
    noise) through the native kernel (native_noise.py), the chunk's own causal square through torch's flash kernel,
    merged by their log-sum-exps. No (q x T) mask, and the noise in one sweep over the logits."""
    kv_len, q_len = key.shape[2], query.shape[2]
    past = kv_len - q_len
    if dropout != 0.0 or needs_grad(query, key, value) or grouped > past:
        # (The last alternative: a chunk longer than the exact tail, whose own keys get noise; unusual settings.)
        return tiled_noisy_attention(query, key, value, group, grouped, scale, noise, dropout)
    from .native_noise import noisy_partial

    noisy = noisy_partial(query, key[:, :, :past], value[:, :, :past], scale, noise, past, group, grouped, kv_len)
    rest = flash_partial(query, key[:, :, past:], value[:, :, past:], scale, causal=True)
    return merge_partials([noisy, rest]).output


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
    if choice in ("torch", "native") or (choice == "auto" and query.device.type != "cuda"):
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


def native_kernel_applies(query: torch.Tensor) -> bool:
    """Whether noisy attention on these queries runs the native CPU kernel, as $GALI_KERNEL says.

    auto (default): on the CPU, once it was built and agreed with the PyTorch path (`native_verified`). native: on
    the CPU, always (errors if it cannot be built). triton, torch: never.
    """
    choice = kernel_choice()
    if choice == "native" and query.device.type != "cpu":
        raise ConfigError(f"GALI_KERNEL=native runs on the CPU; the model is on {query.device.type}")
    if choice not in ("auto", "native") or query.device.type != "cpu":
        return False
    return choice == "native" or native_verified()


@functools.cache
def native_verified() -> bool:
    """Build the native noise kernel (once per machine) and hold it to the PyTorch path on small problems (once per
    process), so that a machine whose C compiler is missing or fails takes the PyTorch path, with one warning."""
    from .native_noise import noisy_partial

    try:
        error = max(_native_error(noisy_partial, heads, kv_heads, queries, keys)
                    for heads, kv_heads, queries, keys in ((4, 2, 6, 75), (3, 3, 1, 40), (9, 3, 33, 300)))
    except Exception as failure:  # noqa: BLE001 - no compiler, a compiler error, a library that does not load
        message = " ".join(str(failure).split())[:200]
        warnings.warn(f"the native noise kernel cannot be built here ({type(failure).__name__}: {message}); GALI's "
                      f"noise takes the slower PyTorch path", GaliWarning, stacklevel=2)
        return False
    if not error <= 1e-4:  # also catches NaN
        warnings.warn(f"the native noise kernel disagrees with the PyTorch path here (max error {error:.2g}); GALI's "
                      f"noise takes the slower PyTorch path", GaliWarning, stacklevel=2)
        return False
    return True


def _native_error(native: NoisyPartial, heads: int, kv_heads: int, queries: int, keys: int) -> float:
    """The largest difference between the native and the PyTorch noisy partial on random data of these sizes."""
    generator = torch.Generator().manual_seed(keys)
    query, key, value = (torch.randn(shape, generator=generator) for shape in (
        (2, heads, queries, 32), (2, kv_heads, keys, 32), (2, kv_heads, keys, 32)))
    total = keys + queries
    arguments = (query, key, value, 0.2, Noise(seed=1, layer=0, scale=3.0), keys, 3, keys - 1, total)
    with torch.inference_mode():
        got, expected = native(*arguments), explicit_noisy_partial(*arguments)
    return max((got.output - expected.output).abs().max().item(), (got.lse - expected.lse).abs().max().item())


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
