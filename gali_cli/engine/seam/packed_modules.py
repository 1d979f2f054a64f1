"""A model's linear layers and embedding over weights held as grids (a GGUF's blocks as read, grid_weights.py) or in
a GGUF's own 16-bit floats, in place of nn.Linear and nn.Embedding, so that no float32 copy of the model exists at
any point.

A product of many rows (a prefill chunk, perplexity's logits) unpacks the weight a tile of rows at a time into one
float32 buffer reused from call to call and multiplies by it (the same float32 weights as dequantizing, so the same
products); a few rows (a decoding step) go through the grid product itself, which reads the bytes. The embedding
unpacks just the rows of the tokens it looks up.

These modules hold no weight parameter, so code that needs a model's device or dtype asks `model_device`,
`model_dtype` or `module_device`, which know both kinds of module, not a module's `.weight`.
"""

import functools
import threading

import torch
from torch import nn
from transformers import PreTrainedModel

from ..kernels.native_library import Kernel, load_kernel, share_among_threads
from .grid_weights import GridWeight

# At most this many input rows go through the grid product (it reads the matrix once for all of them, but does a
# row's work per input row); more are multiplied by unpacked tiles.
DIRECT_ROWS = 4
# Weights unpacked at once (float32: 16 MiB): a projection of a small model whole, a large vocabulary's head in tiles.
TILE_WEIGHTS = 1 << 22

_held = threading.local()


@functools.cache
def native_kernel() -> Kernel | None:
    """The native kernels, or None where they cannot be built or loaded here (no C compiler, say): then tiles are
    unpacked in PyTorch and every product goes through them."""
    try:
        return load_kernel()
    except Exception:  # no compiler, a compiler error, a library that does not load: PyTorch serves
        return None


def grid_product_available() -> bool:
    """Whether the native grid product runs here and pays (vector registers); else a decoding step's products go
    through unpacked tiles, like a prefill's."""
    kernel = native_kernel()
    return kernel is not None and kernel.grid_vectorised


def _scratch(elements: int, device: torch.device) -> torch.Tensor:
    """A float32 buffer of at least `elements`, kept per thread, device and inference mode (a tensor made inside
    torch.inference_mode may not be written outside it): fresh pages for every tile would cost page faults."""
    key = (device, torch.is_inference_mode_enabled())
    buffers = _held.__dict__.setdefault("buffers", {})
    if key not in buffers or buffers[key].numel() < elements:
        buffers[key] = torch.empty(elements, dtype=torch.float32, device=device)
    return buffers[key][:elements]


