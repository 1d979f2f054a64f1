"""Shared fixtures: tiny random Llamas and tokenizers built at test time (nothing is ever downloaded)."""

import json
import os
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

# Triton kernels run on the CPU through Triton's interpreter. It must be chosen before torch imports triton (triton
# decorates its own library when imported); TRITON_INTERPRET=0 tests the compiled kernels on a GPU instead.
os.environ.setdefault("TRITON_INTERPRET", "1")
# --dtype auto computes in float32 on every CPU the tests run on, native bfloat16 or not (test_machine tests both),
# so that numeric comparisons mean the same on every machine; subprocesses inherit it.
os.environ["GALI_CPU_BF16"] = "0"

import pytest
import torch

# One SIGINT stops the run, also one started in the background by a script (tests/interrupts.py).
from interrupts import pytest_configure  # noqa: F401
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

# The seam check's tiny random Llama: the tests' too. VOCAB is imported from here by the tests, hence the noqa.
from gali_cli.seam_check import VOCAB, tiny_llama, tiny_model  # noqa: F401


@pytest.fixture
def make_llama():
    return tiny_llama


@pytest.fixture
def cache_argument_renamed(monkeypatch):
    """transformers as a release that renamed the forward's cache argument again (to `kv_cache`) would be: every
    family's decoder model (LlamaModel, ...) and causal LM declare it under the new name, and the causal LM hands it
    to the model under it."""
    import transformers
    from transformers.modeling_outputs import CausalLMOutputWithPast

    from gali_cli.engine import seam
    from gali_cli.model.families import FAMILIES

    def renamed(model_class):
        current, model_forward = seam.cache_parameter(model_class), model_class.forward

        def renamed_model_forward(self, input_ids=None, attention_mask=None, position_ids=None, kv_cache=None,
                                  inputs_embeds=None, use_cache=None, **kwargs):
            return model_forward(self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                 inputs_embeds=inputs_embeds, use_cache=use_cache, **{current: kv_cache}, **kwargs)

        return renamed_model_forward

    def renamed_causal_forward(self, input_ids=None, attention_mask=None, position_ids=None, kv_cache=None,
                               inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, **kwargs):
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            kv_cache=kv_cache, inputs_embeds=inputs_embeds, use_cache=use_cache,
                            **kwargs).last_hidden_state
        return CausalLMOutputWithPast(logits=self.lm_head(hidden[:, -logits_to_keep:]))

    for family in FAMILIES:  # each causal LM's decoder model: LlamaModel, ..., Gemma3TextModel
        model_class = transformers.AutoModel._model_mapping[getattr(transformers, family.causal_lm).config_class]
        monkeypatch.setattr(model_class, "forward", renamed(model_class))
        monkeypatch.setattr(getattr(transformers, family.causal_lm), "forward", renamed_causal_forward)
    seam.forward_parameters.cache_clear()  # it remembers each class's declared parameters
    yield
    seam.forward_parameters.cache_clear()


@pytest.fixture(autouse=True)
def _own_cache_dir(tmp_path_factory, monkeypatch):
    """No test reads or writes the user's document cache."""
    monkeypatch.setenv("GALI_CACHE_DIR", str(tmp_path_factory.mktemp("gali-cache")))
    monkeypatch.delenv("GALI_CACHE_LIMIT", raising=False)


@pytest.fixture(autouse=True)
def _on_the_cpu(monkeypatch):
    """The commands run on the CPU, as on CI, also where there is a GPU: their float32 answers are compared with
    references computed on the CPU. tests/test_cuda_commands.py runs them on a GPU."""
    monkeypatch.setenv("GALI_DEVICE", "cpu")


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n{{ message['content'] }}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
CORPUS = (
    "The lease ends in March. The tenant pays rent monthly, and the landlord repairs the roof. "
    "def read(path):\n    return open(path).read()\n" * 4
)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE with Llama 3's special tokens and chat format, trained in a blink."""
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([CORPUS], trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                                   chat_template=CHAT_TEMPLATE)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama (window 32) and its tokenizer on disk; its stop tokens never win a greedy pick."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), hidden=64)


