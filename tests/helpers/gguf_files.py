"""GGUF files written at test time with the gguf package's own writer, laid out as llama.cpp's converter lays them
out."""

import json
from pathlib import Path

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
