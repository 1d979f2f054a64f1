"""The fused Triton kernel against the PyTorch path, on the CPU through Triton's interpreter (TRITON_INTERPRET=1).

The interpreter runs the kernel's own code with NumPy; its tl.dot mishandles bfloat16, so bfloat16 is left to the
GPU (where noisy_attention.kernel_verified checks it on first use) and these tests use float32 and float16.
"""

import importlib
import json
import os
import subprocess
import sys

import pytest
import torch
from helpers.attention import qkv

import gali_cli.engine.attention.plan as plan_module
from gali_cli import GaliConfig, apply_gali
from gali_cli.engine.attention.choice import plan_for
from gali_cli.engine.attention.noisy_attention import kernel_verified, noisy_attention, tiled_noisy_attention
from gali_cli.engine.math.noise import Noise
from gali_cli.errors import ConfigError, GaliWarning


def fused_kernel_applies(query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether the plan sends noisy attention over these tensors through the fused kernel."""
    return plan_for(query, key, key, noise=True).noisy == "triton"


@pytest.fixture(scope="module")
def kernel():
    """gali_cli.engine.kernels.triton_attention, on the CPU under the interpreter (conftest sets TRITON_INTERPRET=1
    before torch loads triton) or, with TRITON_INTERPRET=0, compiled for the GPU."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("TRITON_INTERPRET=0 needs a CUDA device")
    yield importlib.import_module("gali_cli.engine.kernels.triton_attention")
    kernel_verified.cache_clear()


@pytest.fixture
def device():
    return "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"


CASES = [  # batch, heads, kv_heads, queries, keys, group, grouped, block_m, block_n
    (2, 4, 2, 37, 101, 3, 50, 16, 16),  # GQA, partial tiles everywhere, grouped ends inside a tile
    (1, 4, 4, 64, 64, 2, 20, 32, 16),  # MHA, one square chunk
    (1, 4, 1, 1, 300, 5, 233, 16, 32),  # MQA, a single query (decode-sized)
    (1, 2, 2, 5, 300, 4, 300, 16, 32),  # every key grouped
    (1, 2, 1, 20, 90, 1, 0, 16, 16),  # nothing grouped: no noise at all
    (1, 2, 1, 50, 120, 3, 61, 16, 32),  # key tiles wider than query tiles, several of each
]


@pytest.mark.parametrize("batch, heads, kv_heads, queries, keys, group, grouped, block_m, block_n", CASES)
def test_kernel_matches_the_pytorch_path_noise_included(kernel, device, batch, heads, kv_heads, queries, keys, group,
                                                         grouped, block_m, block_n):
    query, key, value = qkv(batch, heads, kv_heads, queries, keys, device=device)
    noise = Noise(seed=7, layer=3, scale=2.0)
    fused = kernel.noisy_gali_attention(query, key, value, group, grouped, 0.3, noise, block_m, block_n)
    reference = tiled_noisy_attention(query, key, value, group, grouped, 0.3, noise)
    torch.testing.assert_close(fused, reference, rtol=1e-5, atol=1e-5)
    if grouped > group:  # the noise is there, and it is this seed's noise
        other_seed = tiled_noisy_attention(query, key, value, group, grouped, 0.3, Noise(8, 3, 2.0))
        assert (fused - other_seed).abs().max() > 1e-2


def test_kernel_in_float16_and_on_strided_views(kernel, device):
    """float16 inputs, and the views attention passes: keys a prefix of a longer buffer, queries transposed."""
    query, key, value = qkv(1, 4, 2, 24, 130, dtype=torch.float16, seed=3, device=device)
    buffer = torch.cat((key, torch.full_like(key, float("nan"))), dim=2)  # rows past T must never be read
    query_view = query.transpose(1, 2).contiguous().transpose(1, 2)
    noise = Noise(seed=1, layer=0, scale=1.0)
    fused = kernel.noisy_gali_attention(query_view, buffer[:, :, :130], value, 3, 70, 0.25, noise, 16, 32)
    reference = tiled_noisy_attention(query.float(), key.float(), value.float(), 3, 70, 0.25, noise)
    assert fused.dtype == torch.float16
    torch.testing.assert_close(fused.float(), reference, rtol=2e-3, atol=2e-3)


def test_patched_model_gives_the_same_logits_with_the_kernel(kernel, device, make_llama, monkeypatch):
    """End to end: GALI_KERNEL=triton routes every noisy chunk of a patched model through the kernel."""
    model = apply_gali(make_llama(hidden=64, heads=4, kv_heads=2).to(device),
                       GaliConfig(chunk_size=8, local_window=3, noise=True, seed=4))
    ids = torch.randint(0, 64, (2, 70), generator=torch.Generator().manual_seed(0)).to(device)
    monkeypatch.setenv("GALI_KERNEL", "torch")
    reference = model(ids).logits
    monkeypatch.setenv("GALI_KERNEL", "triton")
    fused = model(ids).logits
    torch.testing.assert_close(fused, reference, rtol=1e-4, atol=1e-4)


def test_first_use_check_accepts_a_good_kernel_and_refuses_a_broken_one(kernel, device, monkeypatch):
    kernel_verified.cache_clear()
    assert kernel_verified(torch.device(device), torch.float32, 32, 2)

    kernel_verified.cache_clear()
    monkeypatch.setattr(kernel, "noisy_gali_attention", lambda query, *args: torch.zeros_like(query))
    with pytest.warns(GaliWarning, match="disagrees"):
        assert not kernel_verified(torch.device(device), torch.float32, 32, 2)

    kernel_verified.cache_clear()

    def fails(*args):
        raise RuntimeError("no kernel image is available")

    monkeypatch.setattr(kernel, "noisy_gali_attention", fails)
    with pytest.warns(GaliWarning, match="does not run here"):
        assert not kernel_verified(torch.device(device), torch.float32, 32, 2)
    kernel_verified.cache_clear()


def test_under_autograd_noisy_attention_takes_the_differentiable_path(kernel, device, monkeypatch):
    """The kernel has no backward: with gradients wanted, the PyTorch path runs, and gradients flow."""
    monkeypatch.setenv("GALI_KERNEL", "triton")
    query, key, value = (x.requires_grad_() for x in qkv(1, 4, 2, 20, 60, device=device))
    noise = Noise(seed=2, layer=1, scale=1.0)
    with torch.enable_grad():
        noisy_attention(query, key, value, 3, 30, 0.3, noise, 0.0,
                        plan_for(query, key, value, noise=True)).square().sum().backward()
    fused_grad = query.grad.clone()
    query.grad = None
    monkeypatch.setenv("GALI_KERNEL", "torch")
    with torch.enable_grad():
        noisy_attention(query, key, value, 3, 30, 0.3, noise, 0.0,
                        plan_for(query, key, value, noise=True)).square().sum().backward()
    torch.testing.assert_close(fused_grad, query.grad)
    assert query.grad.abs().sum() > 0


def test_kernel_choice_follows_gali_kernel(monkeypatch):
    query, key, _ = qkv(1, 2, 1, 4, 8)
    monkeypatch.delenv("GALI_KERNEL", raising=False)
    assert not fused_kernel_applies(query, key)  # auto: only on CUDA
    monkeypatch.setenv("GALI_KERNEL", "torch")
    assert not fused_kernel_applies(query, key)
    monkeypatch.setenv("GALI_KERNEL", "fast")
    with pytest.raises(ConfigError, match="GALI_KERNEL must be one of auto, triton, native, torch"):
        fused_kernel_applies(query, key)


def test_forced_kernel_refuses_what_it_cannot_run(kernel, device, monkeypatch):
    monkeypatch.setenv("GALI_KERNEL", "triton")
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # compiled, CPU tensors: the kernel needs CUDA
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        fused_kernel_applies(*qkv(1, 2, 1, 4, 8)[:2])
    monkeypatch.setenv("TRITON_INTERPRET", "1" if interpreted else "0")
    query, key, _ = qkv(1, 2, 1, 4, 8, dim=24, device=device)
    with pytest.raises(ConfigError, match="power-of-two head dim"):
        fused_kernel_applies(query, key)
    query, key, _ = qkv(1, 2, 1, 4, 8, device=device)
    assert fused_kernel_applies(query, key)


def test_forced_kernel_without_triton_is_a_clear_error(device, monkeypatch):
    monkeypatch.setenv("GALI_KERNEL", "triton")
    monkeypatch.setattr(plan_module, "_triton_installed", lambda: False)
    query, key, _ = qkv(1, 2, 1, 4, 8, device=device)
    with pytest.raises(ConfigError, match="triton is not installed"):
        fused_kernel_applies(query, key)


# (compute capability, dtype, head dim) -> shared memory a block may use on that GPU generation (opt-in maximum).
GPU_TARGETS = [((7, 5), "float16", 128, 65536), ((8, 6), "bfloat16", 128, 101376), ((9, 0), "bfloat16", 128, 232448),
               ((9, 0), "float32", 64, 232448), ((8, 6), "float32", 256, 101376)]
COMPILE = """
import inspect, json, sys, torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from gali_cli.engine.kernels.triton_attention import _noisy_gali_forward, tiles
short = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}
names = list(inspect.signature(_noisy_gali_forward.fn).parameters)
results = []
for capability, dtype, dim, _ in json.loads(sys.argv[1]):
    block_m, block_n, warps = tiles(dim, getattr(torch, dtype), tuple(capability))
    # As a launch on contiguous tensors specialises it: unit strides become constants, pointers and the other
    # strides are known multiples of 16 (which lets loads be vectorised and pipelined, using more shared memory).
    constants = {"HEAD_DIM": dim, "BLOCK_M": block_m, "BLOCK_N": block_n,
                 "PRECISION": "ieee" if dtype == "float32" else "tf32",
                 "stride_qd": 1, "stride_kd": 1, "stride_vd": 1, "stride_od": 1}
    pointers = {"query": "*" + short[dtype], "key": "*" + short[dtype], "value": "*" + short[dtype],
                "out": "*" + short[dtype], "streams": "*i64"}
    signature = {name: pointers.get(name) or ("constexpr" if name in constants else
                                              "fp32" if name in ("scale", "sigma_per_index") else "i32")
                 for name in names}
    aligned = [name for name in names if name in pointers or (name.startswith("stride") and name not in constants)]
    attributes = {(names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    target = GPUTarget("cuda", capability[0] * 10 + capability[1], 32)
    kernel = triton.compile(ASTSource(_noisy_gali_forward, signature, constants, attributes), target=target,
                            options={"num_warps": warps, "num_stages": 2})
    results.append(kernel.metadata.shared)
print(json.dumps(results))
"""


@pytest.mark.slow
def test_kernel_compiles_for_each_gpu_generation_within_its_shared_memory(tmp_path):
    """Compiled ahead of time, no GPU needed: catches what the interpreter cannot (types, layouts, tile sizes)."""
    pytest.importorskip("triton")
    environment = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", COMPILE, json.dumps(GPU_TARGETS)], capture_output=True,
                            text=True, env=environment)
    assert result.returncode == 0, result.stderr[-2000:]
    shared = json.loads(result.stdout.strip().splitlines()[-1])
    for (capability, dtype, dim, limit), used in zip(GPU_TARGETS, shared, strict=True):
        assert 0 < used <= limit, f"sm_{capability[0]}{capability[1]} {dtype} head dim {dim}: {used} > {limit} bytes"
