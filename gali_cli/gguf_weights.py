"""A GGUF's weights read straight from the file into the model, kept in their quantized blocks on the CPU.

The model is built with its parameters on the meta device (no memory), then each tensor is read from the file
once: the projections, the embedding and the output head as grids (gguf_blocks.py) behind PackedLinear and
PackedEmbedding, the norms and biases as float32. No float copy of a weight matrix exists at any point, in memory
or on disk: SmolLM2-135M's Q4_1 file (98 MB) takes 170 MB as grids where float32 took 540 MB. Tensors are read
with plain reads, not a memory map, so the file's pages do not count against the process once converted.

The names and transforms are llama.cpp's (its convert_hf_to_gguf.py, and transformers' GGUF reader that undoes
them): a Llama's q and k rows permuted for its rotary layout (a Qwen's and a Gemma's not); Gemma's norms stored as
the 1 + weight they scale by. A projection group that one product serves in decoding (q, k and v; gate and up) is
stacked in one grid, its members views of it (`PackedLinear.group`), at the finest block any member needs.

Elsewhere than a float32 model on the CPU (a GPU, or another dtype asked for) each weight is dequantized as it is
read into an ordinary parameter of that dtype and device: no whole float copy on the CPU either.
"""

from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
from accelerate import init_empty_weights
from torch import nn
from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedModel

from .engine.seam.grid_weights import GridWeight
from .engine.seam.packed_modules import PackedEmbedding, PackedLinear, unpack_rows
from .errors import ModelLoadError
from .model.gguf import GgufHeader, TensorInfo
from .model.gguf_blocks import (
    BF16,
    FLOAT_TYPES,
    GEMMA3_LAYER_TENSORS,
    GRID_TYPES,
    GROUPS,
    LAYER_TENSORS,
    GridArrays,
    read_float,
    read_grid,
    row_bytes,
    type_name,
)

SUPPORTED_TYPES = ", ".join(type_name(t) for t in (*GRID_TYPES, *FLOAT_TYPES))


def load_gguf_weights(path: Path, header: GgufHeader, config, device: torch.device, dtype: torch.dtype,
                      notice: Callable[[str], None] | None = None) -> PreTrainedModel:
    """The model `config` describes with the weights of the GGUF at `path` (its `header` read and checked): packed
    where `device` is the CPU and `dtype` float32, else dequantized into `dtype` on `device`."""
    unsupported = sorted({type_name(t.ggml_type) for t in header.tensors
                          if t.ggml_type not in GRID_TYPES and t.ggml_type not in FLOAT_TYPES})
    if unsupported:
        raise ModelLoadError(f"{path} holds tensors of type {', '.join(unsupported)}, which gali does not read "
                             f"(codebook and ternary types); it reads {SUPPORTED_TYPES}")
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig.from_model_config(config)
    packed = device.type == "cpu" and dtype == torch.float32
    with _TensorReader(path, header) as reader:
        _Filler(model, reader, header.architecture, packed, device, dtype).fill()
    left = [name for name, parameter in model.named_parameters() if parameter.device.type == "meta"]
    if left:
        raise ModelLoadError(f"cannot load {path}: the file has no tensor for {', '.join(left[:3])}"
                             f"{f' and {len(left) - 3} more' if len(left) > 3 else ''}")
    return model.eval()