def unpack_rows(grid: GridWeight, rows: slice | torch.Tensor | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows of `grid` (all; a range, `slice(begin, end)`; or the indices `rows`) as float32 (R, M), base + step *
    code: the product exact, rounded once as GGUF's readers dequantize. The one statement of the formula, for the
    tiles, the embedding's lookups and the loader's dequantizing alike, so that all three give the same bits.
    `out`: a float32 buffer of at least R * M elements to write into (the tiles' scratch) instead of a new one."""
    rows = slice(None) if rows is None else rows
    codes = grid.codes[rows]
    count, blocks = codes.shape[0], grid.columns // grid.block
    shape = (count, blocks, grid.block)
    values = torch.empty(shape, dtype=torch.float32, device=grid.device) if out is None else (
        out.view(-1)[:count * grid.columns].view(shape))
    values.copy_(codes.view(shape))  # (R, S, block)
    values.mul_(grid.step[rows][:, :, None]).add_(grid.base[rows][:, :, None])
    return values.view(count, grid.columns)


def unpack_into(weights: GridWeight | torch.Tensor, begin: int, end: int) -> torch.Tensor:
    """Rows [begin, end) of `weights` (a grid, or a float16/bfloat16/float32 matrix) as float32 (end - begin, M) in
    the thread's scratch buffer (valid until the next call): by the native kernel where it runs, else `unpack_rows`."""
    rows, columns = end - begin, weights.shape[1]
    scratch = _scratch(rows * columns, weights.device)
    if not isinstance(weights, GridWeight):
        return scratch.view(rows, columns).copy_(weights[begin:end])
    kernel = native_kernel() if weights.device.type == "cpu" else None
    if kernel is None:
        return unpack_rows(weights, slice(begin, end), out=scratch)
    arguments = (weights.codes.data_ptr(), weights.step.data_ptr(), weights.base.data_ptr(), columns, weights.block)

    def run(first: int, last: int, threads: int = 1) -> None:
        kernel.grid_unpack(*arguments, begin + first, begin + last, begin, scratch.data_ptr(), threads)

    share_among_threads(run, rows, torch.get_num_threads(), kernel.threaded)
    return scratch.view(rows, columns)


class PackedLinear(nn.Module):
    """y = x W^T + b in float32, with W (N outputs, M inputs) held as a GridWeight, or as a float16, bfloat16 or
    float32 tensor (a GGUF's float tensors, in their own bits). `in_features` and `out_features` as nn.Linear names
    them; the weights are `grid` (`module_device` tells their device). `group`: the stacked weights this one is rows
    of (q, k and v; gate and up), which a decoding step multiplies by at once."""

    def __init__(self, grid: GridWeight | torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.grid = grid
        self.group: GridWeight | torch.Tensor = grid
        self.out_features, self.in_features = grid.shape
        self.bias = None if bias is None else nn.Parameter(bias.to(torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).float()
        if flat.shape[0] <= DIRECT_ROWS and isinstance(self.grid, GridWeight) and x.device.type == "cpu" and (
                grid_product_available()):
            out = self.grid(flat)
        else:
            out = torch.empty(flat.shape[0], self.out_features, dtype=torch.float32, device=x.device)
            tile = max(1, TILE_WEIGHTS // self.in_features)
            for begin in range(0, self.out_features, tile):
                end = min(self.out_features, begin + tile)
                weights = unpack_into(self.grid, begin, end)
                if end - begin == self.out_features:
                    torch.mm(flat, weights.T, out=out)
                else:
                    out[:, begin:end] = flat @ weights.T
        if self.bias is not None:
            out += self.bias
        return out.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class PackedEmbedding(nn.Module):
    """nn.Embedding's lookup over weights (vocabulary, hidden) held as PackedLinear's are, the rows looked up made
    float32, times `scale` where the model scales its embeddings (Gemma's sqrt(hidden), its `embed_scale`). It has
    no `weight`: no float matrix exists (`module_device`, `model_device` and `model_dtype` tell where it lives)."""

    def __init__(self, grid: GridWeight | torch.Tensor, scale: torch.Tensor | None = None) -> None:
        super().__init__()
        self.grid = grid
        self.num_embeddings, self.embedding_dim = grid.shape
        self.scale = scale

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat, grid = ids.reshape(-1), self.grid
        rows = unpack_rows(grid, flat) if isinstance(grid, GridWeight) else grid[flat].float()
        rows = rows.view(*ids.shape, self.embedding_dim)
        return rows if self.scale is None else rows * self.scale.to(torch.float32)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"




def module_device(module: nn.Module) -> torch.device:
    """The device of `module`'s weights, a packed module's (its grid's) as an nn.Linear's or nn.Embedding's: with
    device_map="auto" each layer's own GPU."""
    return module.grid.device if isinstance(module, PackedLinear | PackedEmbedding) else module.weight.device


def model_device(model: PreTrainedModel) -> torch.device:
    """The device `model`'s input ids go to: its input embedding's (with device_map="auto", the first GPU's)."""
    return module_device(model.get_input_embeddings())


def model_dtype(model: PreTrainedModel) -> torch.dtype:
    """The dtype `model`'s hidden states are computed in: its input embedding's weights', float32 for packed
    weights (their products are float32 whatever the grid's or float tensor's own type)."""
    embedding = model.get_input_embeddings()
    return torch.float32 if isinstance(embedding, PackedEmbedding) else embedding.weight.dtype
