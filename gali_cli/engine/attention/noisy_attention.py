"""GALI's logit noise (paper Alg. 3) and the three paths of noisy attention: explicit float32 logits a tile of queries
at a time (PyTorch, the reference), the fused Triton kernel (CUDA), or the native CPU kernel (native_noise.py); and
the fast kernels' first-use checks. Which path runs is the forward's plan (plan.py).

Shapes: B batch, H query heads, Hkv key/value heads, q queries (the last q of the T keys), D head dim.
"""

import functools
import warnings
from collections.abc import Callable

import torch

from ...errors import GaliWarning
from ..math.noise import Noise, standard_normal
from .dense import Partial, flash_partial, grouped_logits, mask_future, merge_partials, tiled_attention
from .plan import AttentionPlan

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


def fused_noisy_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    group: int,
    grouped: int,
    scale: float,
    noise: Noise,
    dropout: float = 0.0,
) -> torch.Tensor:
    """The CUDA path of `noisy_attention`: the fused Triton kernel (forward only: the plan takes it only then)."""
    from ..kernels.triton_attention import noisy_gali_attention

    return noisy_gali_attention(query, key, value, group, grouped, scale, noise)


def noisy_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    group: int,
    grouped: int,
    scale: float,
    noise: Noise,
    dropout: float,
    plan: AttentionPlan,
) -> torch.Tensor:
    """Causal GALI attention with logit noise of rotated queries (B, H, q, D), the last q of the mixed keys
    (B, Hkv, T, D), by the path the forward's `plan` names (`choice.plan_for`, with noise)."""
    return NOISY[plan.noisy](query, key, value, group, grouped, scale, noise, dropout)


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
    merged by their log-sum-exps. No (q x T) mask, and the noise in one sweep over the logits. Forward only: the
    plan takes it only then."""
    kv_len, q_len = key.shape[2], query.shape[2]
    past = kv_len - q_len
    if grouped > past:  # a chunk longer than the exact tail, whose own keys get noise (unusual settings)
        return tiled_noisy_attention(query, key, value, group, grouped, scale, noise, dropout)
    from ..kernels.native_noise import noisy_partial

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


@functools.cache
def native_verified() -> bool:
    """Build the native noise kernel (once per machine) and hold it to the PyTorch path on small problems (once per
    process), so that a machine whose C compiler is missing or fails takes the PyTorch path, with one warning."""
    from ..kernels.native_noise import noisy_partial

    try:
        error = max(_native_error(noisy_partial, heads, kv_heads, queries, keys)
                    for heads, kv_heads, queries, keys in ((4, 2, 6, 75), (3, 3, 1, 40), (9, 3, 33, 300)))
    except Exception as failure:  # no compiler, a compiler error, a library that does not load
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
    from ..kernels.triton_attention import noisy_gali_attention

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


def native_noisy_partial(*arguments) -> Partial:
    """native_noise.noisy_partial, imported when first used (`NoisyPartial`'s arguments)."""
    from ..kernels.native_noise import noisy_partial

    return noisy_partial(*arguments)


# The plan's routes (plan.AttentionPlan.noisy, .noisy_partial).
NOISY: dict[str, NoisyAttention] = {"triton": fused_noisy_attention, "native": native_noisy_attention,
                                    "torch": tiled_noisy_attention}
NOISY_PARTIAL: dict[str, NoisyPartial] = {"native": native_noisy_partial, "explicit": explicit_noisy_partial}