def save_tiny_llama(directory: Path, model_type: str = "llama", **llama) -> Path:
    """tiny_model_dir's model, of `llama`'s sizes (seam_check.tiny_model's arguments; another family by its
    `model_type`), saved in `directory`."""
    tokenizer = tiny_tokenizer()
    model = tiny_model(model_type, train_len=32, **llama)
    stops = [tokenizer.convert_tokens_to_ids(t) for t in ("<|end_of_text|>", "<|eot_id|>")]
    model.resize_token_embeddings(len(tokenizer))
    with torch.no_grad():
        model.lm_head.weight[stops] = 0
    model.config.eos_token_id = model.generation_config.eos_token_id = stops
    model.config.bos_token_id = model.generation_config.bos_token_id = 0
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def _model_cache_directory(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gali-models")


@pytest.fixture(autouse=True)
def _own_model_cache(_model_cache_directory, monkeypatch):
    """No test reads or writes the user's model cache (one directory per session, so the real model's tokenizer is
    read once)."""
    monkeypatch.setenv("GALI_MODEL_CACHE", str(_model_cache_directory))


# K-quant blocks written at test time (the gguf package quantizes only the older types): random bytes with their
# float16 scales set where the block keeps them, small enough that a weight stays within about 0.1.
K_QUANT_SCALES = {"Q2_K": ((80, 82), 2e-3), "Q3_K": ((108,), 5e-4), "Q4_K": ((0, 2), 1e-4),
                  "Q5_K": ((0, 2), 5e-5), "Q6_K": ((208,), 2e-5)}


def quantized_tensor(array, quant: str, seed: int = 0):
    """`array` (rows, columns) float32 as a GGUF tensor of type `quant` (its bytes, and the type): the gguf
    package's own quantization where it has one, else (K-quants) random blocks of that type with sane scales, the
    same shape."""
    import gguf
    import numpy as np

    kind = gguf.GGMLQuantizationType[quant]
    if quant not in K_QUANT_SCALES:
        return gguf.quants.quantize(array, kind), kind
    weights, size = gguf.GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(array.size // weights, size), dtype=np.uint8)
    offsets, scale = K_QUANT_SCALES[quant]
    for offset in offsets:
        halves = rng.uniform(0.5 * scale, scale, size=len(blocks)).astype(np.float16)
        blocks[:, offset:offset + 2] = halves.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(array.shape[0], -1), kind


def write_gguf(path: Path, model_dir: Path, architecture: str | None = None, quantized: bool = True,
               quant: str = "Q8_0", embedding: str | None = None) -> Path:
    """Write the model and tokenizer in `model_dir` as a GGUF the way llama.cpp's converter lays it out: a Llama's q
    and k rows permuted for its rotary layout (a Qwen's not), Qwen2's q/k/v biases, Qwen3's q/k norms and head
    width, Gemma 3's four norms a layer (stored as the 1 + weight they scale by), window and tied output, and (with
    `quantized`) the projections and the output in blocks of type `quant` (a K-quant's blocks random:
    `quantized_tensor`), the embedding in `embedding`'s (None: float32). `architecture`: the one the header names
    (the model's model_type, Gemma 3's "gemma3", unless given)."""
    import gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = model.config
    writer = gguf.GGUFWriter(str(path), architecture or config.model_type.replace("gemma3_text", "gemma3"))
    writer.add_name("tiny llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = model.model.layers[0].self_attn.head_dim
    writer.add_rope_dimension_count(head_dim)
    gemma = config.model_type == "gemma3_text"
    if config.model_type == "qwen3" or gemma:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if gemma:  # the global layers' base (llama.cpp takes the local layers' as 10,000), their window, their scaling
        writer.add_rope_freq_base(config.rope_parameters["full_attention"]["rope_theta"])
        writer.add_sliding_window(config.sliding_window)
        if config.rope_parameters["full_attention"].get("factor"):
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(config.rope_parameters["full_attention"]["factor"])
    else:
        writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    vocabulary = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    specials = set(tokenizer.all_special_tokens) | {t.content for t in tokenizer.added_tokens_decoder.values()}
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(vocabulary)
    writer.add_token_types([3 if token in specials else 1 for token in vocabulary])
    if config.model_type == "gemma3_text":  # a SentencePiece vocabulary's scores, as Gemma's GGUFs carry them
        writer.add_token_scores([-float(index) for index in range(len(vocabulary))])
    writer.add_token_merges([" ".join(merge) if isinstance(merge, list) else merge for merge in merges])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_add_bos_token(True)
    writer.add_chat_template(tokenizer.chat_template)

    def permute(weight, heads):  # llama.cpp's rotary layout for a Llama: the two halves of each head interleaved
        if config.model_type != "llama":
            return weight
        return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
            weight.shape)

    def add(name, tensor, quantize=False):
        array = tensor.detach().float().numpy()
        kind = embedding if name == "token_embd.weight" else quant if quantize and quantized else None
        if kind in ("F16", "BF16"):
            data, raw = gguf.quants.quantize(array, gguf.GGMLQuantizationType[kind]), gguf.GGMLQuantizationType[kind]
            writer.add_tensor(name, data, raw_dtype=raw)
        elif kind is not None:
            data, raw = quantized_tensor(array, kind, seed=len(name) + sum(map(ord, name)))
            writer.add_tensor(name, data, raw_dtype=raw)
        else:
            writer.add_tensor(name, array)

    def norm(weight):  # llama.cpp stores Gemma's norms as the 1 + weight they scale by
        return weight + 1 if gemma else weight

    add("token_embd.weight", model.model.embed_tokens.weight)
    for index, layer in enumerate(model.model.layers):
        attention, mlp, prefix = layer.self_attn, layer.mlp, f"blk.{index}"
        add(f"{prefix}.attn_norm.weight", norm(layer.input_layernorm.weight))
        add(f"{prefix}.attn_q.weight", permute(attention.q_proj.weight, config.num_attention_heads), True)
        add(f"{prefix}.attn_k.weight", permute(attention.k_proj.weight, config.num_key_value_heads), True)
        add(f"{prefix}.attn_v.weight", attention.v_proj.weight, True)
        for part in ("q", "k", "v"):
            bias = getattr(attention, f"{part}_proj").bias
            if bias is not None:
                add(f"{prefix}.attn_{part}.bias", bias)
        if hasattr(attention, "q_norm"):
            add(f"{prefix}.attn_q_norm.weight", norm(attention.q_norm.weight))
            add(f"{prefix}.attn_k_norm.weight", norm(attention.k_norm.weight))
        add(f"{prefix}.attn_output.weight", attention.o_proj.weight, True)
        if gemma:
            add(f"{prefix}.post_attention_norm.weight", norm(layer.post_attention_layernorm.weight))
            add(f"{prefix}.ffn_norm.weight", norm(layer.pre_feedforward_layernorm.weight))
            add(f"{prefix}.post_ffw_norm.weight", norm(layer.post_feedforward_layernorm.weight))
        else:
            add(f"{prefix}.ffn_norm.weight", layer.post_attention_layernorm.weight)
        add(f"{prefix}.ffn_gate.weight", mlp.gate_proj.weight, True)
        add(f"{prefix}.ffn_up.weight", mlp.up_proj.weight, True)
        add(f"{prefix}.ffn_down.weight", mlp.down_proj.weight, True)
    add("output_norm.weight", norm(model.model.norm.weight))
    if not gemma:  # Gemma's output is its embedding (tied): llama.cpp writes it once
        add("output.weight", model.lm_head.weight, True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="session")
def tiny_gguf(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny Llama of `tiny_model_dir` as a GGUF file (Q8_0 projections), written with the gguf package."""
    pytest.importorskip("gguf")
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.Q8_0.gguf", tiny_model_dir)


def cache_contents(directory: Path) -> list[Path]:
    """What a cache directory holds besides its token file (cache_ownership.py), in name order."""
    from gali_cli.cache_ownership import TOKEN_FILE

    return sorted(path for path in directory.iterdir() if path.name != TOKEN_FILE)


_KILLED_WRITE = """
import os, signal, sys
from pathlib import Path
from gali_cli.cache_ownership import workspace

with workspace(Path(sys.argv[1]), sys.argv[2]) as folder:
    (folder / ".tmpKILLED").write_bytes(bytes(int(sys.argv[3])))  # as safetensors names the file it writes
    os.kill(os.getpid(), signal.SIGKILL)
"""


def backdate(*paths: Path) -> None:
    """As a minute later: a temporary is never judged in its first seconds (its writer may not hold its lock yet)."""
    for path in paths:
        os.utime(path, (time.time() - 60, time.time() - 60))


def killed_workspace(directory: Path, kind: str, size: int) -> Path:
    """The workspace of a `kind` cache's write in `directory` that kill -9 stopped with `size` bytes written."""
    from gali_cli.cache_ownership import TOKEN_FILE

    directory.mkdir(parents=True, exist_ok=True)
    before = set(directory.iterdir())
    killed = subprocess.run([sys.executable, "-c", _KILLED_WRITE, str(directory), kind, str(size)],
                            capture_output=True, timeout=120)
    assert killed.returncode == -9, killed.stderr
    (folder,) = set(directory.iterdir()) - before - {directory / TOKEN_FILE}
    backdate(folder)
    return folder


@pytest.fixture
def running_workspace():
    """The workspace of a write that a running gali (here, this process) is making, `size` bytes so far."""
    from gali_cli.cache_ownership import workspace

    with ExitStack() as stack:
        def writing(directory: Path, kind: str, size: int) -> Path:
            directory.mkdir(parents=True, exist_ok=True)
            folder = stack.enter_context(workspace(directory, kind))
            (folder / "part").write_bytes(bytes(size))
            backdate(folder)
            return folder

        yield writing
