"""The prompts gali sends: the document first, then the instruction, so that every question about one document
shares the same token prefix, and its prefilled state can be reused (`gali chat`, the document cache).

Prompts are tokenized piece by piece: the chat template is rendered around placeholders, and each message's text is
tokenized with the template text before it, which is how the template's own tokenization cuts them (for ordinary
text the ids are exactly the template's). Two things follow. A message that spells a control token such as
"<|eot_id|>" keeps it as characters: its text is then tokenized apart, so only the template can end a turn. And the
first `document_end` tokens depend only on the system prompt and the document, never on what follows; with the blank
line after the document, up to `question_start`, they are the prefix every question about the document shares,
whose prefilled state can be reused (and the one `gali serve` cuts the same message at, served_prompt).
"""

import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import NamedTuple

from .errors import InputError, ModelLoadError
from .model.chat_template import render_chat_template

SUMMARIZE = "Summarize the document above."
# How `gali ask` puts its question after the document; `gali eval --prompt-style` measures each. "plain" is the
# question alone, as a client of `gali serve` sends it. ASK_STYLE scored best on SmolLM2-135M
# (docs/notes/2026-11-28-ask-wrappers.md). None holds a line break: gali serve also cuts a message after its last
# one (question_starts), and the document state gali ask stores must be one it finds.
ASK_STYLES = {"plain": "{question}", "wrapped": "Answer this question about the document above: {question}",
              "brief": "Answer briefly from the document above. Question: {question}"}
ASK_STYLE = "brief"
_SLOT = "\x00gali-slot-{}\x00"  # stands for a message's text while the chat template is rendered
PIECE_CHARACTERS = 2**20  # text tokenized at once, at most (pieces): the Rust tokenizer sets aside 16 bytes a byte
_SEAM_CONTEXT = 256  # characters either side of a seam tokenized to check that cutting there changes no token
_SEAM_TRIES = 32  # places looked at for a seam in each piece
MIN_CUT_GAP = 64  # tokens, at least, between two places a served prompt's prefill ends a forward (_spaced)...
FREE_CUTS = 16  # ...after its first FREE_CUTS, which may be closer (a system prompt, a short document, a question)


class Prompt(NamedTuple):
    """Token ids of a prompt, how many of them depend only on the system prompt and the document, and where the first
    instruction starts: after the blank line that follows the document, where `gali serve` cuts the same message
    (served_prompt, question_starts), and where the document's state ends (conversation.py)."""

    ids: list[int]
    document_end: int
    question_start: int


def ask_instruction(question: str, style: str = ASK_STYLE) -> str:
    """The instruction that follows the document for `gali ask`: `question` in one of ASK_STYLES."""
    return ASK_STYLES[style].format(question=question.strip())


def chat_messages(document: str, instruction: str, system: str | None = None) -> list[dict[str, str]]:
    """Messages for a chat template: optional system prompt, then one user turn holding document and instruction."""
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": f"{document.strip()}\n\n{instruction}"})
    return messages


def check_prompt_length(tokens: int, limit: int | None, name: str) -> None:
    """InputError when a prompt of `tokens` passes `limit` (--max-prompt-tokens; None: no bound), before any forward."""
    if limit is not None and tokens > limit:
        raise InputError(f"{name}: the prompt has {tokens:,} tokens, more than the {limit:,} gali reads here "
                         f"{_BOUND_SOURCE}")


def check_prompt_characters(tokenizer, characters: int, limit: int | None, name: str) -> None:
    """InputError when a prompt of `characters` characters surely has more than `limit` tokens, before any of it is
    tokenized: no token stands for more characters than the tokenizer's longest entry (`longest_token`), as `gali
    serve` counts. A 200 MB text was tokenized whole (320 s, 4.8 GB) before the token count refused it."""
    longest = longest_token(tokenizer) if limit is not None else 1
    if limit is not None and characters > limit * longest:
        raise InputError(f"{name}: the prompt has {characters:,} characters, so at least {-(-characters // longest):,} "
                         f"tokens (none of this model's stands for more than {longest} characters), more than the "
                         f"{limit:,} gali reads here {_BOUND_SOURCE}")


