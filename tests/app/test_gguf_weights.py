"""A GGUF's weights read in their blocks: every quant type read as the gguf package dequantizes it, bit for bit, and a
model loaded that way computing what transformers' own GGUF reader (which dequantizes to float32) computes, on every
family, with no float copy of a weight matrix anywhere."""

import numpy as np
import pytest
import torch
from helpers.gguf_files import quantized_tensor, write_gguf
from helpers.paths import ROOT
from helpers.tiny_models import save_tiny_llama

from gali_cli import gguf_weights
from gali_cli.engine.seam import packed_modules
from gali_cli.engine.seam.packed_modules import PackedEmbedding, PackedLinear, model_device, model_dtype
from gali_cli.engine.seam.projections import grid_projections
from gali_cli.errors import ModelLoadError
from gali_cli.gguf_weights import _grid_tensor, _unpermuted_rows, dense
from gali_cli.loading import load_model
from gali_cli.model import gguf_blocks

gguf = pytest.importorskip("gguf")
GRID_NAMES = [name for name, *_ in gguf_blocks.GRID_TYPES.values()]
TOLERANCE = 1e-5  # relative, on the logits: the same float32 weights, products tiled differently


@pytest.mark.parametrize("quant", [*GRID_NAMES, "F16", "BF16", "F32"])
def test_every_type_reads_as_the_gguf_package_dequantizes_it(quant):
    rng = np.random.default_rng(3)
    array = rng.normal(0, 0.05, size=(6, 512)).astype(np.float32)
    if quant == "F32":
        data, kind = array.view(np.uint8), gguf.GGMLQuantizationType.F32
    else:
        data, kind = quantized_tensor(array, quant, seed=5)
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(6, -1)
    expected = gguf.quants.dequantize(raw, kind).astype(np.float32) if quant != "F32" else array
    if int(kind) in gguf_blocks.GRID_TYPES:
        grid = gguf_blocks.read_grid(raw, int(kind), 512)
        read = (np.repeat(grid.base, grid.block, 1) + np.repeat(grid.step, grid.block, 1) *
                grid.codes.astype(np.float32))
        assert grid.block == gguf_blocks.GRID_TYPES[int(kind)][3]
        read_in_chunks = gguf_blocks.read_grid(lambda start, stop: raw[start:stop], int(kind), 512, rows=6)
        assert np.array_equal(read_in_chunks.codes, grid.codes)
    else:
        read = torch.from_numpy(gguf_blocks.read_float(raw, int(kind), 512))
        read = (read.view(torch.bfloat16) if quant == "BF16" else read).float().numpy()
    assert np.array_equal(read, expected)  # bit for bit


@pytest.mark.parametrize("quant", GRID_NAMES)
def test_every_unpacking_gives_the_gguf_packages_bits(quant, monkeypatch):
    """The loader's dequantizing, the embedding's lookups and the tiles (native, and PyTorch's where the kernels
    do not load) all compute base + step * code as the gguf package dequantizes: the same bits."""
    array = np.random.default_rng(4).normal(0, 0.05, size=(40, 512)).astype(np.float32)
    data, kind = quantized_tensor(array, quant, seed=6)
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(40, -1)
    expected = torch.from_numpy(gguf.quants.dequantize(raw, kind).astype(np.float32))
    arrays = gguf_blocks.read_grid(raw, int(kind), 512)
    grid = _grid_tensor(arrays)
    ids = torch.tensor([[3, 0, 39, 3, 17]])
    assert torch.equal(dense(arrays), expected)
    assert torch.equal(PackedEmbedding(grid)(ids)[0], expected[ids[0]])
    assert torch.equal(packed_modules.unpack_into(grid, 5, 31), expected[5:31])
    monkeypatch.setattr(packed_modules, "native_kernel", lambda: None)
    assert torch.equal(packed_modules.unpack_into(grid, 5, 31), expected[5:31])


def test_a_llamas_q_and_k_rows_are_put_back_as_transformers_does():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    rows = np.arange(48 * 3).reshape(48, 3)
    for heads in (4, 2):
        undone = LlamaTensorProcessor()._reverse_permute_weights(rows, heads)
        assert np.array_equal(rows[_unpermuted_rows(48, heads)], undone)


