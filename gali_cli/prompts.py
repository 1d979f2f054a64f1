"""The prompts gali sends: the document first, then the instruction, so that every question about one document
shares the same token prefix (and its prefilled state can be reused)."""

SUMMARIZE = "Summarize the document above."
ASK = "Answer this question about the document above: {question}"


def ask_instruction(question: str) -> str:
    return ASK.format(question=question.strip())


def chat_messages(document: str, instruction: str, system: str | None = None) -> list[dict[str, str]]:
    """Messages for a chat template: optional system prompt, then one user turn holding document and instruction."""
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": f"{document}\n\n{instruction}"})
    return messages


def prompt_ids(tokenizer, document: str, instruction: str, system: str | None = None) -> list[int]:
    """Token ids of the prompt: through the model's chat template when it has one, else plain text."""
    if tokenizer.chat_template:
        messages = chat_messages(document, instruction, system)
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))
    preamble = f"{system}\n\n" if system else ""
    return tokenizer(f"{preamble}{document}\n\n{instruction}\n").input_ids
