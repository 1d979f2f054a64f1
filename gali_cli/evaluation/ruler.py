"""RULER's synthetic tasks (Hsieh et al. 2024, github.com/NVIDIA/RULER), generated offline and deterministically.

Every task is built to RULER's published recipe, so that scores are comparable with RULER's: the task parameters are
scripts/synthetic.yaml's, the prompt templates and answer prefixes scripts/data/synthetic/constants.py's, the needle
formats and haystacks niah.py's, variable_tracking.py's, common_words_extraction.py's and freq_words_extraction.py's,
the metrics scripts/eval/synthetic/constants.py's. The code is gali's own. Where gali differs, on purpose:
- the essay haystack is public-domain prose (haystack.default_text) or the user's `--haystack`, not Paul Graham's;
- needles sit at depths spread evenly over the samples (haystack.spread_depths), not drawn at random;
- the prompt is split where RULER's template puts "\\n" before the question: gali asks the question after the
  document and a blank line, as `gali ask` does (so the document's state is the same as `gali ask`'s);
- a sample's length counts the model's chat template, as RULER's `model_template_token` does.
"""

import math
import random
import string
import uuid
from dataclasses import dataclass
from functools import cache, partial
from importlib import resources

from ..errors import ConfigError
from . import haystack
from .sample import Request, Sample
from .scoring import string_match_all

# scripts/data/synthetic/constants.py (template, answer_prefix, tokens_to_generate); the "\n" before the question is
# where gali cuts the prompt into document and question.
NIAH = ("Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. I will "
        "quiz you about the {type_needle_v} afterwards.\n{context}",
        "What are all the special magic {type_needle_v} for {query} mentioned in the provided text?",
        " The special magic {type_needle_v} for {query} mentioned in the provided text are")
VT = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}",
      "Question: Find all variables that are assigned the value {query} in the text above.",
      " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are assigned "
      "the value {query}, they are: ")
CWE = ("Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones "
       "that appear most often.\n{context}",
       "Question: What are the 10 most common words in the above list?",
       " Answer: The top 10 words that appear most often in the list are:")
FWE = ("Read the following coded text and track the frequency of each coded word. Find the three most frequently "
       "appeared coded words. {context}",
       "Question: Do not provide any explanation. Please ignore the dots '....'. What are the three most frequently "
       "appeared words in the above coded text?",
       " Answer: According to the coded text above, the three most frequently appeared words are:")
# niah.py and variable_tracking.py
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


@dataclass(frozen=True)
class Niah:
    """One of RULER's needle-in-a-haystack configurations (scripts/synthetic.yaml)."""

    haystack: str  # noise | essay | needle (distractor needles)
    key_kind: str  # words | numbers | uuids
    value_kind: str
    keys: int = 1
    values: int = 1
    queries: int = 1


@cache
def _words() -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """wonderwords' noun, adjective and verb lists, which RULER draws its keys and common words from."""
    folder = resources.files("wonderwords") / "assets"
    return tuple(tuple(sorted(set((folder / f"{name}list.txt").read_text().split())))
                 for name in ("noun", "adjective", "verb"))


def _draw(kind: str, rng: random.Random) -> str:
    """A needle's key or value as niah.py draws them: an adjective-noun pair, a 7-digit number, or a UUID4."""
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    nouns, adjectives, _ = _words()
    return f"{rng.choice(adjectives)}-{rng.choice(nouns)}"


def _rng(request: Request, task: str, length: int, index: int) -> random.Random:
    return random.Random(f"{request.seed}/{task}/{length}/{index}")


def _sample(task: str, length: int, index: int, max_new_tokens: int, document: str, question: str, prefix: str,
            references: list[str]) -> Sample:
    refs = tuple(references)
    return Sample(task=task, id=f"{length}-{index}", context=document, question=question, references=refs,
                  score=partial(string_match_all, references=refs), max_new_tokens=max_new_tokens,
                  answer_prefix=prefix, length=length, query=question.removeprefix("Question: "))