def transformers_model(path):
    """The model as transformers' own GGUF reader makes it: every weight dequantized to float32."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def assert_same_logits(path, ids):
    """gali's load of the GGUF at `path` is packed (no float matrix) and computes transformers' logits."""
    loaded = load_model(str(path), device="cpu")
    model = loaded.model
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear | PackedLinear)]
    assert linears and all(isinstance(m, PackedLinear) for m in linears)
    assert isinstance(model.get_input_embeddings(), PackedEmbedding)
    assert all(p.dim() == 1 for p in model.parameters())  # norms and biases: no float matrix anywhere
    assert (model_device(model), model_dtype(model)) == (torch.device("cpu"), torch.float32)
    with torch.inference_mode():
        ours, theirs = model(ids).logits, transformers_model(path)(ids).logits
        decoded = model(ids[:, :1]).logits  # a few rows: the grid product itself
    scale = theirs.abs().max()
    assert (ours - theirs).abs().max() <= TOLERANCE * scale
    assert (decoded - theirs[:, :1]).abs().max() <= TOLERANCE * scale
    return model


@pytest.mark.parametrize("quant", [*GRID_NAMES, "F16", "BF16"])
def test_a_llama_gguf_of_every_type_computes_as_transformers_reads_it(quant, tmp_path):
    directory = save_tiny_llama(tmp_path / "model", hidden=256)
    path = write_gguf(tmp_path / f"tiny.{quant}.gguf", directory, quant=quant, embedding=quant)
    model = assert_same_logits(path, torch.randint(0, 300, (1, 24), generator=torch.Generator().manual_seed(1)))
    expected_share = 0.0 if quant in ("F16", "BF16") else 1.0
    assert grid_projections(model).grid_share() == expected_share


@pytest.mark.parametrize(("family", "quant", "sizes"), [
    ("mistral", "Q4_K", {}),
    ("qwen2", "Q5_0", {}),  # q, k and v biases
    ("qwen3", "Q6_K", {"head_dim": 128}),  # q and k norms; transformers reads a Qwen3 GGUF's heads as 128 wide
    ("gemma3_text", "Q4_K", {"head_dim": 256, "layers": 6, "query_pre_attn_scalar": 256,
                             "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
                             "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                 "sliding_attention": {"rope_type": "default",
                                                                       "rope_theta": 10000.0}}}),
])
def test_each_family_computes_as_transformers_reads_it(family, quant, sizes, tmp_path):
    directory = save_tiny_llama(tmp_path / "model", family, hidden=256, **sizes)
    architecture = "llama" if family == "mistral" else None  # llama.cpp writes a Mistral as a Llama
    path = write_gguf(tmp_path / f"tiny-{family}.gguf", directory, architecture, quant=quant, embedding="Q8_0")
    assert_same_logits(path, torch.randint(0, 300, (1, 20), generator=torch.Generator().manual_seed(2)))


def test_a_gguf_of_a_type_gali_does_not_read_is_one_line(tmp_path, capsys):
    directory = save_tiny_llama(tmp_path / "model", hidden=256)
    path = write_gguf(tmp_path / "tiny.gguf", directory, quant="Q4_0")
    data = bytearray(path.read_bytes())
    name = b"blk.0.attn_q.weight"
    at = data.index(name) + len(name)
    at += 4 + 8 * 2  # dimensions count, two dimensions: then the type
    data[at:at + 4] = (20).to_bytes(4, "little")  # IQ4_NL, a codebook type, of Q4_0's block size
    bad = tmp_path / "iq.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match=r"holds tensors of type IQ4_NL, which gali does not read"):
        load_model(str(bad), device="cpu")


def test_a_load_reads_through_one_file_handle_closed_at_its_end(tmp_path, monkeypatch):
    """One open for the whole load, closed once it is done, and closed too when a tensor turns out damaged."""
    from gali_cli.model.gguf import read_header

    directory = save_tiny_llama(tmp_path / "model", hidden=256)
    path = write_gguf(tmp_path / "tiny.gguf", directory, quant="Q4_0")
    header = read_header(path)
    norm = next(t for t in header.tensors if t.name == "output_norm.weight")  # float32
    data = bytearray(path.read_bytes())
    start = header.data_start + norm.offset
    data[start:start + 4] = np.float32(np.nan).tobytes()
    damaged = tmp_path / "damaged.gguf"
    damaged.write_bytes(bytes(data))
    opened = []

    def tracked(*args, **kwargs):
        opened.append(open(*args, **kwargs))  # noqa: SIM115 - the load closes it, as checked below
        return opened[-1]

    monkeypatch.setattr(gguf_weights, "open", tracked, raising=False)
    load_model(str(path), device="cpu")
    assert len(opened) == 1 and opened[0].closed
    with pytest.raises(ModelLoadError, match=r"damaged: its tensor output_norm\.weight holds NaN"):
        load_model(str(damaged), device="cpu")
    assert len(opened) == 2 and opened[1].closed


def test_quantize_is_refused_for_a_gguf(tiny_gguf):
    from gali_cli.errors import ConfigError

    with pytest.raises(ConfigError, match="--quantize 8bit applies to float checkpoints"):
        load_model(str(tiny_gguf), device="cpu", quantize="8bit")


def llama3_8b_q4_k_m() -> list[tuple[str, tuple[int, ...], int]]:
    """Llama-3-8B's tensors as llama.cpp writes a Q4_K_M file of it: Q4_K, with Q6_K for the output, and for the
    value and down projections of the first and last eighth of the layers and every third between."""
    layers, hidden, ffn, vocab, heads, kv_heads, head_dim = 32, 4096, 14336, 128256, 32, 8, 128
    q4, q6, f32 = gguf_blocks.Q4_K, gguf_blocks.Q6_K, gguf_blocks.F32

    def more_bits(i: int) -> bool:
        return i < layers // 8 or i >= 7 * layers // 8 or (i - layers // 8) % 3 == 2

    tensors = [("token_embd.weight", (hidden, vocab), q4), ("output.weight", (hidden, vocab), q6),
               ("output_norm.weight", (hidden,), f32)]
    for i in range(layers):
        wider = q6 if more_bits(i) else q4
        tensors += [(f"blk.{i}.attn_q.weight", (hidden, heads * head_dim), q4),
                    (f"blk.{i}.attn_k.weight", (hidden, kv_heads * head_dim), q4),
                    (f"blk.{i}.attn_v.weight", (hidden, kv_heads * head_dim), wider),
                    (f"blk.{i}.attn_output.weight", (heads * head_dim, hidden), q4),
                    (f"blk.{i}.ffn_gate.weight", (hidden, ffn), q4), (f"blk.{i}.ffn_up.weight", (hidden, ffn), q4),
                    (f"blk.{i}.ffn_down.weight", (ffn, hidden), wider),
                    (f"blk.{i}.attn_norm.weight", (hidden,), f32), (f"blk.{i}.ffn_norm.weight", (hidden,), f32)]
    return tensors


def test_the_memory_docs_give_for_an_8b_gguf_is_what_gali_info_computes():

    from gali_cli.estimate import kv_bytes

    weights = gguf_blocks.resident_bytes(llama3_8b_q4_k_m()) / 2**30
    kv_32k = kv_bytes(32, 8, 128, 4) * 32768 / 2**30
    row = next(line for line in (ROOT / "docs" / "models.md").read_text().splitlines()
               if line.startswith("| Llama-3-8B-Instruct Q4_K_M"))
    assert f"| {weights:.1f} GiB | {kv_32k:.1f} GiB |" in row


def test_resident_bytes_count_what_loading_holds(tmp_path):
    """gali info's figure for a file is the bytes its loaded model holds (q, k and v stacked at the finest block)."""
    directory = save_tiny_llama(tmp_path / "model", hidden=256)
    path = write_gguf(tmp_path / "tiny.gguf", directory, quant="Q4_K", embedding="Q6_K")
    from gali_cli.model.gguf import read_header

    header = read_header(path)
    expected = gguf_blocks.resident_bytes((t.name, t.shape, t.ggml_type) for t in header.tensors)
    model = load_model(str(path), device="cpu").model
    held = {id(m.group): m.group for m in model.modules() if isinstance(m, PackedLinear)}
    held[id(model.get_input_embeddings().grid)] = model.get_input_embeddings().grid
    total = sum(w.nbytes() for w in held.values()) + sum(p.numel() * 4 for p in model.parameters())
    assert total == expected
