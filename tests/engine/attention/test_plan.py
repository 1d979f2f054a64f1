"""The attention plan (attention/plan.py): each input combination gives its routes, and the plan is decided once per
forward and followed. (`gali info` prints its words from the plan itself: tests/cli/test_cli.py.)"""

import pytest
import torch
from helpers.attention import qkv
from helpers.tiny_models import prompt

from gali_cli import GaliConfig, apply_gali
from gali_cli.engine.attention import choice, dense, plan
from gali_cli.engine.attention.choice import plan_for
from gali_cli.engine.attention.plan import AttentionPlan, decide
from gali_cli.errors import ConfigError, GaliWarning

# (device, dtype, forward only) -> (causal, partial)
ROUTES = [
    ("cuda", "bfloat16", True, "lower-right", "cuda"),
    ("cuda", "float32", False, "lower-right", "explicit"),
    ("cpu", "float32", True, "split", "flash"),
    ("cpu", "bfloat16", True, "masked", "flash"),
    ("cpu", "float32", False, "masked", "explicit"),
    ("mps", "float16", True, "masked", "explicit"),
]


@pytest.mark.parametrize("device, dtype, forward_only, causal, partial", ROUTES)
def test_routes_follow_device_dtype_and_autograd(device, dtype, forward_only, causal, partial):
    got = decide(device, dtype, forward_only, noise=False)
    assert (got.causal, got.partial, got.noisy, got.noisy_partial) == (causal, partial, None, None)
    assert got.split == (causal == "split")


def test_a_gpu_takes_explicit_parts_where_its_kernel_fails_the_first_use_check():
    # The check runs the CUDA kernel; on the CPU torch has none, which is the failure the check must survive.
    dense.cuda_partial_verified.cache_clear()
    with pytest.warns(GaliWarning, match="memory-efficient CUDA attention does not run here"):
        assert not dense.cuda_partial_verified(torch.device("cpu"), torch.float32)
    dense.cuda_partial_verified.cache_clear()


def test_explicit_tiles_are_wider_on_a_gpu():
    # 32 heads over 8k keys: a few rows a tile on the CPU (cache-sized), hundreds on a GPU (few launches).
    assert dense.logits_tile_rows(torch.device("cpu"), 1, 32, 8192) == 4
    assert dense.logits_tile_rows(torch.device("cuda"), 1, 32, 8192) == 128


def test_gpu_parts_in_half_precision_run_in_the_models_dtype():
    # Rotations in float32, rounded once for the tensor cores; float32 models and the CPU keep float32 parts.
    # The plan is decided from the queries, which a method may have rotated in float32; the values say the model's.
    cuda = decide("cuda", "float32", True, noise=False)
    half = dense.partial_attention(cuda, torch.bfloat16)
    assert half.func is dense.cuda_partial and half.keywords == {"compute_dtype": torch.bfloat16}
    assert dense.partial_attention(cuda, torch.float32) is dense.cuda_partial
    assert dense.partial_attention(decide("cpu", "float32", True, noise=False), torch.bfloat16) is dense.flash_partial
    assert dense.partial_attention(decide("cuda", "float32", False, noise=False), torch.bfloat16) is \
        dense.explicit_partial


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_parts_from_float32_rotations_in_bfloat16():
    query, key, value = qkv(1, 32, 8, 100, 3000, dim=128, device="cuda")
    got = dense.cuda_partial(query, key, value, 0.09, compute_dtype=torch.bfloat16)
    expected = dense.explicit_partial(query, key, value, 0.09)
    assert got.output.dtype == torch.float32
    assert (got.output - expected.output).abs().max().item() <= 2e-2
    assert (got.lse - expected.lse).abs().max().item() <= 2e-2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, queries, keys, causal", [
    (4, 2, 37, 101, False), (4, 4, 1, 300, False), (9, 3, 64, 64, True), (32, 8, 200, 4000, False)])
def test_the_gpu_parts_equal_explicit_logits(dtype, heads, kv_heads, queries, keys, causal):
    query, key, value = qkv(2, heads, kv_heads, queries, keys, dtype=dtype, dim=64, device="cuda")
    got = dense.cuda_partial(query, key, value, 0.125, causal=causal)
    expected = dense.explicit_partial(query, key, value, 0.125, causal=causal)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    assert (got.output.float() - expected.output.float()).abs().max().item() <= tolerance
    assert (got.lse - expected.lse).abs().max().item() <= tolerance
    assert plan_for(query, key, value).partial == "cuda"


def test_the_cpu_without_its_flash_kernel_takes_the_mask():
    got = decide("cpu", "float32", True, noise=False, cpu_flash=False)
    assert (got.causal, got.partial, got.split) == ("masked", "explicit", False)