def niah(config: Niah, task: str, request: Request, length: int, index: int, units: int) -> Sample:
    """niah.py's sample with `units` haystack units: needles "One of the special magic ... for KEY is: VALUE."."""
    rng = _rng(request, task, length, index)
    keys = max(config.keys, config.queries)
    kind = config.value_kind
    head, question, prefix = NIAH
    if config.queries * config.values == 1:  # niah.py's singular wording
        head, question, prefix = (part.replace("Some", "A").replace("are all", "is").replace("are", "is")
                                  .replace("answers", "answer") for part in NIAH)
        kind = kind[:-1]
    names: list[str] = []
    while len(names) < keys:
        name = _draw(config.key_kind, rng)
        names += [name] if name not in names else []
    values = [[_draw(config.value_kind, rng) for _ in range(config.values)] for _ in names]
    needles = [NEEDLE.format(type_needle_v=config.value_kind, key=name, value=value)  # plural, as niah.py has it
               for name, row in zip(names, values) for value in row]
    rng.shuffle(needles)
    asked = rng.sample(range(keys), config.queries)
    answers = [value for key in asked for value in values[key]]
    query = names[asked[0]] if len(asked) == 1 else ", ".join(names[key] for key in asked[:-1]) + \
        ", and " + names[asked[-1]]
    depths = haystack.spread_depths(index, request.samples, len(needles))
    kind_of_haystack = "essay" if request.haystack is not None and config.haystack == "noise" else config.haystack
    if kind_of_haystack == "essay":
        text = haystack.insert_at_depths(haystack.cycled(_essay(request), units), needles, depths)
        context = " ".join(text)
    else:
        if kind_of_haystack == "noise":
            filler = [NOISE] * units
        else:  # distractors: other keys' needles, never one of the real keys
            distractors = random.Random(f"{request.seed}/{task}/{length}/{index}/distractors")
            filler = []
            while len(filler) < units:
                name = _draw(config.key_kind, distractors)
                if name not in names:
                    filler.append(NEEDLE.format(type_needle_v=config.value_kind, key=name,
                                                value=_draw(config.value_kind, distractors)))
        context = "\n".join(haystack.insert_at_depths(filler, needles, depths))
    fill = {"type_needle_v": kind, "query": query}
    return _sample(task, length, index, 128, head.format(context=context, **fill), question.format(**fill),
                   prefix.format(**fill), answers)


def _essay(request: Request) -> tuple[str, ...]:
    return haystack.sentences(request.haystack if request.haystack is not None else haystack.default_text())


def _chain(rng: random.Random, letters: int, hops: int) -> tuple[list[str], list[str]]:
    """variable_tracking.py's chain: distinct upper-case names, the first assigned a 5-digit value, each next one the
    one before ("VAR B = VAR A ", trailing space as RULER writes it)."""
    names: list[str] = []
    while len(names) < hops + 1:
        name = "".join(rng.choices(string.ascii_uppercase, k=letters))
        names += [name] if name not in names else []
    statements = [f"VAR {names[0]} = {rng.randint(10000, 99999)}"]
    statements += [f"VAR {names[hop + 1]} = VAR {names[hop]} " for hop in range(hops)]
    return names, statements


def _vt_text(statements: list[str], filler: list[str], depths: list[float], essay: bool) -> str:
    if essay:
        return " ".join(haystack.insert_at_depths(filler, [s.strip() + "." for s in statements], depths))
    return "\n".join(haystack.insert_at_depths(filler, statements, depths)).replace(". \n", ".\n")


def _vt_example(rng: random.Random, units: int) -> str:
    """RULER's worked example before a vt sample: a chain of 3-letter names in `units` noise lines, the question,
    the answer prefix and the answer (variable_tracking.py fits it to 500 tokens, then renames it per sample)."""
    head, question, prefix = VT
    hops = 4
    names, statements = _chain(rng, 3, hops)
    value = statements[0].split("=")[-1].strip()
    return (head.format(context=_vt_text(statements, [NOISE] * units, haystack.spread_depths(0, 1, hops + 1), False))
            + "\n" + question.format(query=value) + prefix.format(num_v=hops + 1, query=value) + " " + " ".join(names)
            + "\n")


def vt(task: str, request: Request, length: int, index: int, units: int, example_units: int = 0) -> Sample:
    """variable_tracking.py's sample (1 chain, 4 hops, noise haystack) after its worked example (`_vt_example`)."""
    rng = _rng(request, task, length, index)
    head, question, prefix = VT
    hops = 4
    example = _vt_example(rng, example_units)
    names, statements = _chain(rng, 5, hops)
    value = statements[0].split("=")[-1].strip()
    essay = request.haystack is not None
    filler = haystack.cycled(_essay(request), units) if essay else [NOISE] * units
    context = _vt_text(statements, filler, haystack.spread_depths(index, request.samples, hops + 1), essay)
    return _sample(task, length, index, 30, example + "\n" + head.format(context=context), question.format(query=value),
                   prefix.format(num_v=hops + 1, query=value), names)


