"""GGUF files (llama.cpp, ollama, LM Studio): recognised, checked and identified before transformers reads them.

transformers reads a GGUF's metadata in seconds and dequantizes its tensors in tens of seconds, and says little
when the file is damaged. This module reads only the header, with the layout the GGUF specification gives (magic,
version, metadata key-values, tensor descriptions, aligned data), so that a file that is not a GGUF, is truncated,
is damaged or holds another architecture is refused at once, in one line, before anything slow runs.
"""

import hashlib
import importlib.util
import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelLoadError, UnsupportedModelError

MAGIC = b"GGUF"
# The GGUF architectures of gali's families that transformers reads (llama.cpp writes a Mistral as "llama").
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")
# transformers takes no head width from a Qwen3 GGUF (its attention.key_length): Qwen3Config's default, 128, which
# every released Qwen3 has; another would load with its attention weights silently re-initialised.
QWEN3_GGUF_HEAD_DIM = 128
# transformers reads a Gemma 3 GGUF with Gemma3TextConfig's defaults where the header says nothing: logits scaled by
# query_pre_attn_scalar = 256, and no rope scaling (it rebuilds none for this architecture). llama.cpp scales by
# hidden / heads for the 27B (62 blocks), by the head width otherwise; 4B on scale their global RoPE linearly by 8.
GEMMA3_GGUF_QUERY_SCALAR = 256
GEMMA3_27B_BLOCKS = 62
_VERSIONS = (2, 3)  # version 1 counted in 32 bits; llama.cpp has not written it since 2023
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_DEFAULT_ALIGNMENT = 32
_MAX_DIMS = 8
_MAX_NESTING = 3  # arrays of arrays of arrays; llama.cpp writes none nested at all
_MAX_STRING = 2**24  # bytes of one metadata string kept (a chat template is tens of KiB)
_MAX_ALIGNMENT = 2**16
_ITEM_BYTES = {_STRING: 8, _ARRAY: 12}  # the least bytes an item of these types takes
_HEAD_BYTES = 2**20  # the part of the file whose digest tells it from another of the same size and time


def is_gguf(path: Path) -> bool:
    """Whether `path` is a file that starts like a GGUF (its suffix is not trusted: the magic is)."""
    try:
        with open(path, "rb") as file:
            return file.read(4) == MAGIC
    except OSError:
        return False


def require_gguf_package() -> None:
    """transformers needs the `gguf` package to dequantize; say how to get it before anything else runs."""
    if importlib.util.find_spec("gguf") is None:
        raise ModelLoadError("reading a GGUF file needs the gguf package: pip install gguf")


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as the header describes it."""

    name: str
    shape: tuple[int, ...]  # as GGUF lists it: fastest-varying dimension first
    ggml_type: int
    offset: int  # from the start of the data section
    nbytes: int


@dataclass(frozen=True)
class GgufHeader:
    """What a GGUF says about itself: its metadata (scalars and strings; arrays as their length) and tensors."""

    version: int
    metadata: dict
    tensors: tuple[TensorInfo, ...]
    data_start: int

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "?"))

    @property
    def name(self) -> str:
        return str(self.metadata.get("general.name", ""))


class _Reader:
    """Little-endian values from a memory-mapped file, every read checked against the file's end."""

    def __init__(self, data: mmap.mmap, path: Path) -> None:
        self.data, self.path, self.offset = data, path, 0

    def scalar(self, code: str):
        size = struct.calcsize(code)
        self._need(size)
        (value,) = struct.unpack_from("<" + code, self.data, self.offset)
        self.offset += size
        return value

    def string(self) -> str:
        length = self.scalar("Q")
        self._need(length)
        if length > _MAX_STRING:
            raise self.damaged(f"a metadata string of {length} bytes at byte {self.offset}")
        text = bytes(self.data[self.offset:self.offset + length]).decode("utf-8", errors="replace")
        self.offset += length
        return text

    def value(self, kind: int, depth: int = 0, keep: bool = True):
        """A metadata value; an array is skipped and stands as its length (the tokenizer's are large). Nesting and
        counts are checked against the file before anything is read, so no header makes this recurse deeply,
        loop past the file's end or allocate more than a string of _MAX_STRING bytes."""
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == _STRING:
            if keep:
                return self.string()
            length = self.scalar("Q")
            self.offset += self._sized(length)
            return None
        if kind == _ARRAY:
            if depth >= _MAX_NESTING:
                raise self.damaged(f"metadata arrays nested more than {_MAX_NESTING} deep at byte {self.offset}")
            item, count = self.scalar("I"), self.scalar("Q")
            if item in _SCALARS:
                self.offset += self._sized(struct.calcsize(_SCALARS[item]) * count)
            elif item in _ITEM_BYTES:
                self._need(min(count, len(self.data)) * _ITEM_BYTES[item])  # each item takes at least this
                for _ in range(count):
                    self.value(item, depth + 1, keep=False)
            else:
                raise self.damaged(f"unknown metadata type {item} at byte {self.offset}")
            return count
        raise self.damaged(f"unknown metadata type {kind} at byte {self.offset}")

    def _sized(self, size: int) -> int:
        self._need(size)
        return size

    def _need(self, size: int) -> None:
        if self.offset + size > len(self.data):
            raise ModelLoadError(f"{self.path} is truncated: its header ends past the end of the file "
                                 f"({len(self.data)} bytes); download it again")

    def damaged(self, detail: str) -> ModelLoadError:
        return ModelLoadError(f"{self.path} is a damaged GGUF file ({detail}); download it again")