_BOUND_SOURCE = ("(--max-prompt-tokens or GALI_MAX_PROMPT_TOKENS; by default, what half the free memory holds of "
                 "their keys and values)")


_longest: "weakref.WeakKeyDictionary[object, int]" = weakref.WeakKeyDictionary()


def longest_token(tokenizer) -> int:
    """The most characters one token of `tokenizer` stands for: its longest vocabulary entry (a byte-level entry
    has a character per byte, so it bounds the text's characters too), at least 1; worked out once per tokenizer."""
    if tokenizer not in _longest:
        _longest[tokenizer] = max(map(len, _entries(tokenizer)), default=1) or 1
    return _longest[tokenizer]


def _entries(tokenizer) -> Iterable[str]:
    """The vocabulary's entries one at a time: from the Rust tokenizer by id where there is one, as transformers
    numbers them (0 to len - 1), since `get_vocab`'s dict of Gemma 3's 262,144 entries costs 40 MB that stay with the
    process; else `get_vocab`'s keys."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return tokenizer.get_vocab()
    return (backend.id_to_token(index) or "" for index in range(backend.get_vocab_size(with_added_tokens=True)))


def text_ids(tokenizer, text: str, add_special_tokens: bool = False) -> list[int]:
    """Token ids of user text, where a literal "<|eot_id|>" is just characters, never a control token; a long text
    is tokenized in pieces (long_ids), with the tokenizer's special tokens (BOS) around them all if asked."""
    ids = long_ids(tokenizer, text, split_special_tokens=True)
    if not add_special_tokens:
        return ids
    marked, plain = (tokenizer("a", add_special_tokens=special).input_ids for special in (True, False))
    start = next((index for index in range(len(marked)) if marked[index:index + len(plain)] == plain), len(marked))
    return marked[:start] + ids + marked[start + len(plain):]


def long_ids(tokenizer, text: str, split_special_tokens: bool = False) -> list[int]:
    """Token ids of `text` without special tokens added, the same as in one call, tokenized a piece at a time
    (text_pieces): in one call the Rust tokenizer sets aside 16 bytes per byte of text before it starts, and a
    200 MB document made it abort the process (a failed allocation of 3.2 GB)."""
    ids: list[int] = []
    with _memory_for(text):
        for piece in text_pieces(tokenizer, text, split_special_tokens):
            ids += tokenizer(piece, add_special_tokens=False, split_special_tokens=split_special_tokens).input_ids
    return ids


@contextmanager
def _memory_for(text: str) -> Iterator[None]:
    """InputError for a MemoryError while `text` is tokenized: Python's list of its ids (about 40 bytes a token)
    outgrew the memory; the Rust tokenizer's pieces are small."""
    try:
        yield
    except MemoryError:
        raise InputError(f"a text of {len(text):,} characters is too long to tokenize in the memory available: give "
                         "a shorter document") from None


