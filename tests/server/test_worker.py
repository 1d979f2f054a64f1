"""The model worker and the states it reuses, without HTTP: stop strings, which prefix is reusable, a prefill
stopped midway, the queue's bounds."""

import threading

import pytest
import torch
from helpers.server import fresh_answer, question_prompt, worker_job
from helpers.tiny_models import CORPUS
from transformers import DynamicCache

import gali_cli.server.worker as worker_module
from gali_cli.config import MethodSettings
from gali_cli.generate import TextPiece, make_sampler, stream_generate
from gali_cli.loading import load_model
from gali_cli.patching import apply_method, prefill_spans
from gali_cli.prompts import ServedPrompt
from gali_cli.server.reuse import Prefilled, States, reusable_tokens
from gali_cli.server.worker import Done, Failed, ModelWorker, QueueFull, Stopping, StopStrings


@pytest.mark.parametrize("pieces, stops, sent, stopped", [
    (["Hel", "lo Wo", "rld"], ("o W",), ["Hel", "l"], True),  # "lo W" waits: "o" may begin the stop string
    (["ab", "cd"], ("x",), ["ab", "cd"], False),
    (["a<", "/s", "> b"], ("</s>",), ["a", "", ""], True),
    (["one\n", "two"], ("\n", "one"), [""], True),  # the earliest stop string wins
    (["tail <"], ("<|end|>",), ["tail "], False),  # held back, then given at the end
])
def test_stop_strings_cut_the_answer_before_the_first_one(pieces, stops, sent, stopped):
    matcher, out, hit = StopStrings(stops), [], False
    for piece in pieces:
        text, hit = matcher.feed(piece)
        out.append(text)
        if hit:
            break
    assert out == sent and hit == stopped
    assert matcher.finish() == ("" if stopped else "".join(pieces)[len("".join(sent)):])


@pytest.mark.parametrize("pieces, stops, sent", [
    (["aaa", "aab"], ("aaab",), ["", "aa"]),  # a failed partial match falls back to the shorter one inside it
    (["xabcd"], ("abcd", "bc"), ["xa"]),  # "bc" is complete first: the answer stops before it
    (["ababa", "c"], ("abac",), ["ab", ""]),
])
def test_stop_strings_that_overlap_themselves_are_found(pieces, stops, sent):
    matcher = StopStrings(stops)
    out = [matcher.feed(piece)[0] for piece in pieces]
    assert out[: len(sent)] == sent


def test_stop_strings_cost_linear_time_per_token():
    """Each character is looked at a bounded number of times, whatever the stop strings' length: the work for a
    token does not grow with the text held back."""
    stops = tuple("Z" * 255 + tail for tail in "abcd")
    matcher, steps = StopStrings(stops), 0
    original = worker_module._StopMatcher.step

    def counted(self, char):
        nonlocal steps
        steps += 1
        return original(self, char)

    worker_module._StopMatcher.step = counted
    try:
        for _ in range(2000):
            matcher.feed("Z")
    finally:
        worker_module._StopMatcher.step = original
    assert steps == 4 * 2000 and matcher.pending == "Z" * 255


def _prefilled(ids, cuts) -> Prefilled:
    return Prefilled(DynamicCache(), ids, cuts, {})


@pytest.mark.parametrize("kept_cuts, new_cuts, grid, expected", [
    ([40, 100], [40, 70], [32, 64], 40),  # the last end both prefills share within the common 60 tokens
    ([40, 50, 100], [40, 70], [32, 64], 40),  # kept ended a forward at 50, the new prompt will not
    ([45, 100], [40, 70], [32, 64], 32),  # each ended one where the other does not
    ([100], [70], [32, 64], 32),  # the chunk grid alone
    ([40, 100], [40, 70], None, 60),  # a method whose forwards may end anywhere: the whole common prefix
])
def test_a_prefix_is_reusable_up_to_the_last_forward_end_both_share(kept_cuts, new_cuts, grid, expected):
    kept = _prefilled(list(range(100)), kept_cuts)
    prompt = ServedPrompt(list(range(60)) + [-1] * 10, new_cuts, 0)
    assert reusable_tokens(kept, prompt, grid) == expected


def test_at_least_one_token_is_left_to_read():
    kept = _prefilled(list(range(10)), [10])
    assert reusable_tokens(kept, ServedPrompt(list(range(10)), [10], 0), None) == 9
    assert reusable_tokens(kept, ServedPrompt(list(range(10)), [10], 0), [4, 8]) == 8


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load_model(str(tiny_model_dir), "none", "cpu", "float32")