def read_header(path: Path) -> GgufHeader:
    """The header of the GGUF at `path`, checked: version, metadata, tensor types, and tensors inside the file."""
    require_gguf_package()
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            if data[:4] != MAGIC:
                raise ModelLoadError(f"{path} is not a GGUF file")
            reader = _Reader(data, path)
            reader.offset = 4
            version = reader.scalar("I")
            if version not in _VERSIONS:
                raise ModelLoadError(f"{path}: GGUF version {version} is not supported (versions 2 and 3 are)")
            tensor_count, kv_count = reader.scalar("Q"), reader.scalar("Q")
            if tensor_count > len(data) or kv_count > len(data):
                raise reader.damaged(f"{tensor_count} tensors and {kv_count} metadata entries in {len(data)} bytes")
            metadata = {}
            for _ in range(kv_count):
                key = reader.string()
                metadata[key] = reader.value(reader.scalar("I"))
            tensors = []
            for _ in range(tensor_count):
                name, dims = reader.string(), reader.scalar("I")
                if dims > _MAX_DIMS:
                    raise reader.damaged(f"tensor {name!r} has {dims} dimensions")
                shape = tuple(reader.scalar("Q") for _ in range(dims))
                kind, offset = reader.scalar("I"), reader.scalar("Q")
                try:
                    block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
                except (ValueError, KeyError):
                    raise ModelLoadError(f"{path}: tensor {name!r} has type {kind}, which this gguf package does "
                                         "not know (pip install -U gguf)") from None
                elements = math.prod(shape)
                if elements % block:
                    raise reader.damaged(f"tensor {name!r} of shape {shape} is not whole blocks of {block}")
                tensors.append(TensorInfo(name, shape, kind, offset, elements // block * block_bytes))
            alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
            if not isinstance(alignment, int) or not 0 < alignment <= _MAX_ALIGNMENT:
                raise reader.damaged(f"alignment {alignment!r}")
            _check_offsets(reader, tensors, alignment)
            data_start = -(-reader.offset // alignment) * alignment
            size = len(data)
    except ValueError as error:  # mmap of an empty file
        raise ModelLoadError(f"{path} is not a GGUF file ({error})") from error
    except OSError as error:
        raise ModelLoadError(f"cannot read {path}: {error.strerror or error}") from error
    end = max((data_start + tensor.offset + tensor.nbytes for tensor in tensors), default=data_start)
    if end > size:
        raise ModelLoadError(f"{path} is truncated: its tensors need {end} bytes and the file has {size}; "
                             "download it again")
    return GgufHeader(version, metadata, tuple(tensors), data_start)


def _check_offsets(reader: _Reader, tensors: list[TensorInfo], alignment: int) -> None:
    """Each tensor's data aligned as the header says, and no two overlapping: an offset shifted by a few bytes
    would dequantize into plausible-looking nonsense."""
    previous = None
    for tensor in sorted(tensors, key=lambda tensor: tensor.offset):
        if tensor.offset % alignment:
            raise reader.damaged(f"tensor {tensor.name!r} starts at offset {tensor.offset}, not a multiple of its "
                                 f"alignment {alignment}")
        if previous is not None and tensor.offset < previous.offset + previous.nbytes:
            raise reader.damaged(f"tensors {previous.name!r} and {tensor.name!r} overlap")
        previous = tensor


def check_architecture(path: Path, header: GgufHeader) -> None:
    """Refuse a GGUF of an architecture gali does not read, or whose tensors do not match its metadata (layers,
    embedding and projection shapes), before it is dequantized."""
    architecture = header.architecture
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(f"{path} is a {architecture!r} GGUF; gali reads GGUFs of "
                                    f"{', '.join(SUPPORTED_ARCHITECTURES)} (Mistral's are llama)")
    shapes = {tensor.name: tensor.shape for tensor in header.tensors}

    def field(key: str, default: object = None) -> object:
        return header.metadata.get(f"{architecture}.{key}", default)

    def damaged(detail: str) -> ModelLoadError:
        return ModelLoadError(f"cannot load model {str(path)!r}: its metadata does not match its tensors "
                              f"({detail}); a damaged or hostile GGUF file")

    blocks = {int(name.split(".")[1]) for name in shapes if name.startswith("blk.") and name.split(".")[1].isdigit()}
    count = field("block_count")
    if (not isinstance(count, int) or isinstance(count, bool) or count != len(blocks)
            or max(blocks, default=-1) != count - 1):
        raise damaged(f"{architecture}.block_count is {count!r} and the file holds {len(blocks)} blocks")
    hidden, heads = field("embedding_length"), field("attention.head_count")
    kv_heads = field("attention.head_count_kv", heads)
    vocab = field("vocab_size", header.metadata.get("tokenizer.ggml.tokens"))
    if not all(isinstance(value, int) and value > 0 for value in (hidden, heads, kv_heads)):
        return  # the config check names the bad value (model_config.check_config)
    head_dim = field("attention.key_length") or hidden // heads  # Qwen3's heads are wider than hidden / heads
    if architecture == "qwen3" and head_dim != QWEN3_GGUF_HEAD_DIM:
        raise UnsupportedModelError(f"{path}: a Qwen3 GGUF with heads {head_dim} wide; transformers reads every "
                                    f"Qwen3 GGUF's as {QWEN3_GGUF_HEAD_DIM} (as all released Qwen3 have them)")
    if architecture == "gemma3":
        scalar = hidden // heads if count == GEMMA3_27B_BLOCKS else head_dim
        if scalar != GEMMA3_GGUF_QUERY_SCALAR:
            raise UnsupportedModelError(f"{path}: a Gemma 3 GGUF whose attention logits are scaled by "
                                        f"1/sqrt({scalar}); transformers reads every Gemma 3 GGUF's as "
                                        f"1/sqrt({GEMMA3_GGUF_QUERY_SCALAR})")
        factor = field("rope.scaling.factor")
        if factor not in (None, 1, 1.0):
            raise UnsupportedModelError(f"{path}: a Gemma 3 GGUF whose global RoPE is scaled "
                                        f"({field('rope.scaling.type')}, factor {factor}: Gemma 3 4B on); "
                                        "transformers reads it unscaled, a different model: use the model's "
                                        "safetensors (its gemma3_text config)")
    expected = {"token_embd.weight": (hidden, vocab), "blk.0.attn_q.weight": (hidden, heads * head_dim),
                "blk.0.attn_k.weight": (hidden, kv_heads * head_dim),
                "blk.0.ffn_gate.weight": (hidden, field("feed_forward_length"))}
    for name, shape in expected.items():
        if name in shapes and None not in shape and shapes[name] != shape:
            raise damaged(f"{name} has shape {list(shapes[name])}, the metadata says {list(shape)}")


@dataclass(frozen=True)
class GgufFile:
    """A GGUF file's identity: where it is, its size and modification time, and a digest of its first MiB (a
    file replaced by another changes at least one of them)."""

    path: Path
    size: int
    mtime_ns: int
    head_sha256: str

    @classmethod
    def at(cls, path: Path) -> "GgufFile":
        resolved = path.expanduser().resolve()
        try:
            stat = resolved.stat()
            with open(resolved, "rb") as file:
                head = hashlib.sha256(file.read(_HEAD_BYTES)).hexdigest()
        except OSError as error:
            raise ModelLoadError(f"cannot read {path}: {error.strerror or error}") from error
        return cls(resolved, stat.st_size, stat.st_mtime_ns, head)

    def fingerprint(self) -> dict:
        return {"path": str(self.path), "size": self.size, "mtime_ns": self.mtime_ns, "head_sha256": self.head_sha256}
