"""The tiny random Llama the tests build (nothing is ever downloaded): its tokenizer, chat template and corpus, random
prompts of its vocabulary, and the model saved to disk (conftest's tiny_model_dir)."""

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

# The seam check's tiny random Llama: the tests' too.
from gali_cli.seam_check import VOCAB, tiny_model

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




def prompt(length: int, batch: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))