class _TensorReader:
    """Tensors of one GGUF file by name, read with plain reads (each tensor's bytes once, then freed) through one
    file handle held from `with` to its end, closed there on an error too: opened for each chunk of rows, a large
    model's file would be opened thousands of times."""

    def __init__(self, path: Path, header: GgufHeader) -> None:
        self.path, self.header = path, header
        self.tensors = {tensor.name: tensor for tensor in header.tensors}
        self.file: BinaryIO | None = None

    def __enter__(self) -> "_TensorReader":
        try:
            self.file = open(self.path, "rb")
        except OSError as error:
            raise self.unreadable(error) from error
        return self

    def __exit__(self, *exception: object) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None

    def has(self, name: str) -> bool:
        return name in self.tensors

    def info(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise ModelLoadError(f"cannot load {self.path}: it has no tensor {name!r}")
        return self.tensors[name]

    def raw(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Rows [start, stop) of the tensor's bytes (stop - start, row bytes) uint8."""
        tensor = self.info(name)
        width = row_bytes(tensor.ggml_type, tensor.shape[0])
        stop = tensor.nbytes // width if stop is None else stop
        if self.file is None:
            raise RuntimeError("_TensorReader reads only inside its `with` block")
        try:
            self.file.seek(self.header.data_start + tensor.offset + start * width)
            data = self.file.read((stop - start) * width)
        except OSError as error:
            raise self.unreadable(error) from error
        if len(data) != (stop - start) * width:
            raise ModelLoadError(f"{self.path} is truncated at tensor {name!r}; download it again")
        return np.frombuffer(data, dtype=np.uint8).reshape(stop - start, width)

    def grid(self, name: str) -> GridArrays | torch.Tensor:
        """A matrix tensor as grids (read a chunk of rows at a time), or, of a float type, as a tensor (R, C) in its
        own float32, float16 or bfloat16."""
        tensor = self.info(name)
        columns, ggml_type = tensor.shape[0], tensor.ggml_type
        if ggml_type in GRID_TYPES:
            rows = tensor.nbytes // row_bytes(ggml_type, columns)
            arrays = read_grid(lambda start, stop: self.raw(name, start, stop), ggml_type, columns, rows)
            if not all(np.isfinite(part).all() for part in (arrays.step, arrays.base)):
                raise self.damaged(name)
            return arrays
        weights = torch.from_numpy(read_float(self.raw(name), ggml_type, columns).copy())  # writable
        weights = weights.view(torch.bfloat16) if ggml_type == BF16 else weights
        if not torch.isfinite(weights).all():
            raise self.damaged(name)
        return weights

    def floats(self, name: str) -> torch.Tensor:
        """Any tensor dequantized to float32, in transformers' shape (GGUF's dimensions reversed)."""
        return dense(self.grid(name)).reshape(tuple(reversed(self.info(name).shape)))

    def unreadable(self, error: OSError) -> ModelLoadError:
        return ModelLoadError(f"cannot read {self.path}: {error.strerror or error}")

    def damaged(self, name: str) -> ModelLoadError:
        return ModelLoadError(f"{self.path} is damaged: its tensor {name} holds NaN or infinite values")


def dense(weights: GridArrays | torch.Tensor) -> torch.Tensor:
    """A matrix as float32 weights: a grid dequantized as GGUF's readers do (the product exact, rounded once), by
    the formula the packed modules unpack tiles by, so the two agree bit for bit."""
    return unpack_rows(_grid_tensor(weights)) if isinstance(weights, GridArrays) else weights.float()


class _Filler:
    """Puts each GGUF tensor where the model (built on the meta device) wants it."""

    def __init__(self, model: PreTrainedModel, reader: _TensorReader, architecture: str, packed: bool,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.model, self.reader, self.packed, self.device, self.dtype = model, reader, packed, device, dtype
        self.architecture = architecture
        self.names = GEMMA3_LAYER_TENSORS if architecture == "gemma3" else LAYER_TENSORS
        config = model.config
        self.heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}

    def fill(self) -> None:
        base = self.model.model
        embedding = self._matrix("token_embd.weight")
        scale = getattr(base.embed_tokens, "embed_scale", None)
        if self.packed:
            base.embed_tokens = PackedEmbedding(embedding, scale)
        else:
            _set(base.embed_tokens, "weight", embedding)
        self._norm(base, "norm", "output_norm.weight")
        for index, layer in enumerate(base.layers):
            self._layer(layer, f"blk.{index}")
        head = self.model.lm_head
        tied = not self.reader.has("output.weight")
        if self.packed:
            self.model.lm_head = PackedLinear(embedding if tied else self._matrix("output.weight"))
        elif tied:
            head.weight = base.embed_tokens.weight
        else:
            _set(head, "weight", self._matrix("output.weight"))

    def _layer(self, layer: nn.Module, prefix: str) -> None:
        for module_name, tensor in self.names.items():
            owner, _, attribute = module_name.rpartition(".")
            parent = layer.get_submodule(owner) if owner else layer
            module = getattr(parent, attribute, None)
            if module is None or isinstance(module, nn.Linear):
                continue  # the groups below; a norm this model does not have
            self._norm(parent, attribute, f"{prefix}.{tensor}.weight")
        for owner, members in GROUPS:
            parent = layer.get_submodule(owner)
            names = [f"{prefix}.{self.names[f'{owner}.{member}']}" for member in members]
            if self.packed:
                self._packed_group(parent, members, names)
            else:
                for member, name in zip(members, names, strict=True):
                    linear = getattr(parent, member)
                    _set(linear, "weight", self._matrix(f"{name}.weight"))
                    if linear.bias is not None:
                        _set(linear, "bias", self.reader.floats(f"{name}.bias").to(self.dtype))
        for owner, member in (("self_attn", "o_proj"), ("mlp", "down_proj")):
            parent = layer.get_submodule(owner)
            name = f"{prefix}.{self.names[f'{owner}.{member}']}.weight"
            if self.packed:
                setattr(parent, member, PackedLinear(self._matrix(name)))
            else:
                _set(getattr(parent, member), "weight", self._matrix(name))

    def _packed_group(self, parent: nn.Module, members: tuple[str, ...], names: list[str]) -> None:
        """The group's matrices stacked by rows in one grid (or one float tensor where any is of a float type),
        each member a PackedLinear over its rows."""
        parts = [self._rows(f"{name}.weight") for name in names]
        if all(isinstance(part, GridArrays) for part in parts):
            block = min(part.block for part in parts)
            group = _grid_tensor(GridArrays(np.concatenate([part.codes for part in parts]),
                                            *(np.concatenate([_blocks_of(part, table, block) for part in parts])
                                              for table in ("step", "base")), block))
        else:
            tensors = [dense(part) if isinstance(part, GridArrays) else part for part in parts]
            same = len({t.dtype for t in tensors}) == 1
            group = torch.cat(tensors if same else [t.float() for t in tensors])
        start = 0
        for member, name, part in zip(members, names, parts, strict=True):
            rows = part.codes.shape[0] if isinstance(part, GridArrays) else part.shape[0]
            view = group.row_range(start, start + rows) if isinstance(group, GridWeight) else group[start:start + rows]
            bias = self.reader.floats(f"{name}.bias") if self.reader.has(f"{name}.bias") else None
            linear = PackedLinear(view, bias)
            linear.group = group
            setattr(parent, member, linear)
            start += rows

    def _rows(self, name: str) -> GridArrays | torch.Tensor:
        """A matrix as read, its rows in transformers' order (a Llama's q and k un-permuted)."""
        weights = self.reader.grid(name)
        kind = name.split(".")[2] if name.startswith("blk.") else ""
        if self.architecture != "llama" or kind not in self.heads:
            return weights
        rows = weights.codes.shape[0] if isinstance(weights, GridArrays) else weights.shape[0]
        order = _unpermuted_rows(rows, self.heads[kind])
        if isinstance(weights, GridArrays):
            return GridArrays(weights.codes[order], weights.step[order], weights.base[order], weights.block)
        return weights[torch.from_numpy(order)]

    def _matrix(self, name: str) -> GridWeight | torch.Tensor:
        """A matrix packed (a GridWeight, or a tensor in its file's float type), or dequantized into the model's
        dtype and device."""
        weights = self._rows(name)
        if self.packed:
            return _grid_tensor(weights) if isinstance(weights, GridArrays) else weights
        return dense(weights).to(self.device, self.dtype)

    def _norm(self, parent: nn.Module, attribute: str, name: str) -> None:
        weight = self.reader.floats(name)
        if self.architecture == "gemma3":  # llama.cpp stores 1 + weight, the factor Gemma's RMSNorm applies
            weight = weight - 1
        _set(getattr(parent, attribute), "weight", weight.to(self.device, torch.float32 if self.packed else self.dtype))


def _set(module: nn.Module, name: str, value: torch.Tensor) -> None:
    """Replace a (meta) parameter of `module` with `value`, checking the shape transformers built it with."""
    current = getattr(module, name)
    if tuple(current.shape) != tuple(value.shape):
        raise ModelLoadError(f"a GGUF tensor of shape {list(value.shape)} where the model's config makes "
                             f"{type(module).__name__}.{name} {list(current.shape)}; a damaged or hostile file")
    setattr(module, name, nn.Parameter(value, requires_grad=False))


def _grid_tensor(arrays: GridArrays) -> GridWeight:
    return GridWeight(*(torch.from_numpy(np.ascontiguousarray(part)) for part in
                        (arrays.codes, arrays.step, arrays.base)), arrays.block)


def _blocks_of(arrays: GridArrays, table: str, block: int) -> np.ndarray:
    """A grid's steps or bases per block of `block` weights (its own blocks repeated where they are wider)."""
    values = getattr(arrays, table)
    return values if arrays.block == block else np.repeat(values, arrays.block // block, axis=1)


def _unpermuted_rows(rows: int, heads: int) -> np.ndarray:
    """The rows of a Llama's q or k weight in transformers' order, as indices into llama.cpp's: its converter
    interleaves the two halves of each head's rows for its rotary layout, and this undoes it."""
    half = rows // heads // 2
    return np.arange(rows).reshape(heads, half, 2).swapaxes(1, 2).reshape(rows)