# (GALI_KERNEL, device, forward only, triton installed, interpreted) -> (noisy, noisy partial, checked, error?)
NOISY = [
    ("auto", "cpu", True, True, False, "native", "native", True, False),
    ("auto", "cpu", False, True, False, "torch", "explicit", False, False),
    ("auto", "cuda", True, True, False, "triton", "explicit", True, False),
    ("auto", "cuda", True, False, False, "torch", "explicit", False, False),
    ("auto", "mps", True, True, False, "torch", "explicit", False, False),
    ("native", "cpu", True, True, False, "native", "native", False, False),
    ("native", "cuda", True, True, False, "torch", "explicit", False, True),
    ("native", "cuda", False, True, False, "torch", "explicit", False, False),  # autograd: no kernel, no error
    ("torch", "cpu", True, True, False, "torch", "explicit", False, False),
    ("torch", "cuda", True, True, False, "torch", "explicit", False, False),
    ("triton", "cuda", True, True, False, "triton", "explicit", False, False),
    ("triton", "cpu", True, True, True, "triton", "explicit", False, False),
    ("triton", "cpu", True, True, False, "torch", "explicit", False, True),
    ("triton", "cuda", True, False, False, "torch", "explicit", False, True),
]


@pytest.mark.parametrize("choice, device, forward_only, installed, interpreted, noisy, noisy_partial, checked, error",
                         NOISY)
def test_noisy_routes_follow_gali_kernel(monkeypatch, choice, device, forward_only, installed, interpreted, noisy,
                                         noisy_partial, checked, error):
    monkeypatch.setenv("GALI_KERNEL", choice)
    monkeypatch.setattr(plan, "_triton_installed", lambda: installed)
    got = decide(device, "float32", forward_only, noise=True, interpreted=interpreted)
    assert (got.noisy, got.noisy_partial, got.checked, got.error is not None) == (noisy, noisy_partial, checked, error)
    assert got.split == (got.causal == "split" and noisy_partial == "native")
    words = got.noisy_words()
    assert words.startswith({"native": "native CPU kernel (built with", "triton": "fused Triton kernel (triton ",
                             "torch": "error: " if error else "PyTorch ("}[noisy])


def test_a_forced_kernel_that_cannot_run_fails_where_noise_runs(monkeypatch):
    monkeypatch.setenv("GALI_KERNEL", "native")
    query = torch.empty(1, 2, 1, 8, device="meta")
    assert plan_for(query, query, query).error is None  # no noise: nothing to refuse
    with pytest.raises(ConfigError, match="GALI_KERNEL=native runs on the CPU; the model is on meta"):
        plan_for(query, query, query, noise=True)


def test_the_one_test_of_autograd_or_dropout():
    query, key, value = qkv(1, 2, 1, 4, 8)
    assert plan_for(query, key, value).forward_only
    assert not plan_for(query, key, value, dropout=0.1).forward_only
    with torch.enable_grad():
        assert plan_for(query, key, value).forward_only  # nothing to record
        assert not plan_for(query, key.requires_grad_(), value).forward_only
    assert plan_for(query, key, value).forward_only  # outside autograd, a leaf records nothing


def test_a_failed_first_use_check_takes_the_pytorch_path(monkeypatch):
    from gali_cli.engine.attention import noisy_attention

    monkeypatch.delenv("GALI_KERNEL", raising=False)
    monkeypatch.setattr(noisy_attention, "native_verified", lambda: False)
    got = plan_for(*qkv(1, 2, 1, 4, 8), noise=True)
    assert (got.noisy, got.noisy_partial, got.split) == ("torch", "explicit", False)
    assert got.noisy_words() == "PyTorch (the native kernel failed its first-use check)"


def test_a_forward_decides_once_and_every_layer_follows(make_llama, monkeypatch):
    plans = []
    decide_plan = choice.plan_for

    def recorded(*arguments, **keywords) -> AttentionPlan:
        plans.append(decide_plan(*arguments, **keywords))
        return plans[-1]

    monkeypatch.setattr("gali_cli.engine.contract.plan_for", recorded)
    model = apply_gali(make_llama(train_len=16, layers=3), GaliConfig(chunk_size=4, local_window=2, noise=True))
    with torch.inference_mode():
        model(prompt(60))
    assert len(plans) == 1 and plans[0].noise and plans[0].forward_only
    assert plans[0].device == "cpu" and plans[0].dtype == "float32"


def test_describe_says_every_route():
    words = decide("cpu", "float32", True, noise=False).describe()
    assert words == ("cpu, float32, forward only; causal chunks: " + plan.CAUSAL_WORDS["split"] + "; parts: "
                     + plan.PARTIAL_WORDS["flash"] + "; GALI's chunks split (keys before each chunk, then the chunks' "
                     "own squares in one call); no noise")
    noisy = decide("cuda", "bfloat16", False, noise=True)
    assert noisy.describe().endswith("noisy chunks: PyTorch (autograd or dropout: the kernels are forward only); "
                                     "noisy parts: explicit float32 logits")


@pytest.mark.parametrize("device, dtype, forward_only, noise, expected", [
    ("cpu", "float32", True, False, "torch's CPU flash kernel, GALI's chunks split; no noise"),
    ("cuda", "bfloat16", True, False, "torch's memory-efficient CUDA kernel; no noise"),
    ("cuda", "bfloat16", False, True, "explicit float32 logits; noise by PyTorch (explicit logits)"),
])
def test_the_summary_is_a_few_plain_words(device, dtype, forward_only, noise, expected):
    """gali info's attention line: under 100 characters; describe() (gali info -v) keeps every route."""
    summary = decide(device, dtype, forward_only, noise=noise).summary()
    assert summary == expected and len(summary) < 100
