"""LongBench v1 (Bai et al. 2024) from the user's local copy: the official prompts, generation lengths, middle
truncation, chat-template choice, stop rule and metrics, so that scores are comparable with the published tables.

The specification is THUDM/LongBench's (github.com/THUDM/LongBench, LongBench/config/dataset2prompt.json and
dataset2maxlen.json verbatim, pred.py's truncation, chat choice and samsum stop, eval.py's metrics); the code is
gali's own. The data is read from disk, never from the hub: the original release's jsonl files (data.zip:
`data/{dataset}.jsonl`, a question in `input`) or the parquet copy lm-evaluation-harness now loads
(Xnhyacinth/LongBench: `{dataset}/...parquet`, the question in `question`; reading it needs pyarrow).

Truncation (`truncation`):
- "official": pred.py's. A prompt longer than `max_length` tokens (counted with the tokenizer's special tokens, as
  `tokenizer(prompt)` counts them) keeps its first and last `max_length // 2` tokens, decoded without special tokens
  and joined; pred.py's `max_length` is the model's window less 500 (3500 for a 4k model), the caller's choice here.
- "paper": the GALI authors' (github.com/adlnlp/Gali, pred.py `longbench_pred_worker`): `max_length` is the window the
  method extends to (their `max_pe`, e.g. 16384) and the prompt budget is `max_length - max_new_tokens - 50`.

A sample's prompt is `context + "\\n\\n" + question` for the chat datasets (every template has "\\n\\n" after its
document, where gali asks the question, as `gali ask` does) and `context + question` for the six pred.py feeds raw
(trec, triviaqa, samsum, lsht, lcc, repobench-p): `prompt(sample)` joins them. The Chinese datasets scored on
jieba's word segmentation (dureader, multifieldqa_zh, vcsum) are refused; lsht and passage_retrieval_zh are not.
"""

import json
import re
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from ..errors import ConfigError, InputError
from ..extras import install_hint
from ..prompts import longest_token
from . import longbench_metrics
from .sample import Sample


@dataclass(frozen=True)
class Dataset:
    """One LongBench dataset: its generation length, metric (longbench_metrics.METRICS), whether the model's chat
    template wraps the prompt, whether only the answer's first line is scored, and its prompt template."""

    max_new_tokens: int
    metric: str
    chat: bool = True  # pred.py: "chat models are better off without build prompts on these tasks"
    first_line: bool = False  # eval.py scores trec, triviaqa, samsum and lsht on the answer's first line
    template: str = "{context}{input}"