def text_pieces(tokenizer, text: str, split_special_tokens: bool = False, size: int | None = None
                ) -> Iterator[str]:
    """`text` in pieces of at most about `size` characters (None: PIECE_CHARACTERS), cut only where tokenizing the
    pieces apart (with `split_special_tokens` as given) gives the ids of tokenizing them together: after a line break
    before a non-blank character, else before a space between two words, where no pre-token of a Llama, GPT-2 or
    SmolLM tokenizer crosses; each seam is checked on the text around it. Where none is found (no such place, or a
    tokenizer that adds text at a sequence's start such as SentencePiece's "▁") the rest is one piece."""
    size, start = size or PIECE_CHARACTERS, 0
    while len(text) - start > size:
        seam = _seam(tokenizer, text, start + size // 2, start + size, split_special_tokens)
        if seam is None:
            break
        yield text[start:seam]
        start = seam
    yield text[start:]


def _seam(tokenizer, text: str, low: int, high: int, split_special_tokens: bool) -> int | None:
    """The last place in text[low:high] that text_pieces may cut at, or None."""
    for candidates in (_after_line_breaks(text, low, high), _before_spaces(text, low, high)):
        for _, seam in zip(range(_SEAM_TRIES), candidates):
            left, right = text[max(0, seam - _SEAM_CONTEXT):seam], text[seam:seam + _SEAM_CONTEXT]
            ids = [tokenizer(part, add_special_tokens=False, split_special_tokens=split_special_tokens).input_ids
                   for part in (left + right, left, right)]
            if ids[0] == ids[1] + ids[2]:
                return seam
    return None


def _after_line_breaks(text: str, low: int, high: int) -> Iterator[int]:
    found = text.rfind("\n", low, high - 1)
    while found >= 0:
        if not text[found + 1].isspace():
            yield found + 1
        found = text.rfind("\n", low, found)


def _before_spaces(text: str, low: int, high: int) -> Iterator[int]:
    found = text.rfind(" ", max(low, 1), high - 1)
    while found >= 0:
        if not text[found - 1].isspace() and not text[found + 1].isspace():
            yield found
        found = text.rfind(" ", max(low, 1), found)


def prompt_ids(tokenizer, document: str, instruction: str, system: str | None = None) -> Prompt:
    """The prompt of `gali summarize` and `gali ask`: one user turn, the document then the instruction."""
    return conversation_ids(tokenizer, document, [instruction], [], system)


def conversation_ids(
    tokenizer, document: str, questions: list[str], answers: list[list[int]], system: str | None = None,
    chat: bool = True,
) -> Prompt:
    """Token ids of a conversation about `document`, ending where the model answers the last question.

    The first user turn holds the document and the first instruction; later turns hold one question each.
    `answers` are the token ids the model generated for all questions but the last, reused as they are, so the ids
    of turn n are a prefix of those of turn n + 1 (no re-tokenization of what is already in the cache).
    Without `chat` the chat template is left out even where the model has one, and the prompt is BOS, the document
    and the first instruction exactly as given, joined with nothing between them: the raw text prompt some
    benchmarks use (LongBench's trec, samsum, lcc..., whose questions carry their own separator).
    """
    if len(answers) != len(questions) - 1:
        raise ValueError(f"{len(questions)} questions need {len(questions) - 1} answers, got {len(answers)}")
    document = document.strip() if chat else document
    turns: list[tuple[str, str | list[int]]] = [("system", system)] if system else []  # (role, text or ids)
    for index, question in enumerate(questions):
        turns.append(("user", question))
        if index < len(answers):
            turns.append(("assistant", answers[index]))
    first_user = 1 if system else 0
    specials = [token.content for token in tokenizer.added_tokens_decoder.values() if token.special]

    if not tokenizer.chat_template or not chat:
        ids = text_ids(tokenizer, f"{system}\n\n" if system else "", add_special_tokens=True)
        after = f"\n\n{questions[0]}\n" if chat else questions[0]
        document_ids, ends = _document_turn(tokenizer, "", document, after, specials)
        document_end, question_start = (len(ids) + end for end in ends)
        ids += document_ids
        for role, content in turns[first_user + 1:]:
            ids += content if role == "assistant" else text_ids(tokenizer, f"\n\n{content}\n")
        return Prompt(ids, document_end, question_start)

    parts = template_parts(tokenizer, [role for role, _ in turns])
    ids, document_end, question_start = [], 0, 0
    for index, ((role, content), template_part) in enumerate(zip(turns, parts)):
        if role == "assistant":
            ids += tokenizer(template_part, add_special_tokens=False).input_ids + content
        elif index == first_user:
            turn_ids, ends = _document_turn(tokenizer, template_part, document, f"\n\n{content}", specials)
            document_end, question_start = (len(ids) + end for end in ends)
            ids = ids + turn_ids
        elif any(special in content for special in specials):
            ids += tokenizer(template_part, add_special_tokens=False).input_ids + text_ids(tokenizer, content)
        else:  # together, as the template's own tokenization cuts them
            ids += tokenizer(template_part + content, add_special_tokens=False).input_ids
    return Prompt(ids + tokenizer(parts[-1], add_special_tokens=False).input_ids, document_end, question_start)


def template_parts(tokenizer, roles: list[str]) -> list[str]:
    """The chat template's own text before each message and after the last one (len(roles) + 1 pieces).

    The template is rendered around placeholders, so that each message's text can be tokenized apart, within
    bounds of time and memory (model/chat_template.py); raises ModelLoadError naming the model when the template fails,
    refuses the roles or leaves a message out.
    """
    slotted = [{"role": role, "content": _SLOT.format(index)} for index, role in enumerate(roles)]
    rendered = render_chat_template(tokenizer, slotted, add_generation_prompt=True)
    parts, start = [], 0
    for index, role in enumerate(roles):  # each slot found after the last: linear in the rendered text
        slot = _SLOT.format(index)
        found = rendered.find(slot, start)
        if found < 0:
            raise ModelLoadError(f"cannot use model {str(tokenizer.name_or_path)!r}: the model's chat template "
                                 f"leaves out message {index} (role {role!r})")
        parts.append(rendered[start:found])
        start = found + len(slot)
    return [*parts, rendered[start:]]


class ServedPrompt(NamedTuple):
    """Token ids of a prompt a client sent (`gali serve`), and where its prefill ends a forward.

    A forward always ends after each message, and where a question may follow a document inside one (see
    `question_starts`): with GALI the keys and values of the tokens before a cut depend on where the forwards
    ended, so requests that share their tokens and cuts up to a point share their prefilled state up to it.
    """

    ids: list[int]
    cuts: list[int]  # sorted token indices in (0, len(ids)]; the last one is len(ids)
    shared: int  # the last cut before the last message ends: what the next question is likely to share (or 0)


def question_starts(text: str) -> list[int]:
    """Character offsets in a message where a question may follow a document: after its last blank line and after
    its last line break ("document\n\nquestion", or `llm`'s "document\n question")."""
    text = text.rstrip()
    starts = {text.rfind("\n\n") + 2 if "\n\n" in text else 0, text.rfind("\n") + 1}
    return sorted(start for start in starts if 0 < start < len(text))


def served_parts(tokenizer, roles: list[str]) -> tuple[list[str], bool]:
    """The pieces a served chat prompt sets its messages between, and whether the first gets the tokenizer's special
    tokens: the chat template's (template_parts), or without one, blank lines after BOS."""
    if tokenizer.chat_template:
        return template_parts(tokenizer, roles), False
    return ["", *["\n\n"] * (len(roles) - 1), "\n"], True


def served_prompt(tokenizer, parts: list[str], texts: list[str], text_cuts: list[list[int]], bos: bool = False,
                  check: Callable[[], None] = lambda: None) -> ServedPrompt:
    """Messages `texts` set between the template pieces `parts` (template_parts; without a chat template, blank
    lines), cut after each message and at the character offsets `text_cuts` in it. With `bos`, the first piece gets
    the tokenizer's special tokens. A message that spells a special token keeps it as characters.

    Each message is tokenized once, and once more for each of its cuts (a few: see Message.cuts), so the time
    is linear in the prompt; `check` runs before each message and raises to stop (a request cancelled meanwhile).
    """
    specials = [token.content for token in tokenizer.added_tokens_decoder.values() if token.special]
    ids, cuts = [], []
    for index, (part, text, offsets) in enumerate(zip(parts, texts, text_cuts)):
        check()
        special = bos and index == 0
        if any(name in text for name in specials):
            head = tokenizer(part, add_special_tokens=special).input_ids if part or special else []
            body = text_ids(tokenizer, text)
            piece, ends = head + body, [len(head) + _common_prefix(body, text_ids(tokenizer, text[:offset]))
                                        for offset in offsets]
        else:  # together, as the template's own tokenization cuts them
            piece = tokenizer(part + text, add_special_tokens=special).input_ids
            ends = [_common_prefix(piece, tokenizer(part + text[:offset], add_special_tokens=special).input_ids)
                    for offset in offsets]
        cuts += [len(ids) + end for end in ends] + [len(ids) + len(piece)]
        ids += piece
    last_message_end = len(ids)
    ids += tokenizer(parts[-1], add_special_tokens=False).input_ids
    cuts = _spaced(sorted(set(cuts)), len(ids))
    return ServedPrompt(ids, cuts, max((cut for cut in cuts if cut < last_message_end), default=0))


def _spaced(cuts: list[int], end: int) -> list[int]:
    """`cuts` (sorted), the first FREE_CUTS of them, then the others kept MIN_CUT_GAP tokens apart at least, left to
    right; then `end`. A forward attends to the whole cache, so one per cut of a prompt of thousands of short
    messages would make its prefill quadratic in them; whether a cut is kept depends only on the cuts before it, so
    prompts that share a prefix keep the same cuts in it, and share its prefilled state."""
    kept, last = [], 0
    for cut in cuts:
        if (len(kept) < FREE_CUTS or cut - last >= MIN_CUT_GAP) and cut < end:
            kept.append(cut)
            last = cut
    return [*kept, end]


def raw_prompt(tokenizer, text: str) -> ServedPrompt:
    """A plain-text prompt (/v1/completions) as the model reads raw text: special tokens spelled in it are parsed,
    the tokenizer's own (BOS) added; cut where a question may follow a document."""
    ids = tokenizer(text, add_special_tokens=True).input_ids
    ends = [_common_prefix(ids, tokenizer(text[:offset], add_special_tokens=True).input_ids)
            for offset in question_starts(text)]
    cuts = sorted({end for end in [*ends, len(ids)] if end > 0})
    return ServedPrompt(ids, cuts, max((cut for cut in cuts if cut < len(ids)), default=0))


def _document_turn(tokenizer, template_part: str, document: str, after: str, specials: list[str]
                   ) -> tuple[list[int], tuple[int, int]]:
    """Ids of template text, document and what follows it in the same turn (a blank line, then the question); how
    many of them depend on the template text and the document alone, and where the question starts.

    Ordinary text is tokenized as one, as the template's own tokenization would (in pieces that change no token,
    text_pieces, with the document's end in the last); the shared part ends where that and the document's own
    tokens part (a pre-token may span the document's end, as ".\n\n" does in Llama 3), and the question starts where
    it and the tokens of the document and the blank line part (as served_prompt cuts).
    Text that spells a special token is tokenized apart, as characters.
    """
    template_ids = tokenizer(template_part, add_special_tokens=False).input_ids if template_part else []
    if any(special in text for special in specials for text in (document, after)):
        document_ids = template_ids + text_ids(tokenizer, document)
        return document_ids + text_ids(tokenizer, after), (len(document_ids), len(document_ids))
    ids: list[int] = []
    last = None
    with _memory_for(document):
        for piece in text_pieces(tokenizer, template_part + document):  # all but the last piece tokenized once
            if last is not None:
                ids += tokenizer(last, add_special_tokens=False).input_ids
            last = piece
    together = tokenizer(last + after, add_special_tokens=False).input_ids
    alone = tokenizer(last, add_special_tokens=False).input_ids
    separator = after.index("\n\n") + 2 if after.startswith("\n\n") else 0  # a raw prompt's question follows at once
    blank = tokenizer(last + after[:separator], add_special_tokens=False).input_ids
    return ids + together, (len(ids) + _common_prefix(together, alone), len(ids) + _common_prefix(together, blank))


def _common_prefix(first: list[int], second: list[int]) -> int:
    """How many leading tokens two tokenizations share."""
    shared = 0
    for a, b in zip(first, second):
        if a != b:
            break
        shared += 1
    return shared