def test_a_prefill_stopped_midway_keeps_what_it_read_and_the_next_request_goes_on_from_it(loaded, monkeypatch):
    prompt = question_prompt(loaded, f"{CORPUS * 7}\n\nWho pays?")
    worker = ModelWorker(loaded, "gali", MethodSettings(), None, 4)
    job, events = worker_job(prompt)
    real = worker_module.stream_generate

    def cancelled_after_one_forward(*args):
        progress = args[7]

        def then_cancel(done: int, total: int) -> None:
            if done:  # after the first forward (prefill reports (0, total) before it)
                job.cancel()
            progress(done, total)

        return real(*args[:7], then_cancel, *args[8:])

    monkeypatch.setattr(worker_module, "stream_generate", cancelled_after_one_forward)
    worker._answer(job)
    monkeypatch.setattr(worker_module, "stream_generate", real)
    kept = worker.states.kept
    assert events == [] and 0 < len(kept.ids) < len(prompt.ids)  # one forward's worth, nothing sent
    assert all(layer.keys.shape[2] == len(kept.ids) for layer in kept.cache.layers)
    job, events = worker_job(prompt)
    worker._answer(job)
    done = events[-1]
    assert isinstance(done, Done) and done.cached_tokens == len(kept.ids)
    assert "".join(event.text for event in events if isinstance(event, TextPiece)) == fresh_answer(loaded, prompt)


@pytest.mark.parametrize("method", ["rerope", "leaky-rerope", "dpe", "string"])
def test_the_window_split_methods_serve_a_second_question_from_the_first_ones_state(loaded, method):
    """ReRoPE, Leaky ReRoPE and DPE place keys by (i, j) alone: the document read for one question is reused for the
    next (their far keys, rotated once per cache, follow the cache cut back to the document), with the answer of a
    fresh read."""
    worker = ModelWorker(loaded, method, MethodSettings(), None, 4)
    document = CORPUS * 4
    answers = []
    for question in ("Who pays?", "When does it end?"):
        prompt = question_prompt(loaded, f"{document}\n\n{question}")
        job, events = worker_job(prompt)
        worker._answer(job)
        answers.append((prompt, events[-1], "".join(event.text for event in events if isinstance(event, TextPiece))))
    (_, first, _), (prompt, second, answer) = answers
    assert isinstance(second, Done) and first.cached_tokens == 0 and second.cached_tokens > len(prompt.ids) // 2
    assert len(prompt.ids) > 2 * loaded.train_len  # past the window: the far keys are in play
    assert answer == fresh_answer(loaded, prompt, method=method)


def test_a_failed_forward_leaves_every_layer_at_the_tokens_read(loaded):
    prompt = question_prompt(loaded, "The lease ends in March.")
    states = States(loaded, "gali", None)
    resolved = apply_method(loaded.model, "gali", MethodSettings(), len(prompt.ids))
    cache, _reused = states.start(prompt, resolved, lambda: None)
    list(stream_generate(loaded.model, loaded.tokenizer, prompt.ids, make_sampler(), 1, set(),
                         prefill_spans(loaded.model, "gali", 0, len(prompt.ids), prompt.cuts), cache=cache))
    first = cache.layers[0]
    first.keys, first.values = first.keys[:, :, :3], first.values[:, :, :3]  # as a forward stopped midway leaves it
    cache.layers[1].keys = torch.cat([cache.layers[1].keys, cache.layers[1].keys[:, :, :2]], dim=2)
    states.keep(cache, prompt, 3, resolved)
    assert [layer.keys.shape[2] for layer in states.kept.cache.layers] == [3, 3]
    assert states.kept.ids == prompt.ids[:3]


def test_the_queue_is_bounded_and_stopping_fails_the_waiting_jobs(loaded):
    worker = ModelWorker(loaded, "gali", MethodSettings(), None, 2)  # not started: jobs stay queued
    jobs = [worker_job(question_prompt(loaded, "Hi")) for _ in range(3)]
    worker.submit(jobs[0][0])
    worker.submit(jobs[1][0])
    with pytest.raises(QueueFull) as full:
        worker.submit(jobs[2][0])
    assert 1 <= full.value.retry_after <= 60
    worker.stop()
    assert [events for _, events in jobs[:2]] == [[Failed(503, "the server is shutting down")]] * 2
    with pytest.raises(Stopping):
        worker.submit(jobs[2][0])


def test_the_worker_thread_answers_in_order_and_leaves_when_stopped(loaded):
    worker = ModelWorker(loaded, "gali", MethodSettings(), None, 4)
    finished = threading.Event()
    jobs = [worker_job(question_prompt(loaded, f"Question {index}?"), 3) for index in range(3)]
    for job, _events in jobs:
        worker.submit(job)
    def last_emit(event, events=jobs[-1][1]) -> None:
        events.append(event)
        if isinstance(event, Done):
            finished.set()

    jobs[-1][0].emit = last_emit
    worker.start()
    assert finished.wait(60)
    assert all(isinstance(events[-1], Done) and events[-1].completion_tokens == 3 for _, events in jobs)
    worker.stop()
    assert worker.join(30)