# THUDM/LongBench LongBench/config/dataset2maxlen.json and dataset2prompt.json (verbatim: "asconcisely" included),
# eval.py's dataset2metric, pred.py's raw-prompt list.
DATASETS: dict[str, Dataset] = {
    "narrativeqa": Dataset(128, "qa_f1", template="You are given a story, which can be either a novel or a movie script, and a question. Answer the question asconcisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nStory: {context}\n\nNow, answer the question based on the story asconcisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:"),  # noqa: E501
    "qasper": Dataset(128, "qa_f1", template="You are given a scientific article and a question. Answer the question as concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered based on the information in the article, write \"unanswerable\". If the question is a yes/no question, answer \"yes\", \"no\", or \"unanswerable\". Do not provide any explanation.\n\nArticle: {context}\n\n Answer the question based on the above article as concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered based on the information in the article, write \"unanswerable\". If the question is a yes/no question, answer \"yes\", \"no\", or \"unanswerable\". Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:"),  # noqa: E501
    "multifieldqa_en": Dataset(64, "qa_f1", template="Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following question based on the above text, only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:"),  # noqa: E501
    "multifieldqa_zh": Dataset(64, "qa_f1_zh", template="阅读以下文字并用中文简短回答：\n\n{context}\n\n现在请基于上面的文章回答下面的问题，只告诉我答案，不要输出任何其他字词。\n\n问题：{input}\n回答："),  # noqa: E501
    "hotpotqa": Dataset(32, "qa_f1", template="Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:"),  # noqa: E501
    "2wikimqa": Dataset(32, "qa_f1", template="Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:"),  # noqa: E501
    "musique": Dataset(32, "qa_f1", template="Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:"),  # noqa: E501
    "dureader": Dataset(128, "rouge_zh", template="请基于给定的文章回答下述问题。\n\n文章：{context}\n\n请基于上述文章回答下面的问题。\n\n问题：{input}\n回答："),  # noqa: E501
    "gov_report": Dataset(512, "rouge", template="You are given a report by a government agency. Write a one-page summary of the report.\n\nReport:\n{context}\n\nNow, write a one-page summary of the report.\n\nSummary:"),  # noqa: E501
    "qmsum": Dataset(512, "rouge", template="You are given a meeting transcript and a query containing a question or instruction. Answer the query in one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the above meeting transcript in one or more sentences.\n\nQuery: {input}\nAnswer:"),  # noqa: E501
    "multi_news": Dataset(512, "rouge", template="You are given several news passages. Write a one-page summary of all news. \n\nNews:\n{context}\n\nNow, write a one-page summary of all the news.\n\nSummary:"),  # noqa: E501
    "vcsum": Dataset(512, "rouge_zh", template="下面有一段会议记录，请你阅读后，写一段总结，总结会议的内容。\n会议记录：\n{context}\n\n会议总结："),  # noqa: E501
    "trec": Dataset(64, "classification", chat=False, first_line=True, template="Please determine the type of the question below. Here are some examples of questions.\n\n{context}\n{input}"),  # noqa: E501
    "triviaqa": Dataset(32, "qa_f1", chat=False, first_line=True, template="Answer the question based on the given passage. Only give me the answer and do not output any other words. The following are some examples.\n\n{context}\n\n{input}"),  # noqa: E501
    "samsum": Dataset(128, "rouge", chat=False, first_line=True, template="Summarize the dialogue into a few short sentences. The following are some examples.\n\n{context}\n\n{input}"),  # noqa: E501
    "lsht": Dataset(64, "classification", chat=False, first_line=True, template="请判断给定新闻的类别，下面是一些例子。\n\n{context}\n{input}"),  # noqa: E501
    "passage_count": Dataset(32, "count", template="There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please carefully read these paragraphs and determine how many unique paragraphs there are after removing duplicates. In other words, how many non-repeating paragraphs are there in total?\n\n{context}\n\nPlease enter the final count of unique paragraphs after removing duplicates. The output format should only contain the number, such as 1, 2, 3, and so on.\n\nThe final answer is: "),  # noqa: E501
    "passage_retrieval_en": Dataset(32, "retrieval", template="Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which paragraph the abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n{input}\n\nPlease enter the number of the paragraph that the abstract is from. The answer format must be like \"Paragraph 1\", \"Paragraph 2\", etc.\n\nThe answer is: "),  # noqa: E501
    "passage_retrieval_zh": Dataset(32, "retrieval_zh", template="以下是若干段落文字，以及其中一个段落的摘要。请确定给定的摘要出自哪一段。\n\n{context}\n\n下面是一个摘要\n\n{input}\n\n请输入摘要所属段落的编号。答案格式必须是\"段落1\"，\"段落2\"等格式\n\n答案是："),  # noqa: E501
    "lcc": Dataset(64, "code_sim", chat=False, template="Please complete the code given below. \n{context}Next line of code:\n"),  # noqa: E501
    "repobench-p": Dataset(64, "code_sim", chat=False, template="Please complete the code given below. \n{context}{input}Next line of code:\n"),  # noqa: E501
}
# The 16 English datasets of the GALI paper's LongBench table, in its column order.
PAPER_DATASETS = ("narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "musique", "gov_report", "qmsum",
                  "multi_news", "trec", "triviaqa", "samsum", "passage_count", "passage_retrieval_en", "lcc",
                  "repobench-p")
# LongBench-E: the same prompts over length-balanced data, files named {dataset}_e.
E_DATASETS = ("qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "gov_report", "multi_news", "trec", "triviaqa",
              "samsum", "passage_count", "passage_retrieval_en", "lcc", "repobench-p")
TRUNCATIONS = ("official", "paper")
PAPER_MARGIN = 50  # the GALI authors keep max_pe - max_gen - 50 prompt tokens: room for the chat template
_SEPARATOR = "\n\n"


def dataset_spec(name: str) -> Dataset:
    """The dataset called `name` (a LongBench-E name ends in _e); ConfigError for one gali cannot run or score."""
    base = name.removesuffix("_e") if name.endswith("_e") and name.removesuffix("_e") in E_DATASETS else name
    if base not in DATASETS:
        raise ConfigError(f"unknown LongBench dataset {name!r}: gali knows {', '.join(DATASETS)} "
                          f"(and {', '.join(f'{e}_e' for e in E_DATASETS)})")
    spec = DATASETS[base]
    if spec.metric not in longbench_metrics.METRICS:
        raise ConfigError(f"LongBench {name} is scored on jieba's Chinese word segmentation, which gali does not "
                          "ship: run the official eval.py on its answers instead")
    return spec