def _numbered(words: list[str]) -> str:
    return " ".join(f"{number}. {word}" for number, word in enumerate(words, 1))


def cwe(task: str, request: Request, length: int, index: int, units: int) -> Sample:
    """common_words_extraction.py's sample: `units` distinct words, the first 10 repeated 30 times and the rest 3
    (6 and 1 below 4096 tokens), numbered and shuffled, after one worked example."""
    rng = _rng(request, task, length, index)
    nouns, adjectives, verbs = _words()
    vocabulary = sorted(set(nouns + adjectives + verbs))
    head, question, prefix = CWE
    short = length < 4096
    shots = []
    for words, common, rare in [(20, 3, 1) if short else (40, 10, 3), (units + 10, 6, 1) if short else
                                (units + 10, 30, 3)]:
        if words > len(vocabulary):
            raise ConfigError(f"--lengths {length}: cwe needs more distinct words than its vocabulary has")
        chosen = rng.sample(vocabulary, words)
        listed = chosen[:10] * common + chosen[10:] * rare
        rng.shuffle(listed)
        shots.append((_numbered(listed), chosen[:10]))
    (example, example_answer), (context, answer) = shots
    document = (head.format(context=example) + "\n" + question + prefix + " " + _numbered(example_answer) + "\n"
                + head.format(context=context))
    return _sample(task, length, index, 120, document, question, prefix, answer)


def fwe(task: str, request: Request, length: int, index: int, units: int) -> Sample:
    """freq_words_extraction.py's sample: `units` words of 6 random letters drawn from a Zipf law (alpha 2) over a
    vocabulary of (length - 50) / 50 words, the most frequent one being '...' (noise); the answer is the next three."""
    rng = _rng(request, task, length, index)
    size = max((length - 50) // 50, 4)  # RULER: (max_seq_length - tokens_to_generate) // 50
    vocabulary: set[str] = set()
    while len(vocabulary) < size:
        vocabulary.add("".join(rng.choices(string.ascii_lowercase, k=6)))
    ranked = sorted(vocabulary)
    rng.shuffle(ranked)
    ranked[0] = "..."
    zeta = math.pi ** 2 / 6  # zeta(2)
    words = [word for rank, word in enumerate(ranked, 1) for _ in range(int(units * rank ** -2.0 / zeta))]
    rng.shuffle(words)
    head, question, prefix = FWE
    return _sample(task, length, index, 50, head.format(context=" ".join(words)), question, prefix, ranked[1:4])


NIAH_TASKS = {
    "niah_single_1": Niah("noise", "words", "numbers"),
    "niah_single_2": Niah("essay", "words", "numbers"),
    "niah_single_3": Niah("essay", "words", "uuids"),
    "niah_multikey_1": Niah("essay", "words", "numbers", keys=4),
    "niah_multikey_2": Niah("needle", "words", "numbers"),
    "niah_multikey_3": Niah("needle", "uuids", "uuids"),
    "niah_multivalue": Niah("essay", "words", "numbers", values=4),
    "niah_multiquery": Niah("essay", "words", "numbers", queries=4),
}


def build(task: str, request: Request) -> list[Sample]:
    """`request.samples` samples of RULER task `task` at each length, each fitted to its length (prompt and answer
    budget within the target, as RULER's generators fit them)."""
    if task in NIAH_TASKS:
        make = partial(niah, NIAH_TASKS[task])
    elif task == "vt":
        make = vt
    else:
        make = {"cwe": cwe, "fwe": fwe}[task]
    samples = []
    for length in request.lengths:
        if task == "vt":  # RULER fits its worked example to 500 tokens
            example = haystack.fit(lambda units: _sample(task, 500, 0, 0, _vt_example(random.Random(0), units), "",
                                                         "", ["-"]), request.prompt_tokens, 500, task, 500)
            make = partial(vt, example_units=example.context.count(NOISE))
        for index in range(request.samples):
            first = make(task, request, length, index, 0)
            budget = length - first.max_new_tokens
            samples.append(haystack.fit(partial(make, task, request, length, index), request.prompt_tokens, budget,
                                        task, length))
    return samples
