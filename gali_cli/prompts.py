"""The prompts gali sends: the document first, then the instruction, so that every question about one document
shares the same token prefix (and its prefilled state can be reused)."""

SUMMARIZE = "Summarize the document above."
ASK = "Answer this question about the document above: {question}"
_SLOT = "\x00gali-slot-{}\x00"  # stands for a message's text while the chat template is rendered


def ask_instruction(question: str) -> str:
    """The instruction that follows the document for `gali ask`."""
    return ASK.format(question=question.strip())


def chat_messages(document: str, instruction: str, system: str | None = None) -> list[dict[str, str]]:
    """Messages for a chat template: optional system prompt, then one user turn holding document and instruction."""
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": f"{document}\n\n{instruction}"})
    return messages


def text_ids(tokenizer, text: str, add_special_tokens: bool = False) -> list[int]:
    """Token ids of user text, where a literal "<|eot_id|>" is just characters, never a control token."""
    return tokenizer(text, add_special_tokens=add_special_tokens, split_special_tokens=True).input_ids


def prompt_ids(tokenizer, document: str, instruction: str, system: str | None = None) -> list[int]:
    """Token ids of the prompt: through the model's chat template when it has one, else plain text.

    A document cannot end the user's turn by containing "<|eot_id|>": when a message's text spells a special
    token, the template is rendered around placeholders and only its own parts may produce special tokens.
    Otherwise the ids are exactly the template's own tokenization.
    """
    messages = chat_messages(document, instruction, system)
    if not tokenizer.chat_template:
        return text_ids(tokenizer, "\n\n".join(m["content"] for m in messages) + "\n", add_special_tokens=True)
    specials = [token.content for token in tokenizer.added_tokens_decoder.values() if token.special]
    if not any(special in message["content"] for message in messages for special in specials):
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))
    slots = [{**message, "content": _SLOT.format(index)} for index, message in enumerate(messages)]
    rendered = tokenizer.apply_chat_template(slots, add_generation_prompt=True, tokenize=False)
    ids = []
    for index, message in enumerate(messages):
        template_part, rendered = rendered.split(_SLOT.format(index), 1)
        ids += tokenizer(template_part, add_special_tokens=False).input_ids + text_ids(tokenizer, message["content"])
    return ids + tokenizer(rendered, add_special_tokens=False).input_ids