def samples(data_dir: Path, dataset: str, tokenizer, max_length: int, truncation: str = "official",
            limit: int | None = None) -> list[Sample]:
    """The samples of one LongBench dataset read from `data_dir`, prompts truncated in the middle for `max_length`.

    `tokenizer` is the model's (a transformers tokenizer): the official truncation counts and cuts its tokens.
    InputError for missing or malformed data, ConfigError for an unknown dataset, truncation or budget.
    """
    spec = dataset_spec(dataset)
    longbench_metrics.require_libraries(spec.metric)
    budget = prompt_budget(spec, max_length, truncation)
    records = read_records(Path(data_dir), dataset)[:limit]
    return [_sample(dataset, spec, index, record, tokenizer, budget) for index, record in enumerate(records)]


def prompt_budget(spec: Dataset, max_length: int, truncation: str) -> int:
    """The prompt tokens a truncation keeps for a model run at `max_length`."""
    if truncation not in TRUNCATIONS:
        raise ConfigError(f"--truncation must be one of {', '.join(TRUNCATIONS)}; got {truncation!r}")
    budget = max_length if truncation == "official" else max_length - spec.max_new_tokens - PAPER_MARGIN
    if budget < 2:
        raise ConfigError(f"a LongBench prompt of at most {budget} tokens ({truncation} truncation at length "
                          f"{max_length}) cannot hold its first and last halves: choose a longer length")
    return budget


def truncate_middle(tokenizer, prompt: str, budget: int) -> str:
    """pred.py's middle truncation: a prompt over `budget` tokens (special tokens counted) keeps its first and last
    `budget // 2`, each decoded without special tokens, joined.

    A prompt surely over the budget by its characters alone has only its two ends tokenized: the characters the
    kept tokens can span (`longest_token` each), and a margin past them that a cut cannot reach through. Whole, a
    300 MB record made the Rust tokenizer abort the process (5.9 GB)."""
    half = budget // 2
    reach = half * longest_token(tokenizer) + max(_CUT_MARGIN, longest_token(tokenizer))
    if len(prompt) > 2 * reach:  # at least 2 * reach / longest > budget tokens
        first = tokenizer(prompt[:reach], truncation=False)["input_ids"][:half]
        last = tokenizer(prompt[-reach:], truncation=False)["input_ids"][-half:]
        return (tokenizer.decode(first, skip_special_tokens=True)
                + tokenizer.decode(last, skip_special_tokens=True))
    ids = tokenizer(prompt, truncation=False)["input_ids"]
    if len(ids) <= budget:
        return prompt
    return (tokenizer.decode(ids[:half], skip_special_tokens=True)
            + tokenizer.decode(ids[-half:], skip_special_tokens=True))


_CUT_MARGIN = 4096  # characters: tokenizing a text cut this far past the tokens kept changes none of them


def prompt(sample: Sample) -> str:
    """The whole prompt of a LongBench sample, as pred.py builds it (before any chat template)."""
    return sample.context + (_SEPARATOR if sample.chat and sample.question else "") + sample.question


def _sample(name: str, spec: Dataset, index: int, record: dict, tokenizer, budget: int) -> Sample:
    text = truncate_middle(tokenizer, spec.template.format(context=record["context"], input=record["input"]),
                           budget)
    after = spec.template.split("{context}", 1)[1].format(input=record["input"])
    separator = _SEPARATOR if spec.chat else ""
    question = after.removeprefix(separator)
    if text.endswith(after) and len(text) > len(after):
        context = text[:len(text) - len(after)]
    else:  # the question itself was cut (longer than half the budget): the whole prompt is the document
        context, question = text, ""
    references, all_classes = tuple(str(answer) for answer in record["answers"]), tuple(record["all_classes"] or ())
    longbench_metrics.check_references(spec.metric, references, all_classes)
    score = partial(longbench_metrics.best_score, spec.metric, references=references, all_classes=all_classes,
                    first_line=spec.first_line)
    return Sample(task=f"longbench/{name}", id=str(record.get("_id") or index), context=context, question=question,
                  references=references, score=score, max_new_tokens=spec.max_new_tokens,
                  chat=spec.chat, stop=("\n",) if name.removesuffix("_e") == "samsum" else (),
                  query=record["input"] if spec.chat else "")


def read_records(data_dir: Path, name: str) -> list[dict]:
    """The records of dataset `name` under `data_dir`, each with context, input, answers, all_classes and _id; the
    jsonl release or the parquet copy, whichever is there. InputError for missing or malformed data."""
    if not data_dir.is_dir():
        raise InputError(f"--longbench-data {data_dir} is not a directory: unzip LongBench's data.zip (or download "
                         "the parquet copy) there")
    for jsonl in (data_dir / f"{name}.jsonl", data_dir / "data" / f"{name}.jsonl"):
        if jsonl.is_file():
            return _some([_record(row, f"{jsonl}:{number}") for number, row in enumerate(_jsonl_rows(jsonl), 1)],
                         jsonl)
    for folder in (data_dir / name, data_dir / "data" / name):
        parquets = sorted(folder.rglob("*.parquet")) if folder.is_dir() else []
        if parquets:
            return _some([_record(row, str(path)) for path in parquets for row in _parquet_rows(path)], folder)
    if (data_dir / f"{name}.parquet").is_file():
        return _some([_record(row, f"{name}.parquet") for row in _parquet_rows(data_dir / f"{name}.parquet")],
                     data_dir / f"{name}.parquet")
    raise InputError(f"no LongBench {name} under {data_dir}: looked for {name}.jsonl, data/{name}.jsonl and "
                     f"{name}/*.parquet")


def _some(records: list[dict], where: Path) -> list[dict]:
    """`records`, or InputError when there are none: an empty file scores nothing, and would pass for a finished
    run (no table, exit 0)."""
    if not records:
        raise InputError(f"{where} holds no LongBench records: is this LongBench's data (an unfinished download?)")
    return records


def _jsonl_rows(path: Path) -> list:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise InputError(f"{path} is not UTF-8 text: is this LongBench's data?") from None
    rows = []
    for number, line in enumerate(lines, 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise InputError(f"{path}:{number} is not JSON ({error.msg}): is this LongBench's data?") from None
            except RecursionError:  # thousands of nested arrays: Python's parser gives up
                raise InputError(f"{path}:{number} is JSON nested deeper than Python reads: is this LongBench's "
                                 "data?") from None
    return rows


def _parquet_rows(path: Path) -> list:
    try:
        import pyarrow.parquet
    except ImportError:
        raise ConfigError(f"reading {path} needs pyarrow: {install_hint('eval')}") from None
    try:
        return pyarrow.parquet.read_table(path).to_pylist()
    except (OSError, pyarrow.ArrowException) as error:
        raise InputError(f"{path} cannot be read as parquet: {error}") from None


def _record(row: object, where: str) -> dict:
    """A row with the fields a sample needs (the question under `input`, or `question` in the parquet copy)."""
    if not isinstance(row, dict):
        raise InputError(f"{where}: a LongBench record is an object, got {type(row).__name__}")
    question = row.get("input", row.get("question"))
    answers = row.get("answers")
    if not isinstance(row.get("context"), str) or not isinstance(question, str):
        raise InputError(f"{where}: a LongBench record needs text under context and input (or question)")
    if not isinstance(answers, list) or not answers:
        raise InputError(f"{where}: a LongBench record needs a list of answers; without one it cannot be scored")
    classes = row.get("all_classes")
    if classes is not None and (not isinstance(classes, list) or not all(isinstance(name, str) for name in classes)):
        # a string would be split into its characters, each taken for a class, and score wrongly without a word
        raise InputError(f"{where}: a LongBench record's all_classes is a list of class names (or null), got "
                         f"{type(classes).__name__ if not isinstance(classes, list) else 'a list holding non-text'}")
    for field, value in (("context", row["context"]), ("input", question), ("answers", answers),
                         ("all_classes", classes or [])):
        if any(_SURROGATE.search(text) for text in ([value] if isinstance(value, str) else map(str, value))):
            raise InputError(f"{where}: a LongBench record's {field} holds a lone surrogate (e.g. \\ud800), which is "
                             "no Unicode character: is this LongBench's data?")
    return {"context": row["context"], "input": question, "answers": answers, "all_classes": classes,
            "_id": row.get("_id")}


_SURROGATE = re.compile("[\ud800-\udfff]")  # half of a UTF-16 pair alone: JSON's "\ud800" decodes to it
