"""The document cache and conversations: reused states give the same answers, and bad files are never trusted."""

import os
from pathlib import Path

import pytest
import torch
from helpers.caches import cache_contents
from transformers import DynamicCache

import gali_cli.doc_cache as doc_cache
from gali_cli.config import MethodSettings, parse_size
from gali_cli.conversation import Conversation
from gali_cli.doc_cache import DocumentCache, entry_key
from gali_cli.engine.seam.cache_argument import with_cache
from gali_cli.errors import ConfigError
from gali_cli.generate import Finished, TextPiece, make_sampler, stop_token_ids, stream_generate
from gali_cli.loading import load_model
from gali_cli.prompts import SUMMARIZE, ask_instruction, conversation_ids

DOCUMENT = "The lease ends in March. The tenant pays rent monthly, and the landlord repairs the roof.\n" * 5


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load_model(str(tiny_model_dir), device="cpu")


@pytest.fixture
def store(tmp_path):
    warnings = []
    cache = DocumentCache(tmp_path / "states", 2**30, warnings.append)
    cache.warnings = warnings
    return cache


def answer(conversation: Conversation, instruction: str, tokens: int = 10) -> tuple[list[int], Finished]:
    events = list(conversation.ask(instruction, make_sampler(), tokens))
    assert all(isinstance(event, TextPiece) for event in events[:-1])
    return list(events[-1].answer_ids), events[-1]


def filled_cache(loaded, tokens: int) -> tuple[list[int], DynamicCache]:
    ids = list(range(3, 3 + tokens))
    cache = DynamicCache(config=loaded.model.config)
    loaded.model(input_ids=torch.tensor([ids]), **with_cache(loaded.model, cache), use_cache=True)
    return ids, cache


@pytest.mark.parametrize("method, settings", [
    ("gali", MethodSettings(noise=True)),  # noise on: the noise is a function of token indices and seed, so it repeats
    ("gali", MethodSettings(noise=False, chunk_size=3, local_window=2)),
    ("self-extend", MethodSettings(group_size=16)),  # the defaults follow the input's length: fixed here, so
    ("chunk-llama", MethodSettings()),
    ("yarn", MethodSettings(factor=16.0)),  # that both questions resolve to the same settings
    ("original", MethodSettings()),
])
def test_a_cached_document_gives_the_same_answers(loaded, store, method, settings):
    fresh = [answer(Conversation(loaded, method, settings, DOCUMENT, "lease.txt"), instruction)[0]
             for instruction in (SUMMARIZE, ask_instruction("Who repairs the roof?"))]
    first = Conversation(loaded, method, settings, DOCUMENT, "lease.txt", store=store)
    ids, finished = answer(first, SUMMARIZE)
    assert ids == fresh[0] and finished.prefilled_tokens == finished.prompt_tokens and not first.from_store
    assert len(store.entries()) == 1 and store.entries()[0].tokens == first.document_tokens > 32
    second = Conversation(loaded, method, settings, DOCUMENT, "lease.txt", store=store)
    ids, finished = answer(second, ask_instruction("Who repairs the roof?"))
    assert second.from_store and ids == fresh[1]
    assert finished.prompt_tokens - finished.prefilled_tokens == second.document_tokens
    assert store.warnings == []


def test_other_settings_or_documents_do_not_share_a_state(loaded, store):
    answer(Conversation(loaded, "gali", MethodSettings(), DOCUMENT, "a", store=store), SUMMARIZE, 2)
    for method, settings, document in [("gali", MethodSettings(local_window=4), DOCUMENT),
                                       ("gali", MethodSettings(noise=True), DOCUMENT),
                                       ("gali", MethodSettings(noise=True, noise_seed=1), DOCUMENT),
                                       ("self-extend", MethodSettings(), DOCUMENT),
                                       ("gali", MethodSettings(), DOCUMENT + "One more line.")]:
        conversation = Conversation(loaded, method, settings, document, "b", store=store)
        answer(conversation, SUMMARIZE, 2)
        assert not conversation.from_store
    assert len(store.entries()) == 6


def test_dynamic_ntk_never_reuses_a_prefix(loaded, store):
    conversation = Conversation(loaded, "dynamic-ntk", MethodSettings(), DOCUMENT, "a", store=store)
    answer(conversation, SUMMARIZE, 2)
    _, finished = answer(conversation, "Why?", 2)
    assert store.entries() == [] and finished.prefilled_tokens == finished.prompt_tokens


def test_a_conversation_continues_its_cache(loaded):
    """Turn two runs only its new tokens, and answers as one forward over the whole conversation would."""
    conversation = Conversation(loaded, "original", MethodSettings(), DOCUMENT, "lease.txt")
    first, _ = answer(conversation, ask_instruction("When does the lease end?"), 6)
    second, finished = answer(conversation, "And the rent?", 6)
    ids = conversation_ids(loaded.tokenizer, DOCUMENT, [ask_instruction("When does the lease end?"),
                                                        "And the rent?"], [first]).ids
    assert finished.prompt_tokens == len(ids) and finished.prefilled_tokens < len(ids) - len(first)
    events = list(stream_generate(loaded.model, loaded.tokenizer, ids, make_sampler(), 6,
                                  stop_token_ids(loaded.model, loaded.tokenizer), [(0, len(ids))]))
    assert second == list(events[-1].answer_ids)
    assert conversation.questions == [ask_instruction("When does the lease end?"), "And the rent?"]


def test_self_extend_reads_again_when_the_conversation_outgrows_its_groups(loaded):
    notices = []
    conversation = Conversation(loaded, "self-extend", MethodSettings(), DOCUMENT, "lease.txt", notice=notices.append)
    answer(conversation, SUMMARIZE, 40)
    group = conversation.resolved["group_size"]
    while conversation.resolved["group_size"] == group:
        _, finished = answer(conversation, "Tell me more about the roof and the rent, please.", 40)
    assert finished.prefilled_tokens == finished.prompt_tokens and "reading the document again" in notices[-1]


def test_state_round_trip(loaded, store):
    ids, cache = filled_cache(loaded, 12)
    store.save("k" * 64, ids[:9], cache, {"document": "doc", "model": "tiny", "method": "gali"})
    restored = store.load("k" * 64, ids[:9], loaded.model)
    for layer, state in enumerate(restored.layers):
        torch.testing.assert_close(state.keys, cache.layers[layer].keys[:, :, :9], rtol=0, atol=0)
        torch.testing.assert_close(state.values, cache.layers[layer].values[:, :, :9], rtol=0, atol=0)
    entry, = store.entries()
    assert (entry.document, entry.model, entry.method, entry.tokens) == ("doc", "tiny", "gali", 9)
    assert store.load("k" * 64, ids[:8], loaded.model) is None and "another document" in store.warnings[-1]
    assert store.entries() == []  # a file that fails its checks is deleted, to be rebuilt


def _damage_by_truncation(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-100])


def _damage_by_garbage(path: Path) -> None:
    path.write_bytes(b"\x00" * 64)


def _damage_by_a_foreign_format(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data.replace(f'"format":"{doc_cache.FORMAT}"'.encode(), b'"format":"9"'))


def _damage_by_nan(path: Path) -> None:
    _resave(path, lambda tensors: tensors["keys.0"][0, 0, 0].fill_(float("nan")))


def _damage_inside_the_data(path: Path) -> None:
    """4 KiB of finite values written over the middle of the tensor data; header and size unchanged."""
    data = bytearray(path.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")
    middle = start + (len(data) - start) // 2
    data[middle : middle + 4096] = torch.full((1024,), 0.25).numpy().tobytes()
    path.write_bytes(bytes(data))


def _damage_by_scaling_a_layer(path: Path) -> None:
    """One layer's values times 1.5, saved again with the entry's metadata."""
    _resave(path, lambda tensors: tensors["values.1"].mul_(1.5))


def _resave(path: Path, change) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    metadata = doc_cache._metadata(path)
    change(tensors)
    save_file(tensors, path, metadata)


@pytest.mark.parametrize("damage", [_damage_by_truncation, _damage_by_garbage, _damage_by_a_foreign_format,
                                    _damage_by_nan, _damage_inside_the_data, _damage_by_scaling_a_layer])
def test_a_damaged_entry_is_ignored_with_a_warning(loaded, store, damage):
    ids, cache = filled_cache(loaded, 48)  # 24 KiB of tensor data
    key = entry_key({"model": "tiny"}, ids)
    store.save(key, ids, cache, {})
    damage(store.path(key))
    assert store.load(key, ids, loaded.model) is None
    assert len(store.warnings) == 1 and "damaged" in store.warnings[0] and str(store.path(key)) in store.warnings[0]
    assert not store.path(key).exists()


def test_a_changed_state_is_noticed_and_rebuilt(loaded, store):
    """Values scaled with the metadata kept (finite, right shapes): the next question must not answer from them."""
    settings = MethodSettings(noise=False)
    fresh, _ = answer(Conversation(loaded, "gali", settings, DOCUMENT, "lease.txt"), SUMMARIZE)
    answer(Conversation(loaded, "gali", settings, DOCUMENT, "lease.txt", store=store), SUMMARIZE)
    entry, = store.entries()
    _damage_by_scaling_a_layer(entry.path)
    again = Conversation(loaded, "gali", settings, DOCUMENT, "lease.txt", store=store)
    ids, _ = answer(again, SUMMARIZE)
    assert not again.from_store and ids == fresh
    assert len(store.warnings) == 1 and "values.1 does not match its checksum" in store.warnings[0]
    rebuilt = Conversation(loaded, "gali", settings, DOCUMENT, "lease.txt", store=store)
    assert answer(rebuilt, SUMMARIZE)[0] == fresh and rebuilt.from_store and len(store.warnings) == 1


def test_a_failed_write_leaves_no_file(loaded, store, monkeypatch):
    ids, cache = filled_cache(loaded, 6)

    def disk_full(tensors, filename, metadata):
        Path(filename).write_bytes(b"half a file")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(doc_cache, "save_file", disk_full)
    store.save(entry_key({}, ids), ids, cache, {})
    assert cache_contents(store.directory) == [] and "No space left on device" in store.warnings[0]


def test_least_recently_used_entries_go_first(loaded, tmp_path):
    ids, cache = filled_cache(loaded, 6)
    size = sum(2 * layer.keys.numel() * layer.keys.element_size() for layer in cache.layers)
    warnings = []
    keys = [entry_key({"n": n}, ids) for n in range(3)]
    probe = DocumentCache(tmp_path / "probe", 2**30, warnings.append)
    probe.save(keys[0], ids, cache, {})
    store = DocumentCache(tmp_path / "states", 2 * probe.entries()[0].size + size // 2, warnings.append)  # 2 fit
    for age, key in enumerate(keys[:2]):
        store.save(key, ids, cache, {})
        os.utime(store.path(key), (1000 + age, 1000 + age))
    store.load(keys[0], ids, loaded.model)  # now the most recently used
    store.save(keys[2], ids, cache, {})
    assert {entry.path for entry in store.entries()} == {store.path(keys[0]), store.path(keys[2])}
    tiny = DocumentCache(tmp_path / "small", size // 2, warnings.append)
    tiny.save(keys[0], ids, cache, {})
    assert tiny.entries() == [] and "more than the cache limit" in warnings[-1]
    total = sum(entry.size for entry in store.entries())
    cleared = store.clear()
    assert (len(cleared.removed), cleared.removed_bytes, cleared.kept) == (2, total, ()) and store.entries() == []


def test_sizes_and_directories(monkeypatch, tmp_path):
    assert parse_size("20G", "x") == parse_size("20 GiB", "x") == 20 * 2**30
    assert parse_size("512m", "x") == 512 * 2**20 and parse_size("1000", "x") == 1000
    assert parse_size("1.5k", "x") == 1536
    for bad in ("lots", "-1G", "5X", "nan", "inf"):
        with pytest.raises(ConfigError, match="GALI_CACHE_LIMIT"):
            parse_size(bad, "GALI_CACHE_LIMIT")
    monkeypatch.setenv("GALI_CACHE_DIR", str(tmp_path / "mine"))
    assert doc_cache.default_directory() == tmp_path / "mine"
    monkeypatch.delenv("GALI_CACHE_DIR")
    assert doc_cache.default_directory().name == "documents" and "gali" in str(doc_cache.default_directory())
    monkeypatch.setenv("GALI_CACHE_LIMIT", "3M")
    assert doc_cache.default_limit() == 3 * 2**20


def test_the_state_is_stored_once_the_answer_is_complete(loaded, store):
    conversation = Conversation(loaded, "gali", MethodSettings(), DOCUMENT, "lease.txt", store=store)
    for event in conversation.ask(SUMMARIZE, make_sampler(), 3):
        if isinstance(event, Finished):
            break  # a consumer that stops at the last event, without exhausting the generator
    assert len(store.entries()) == 1 and conversation.questions == [SUMMARIZE]


def test_odd_files_in_the_directory_are_left_alone_never_fatal(loaded, store):
    import json

    store.directory.mkdir(parents=True)
    header = json.dumps({"__metadata__": {"tokens": "abc", "document": "[odd]"}}).encode()
    (store.directory / "bad-tokens.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    listed = json.dumps([1, 2]).encode()
    (store.directory / "list.safetensors").write_bytes(len(listed).to_bytes(8, "little") + listed)
    (store.directory / "dangling.safetensors").symlink_to(store.directory / "nowhere")
    (store.directory / "folder.safetensors").mkdir()
    (store.directory / ".partial-notgalis").mkdir()  # a folder named like a write, holding what a write never does
    (store.directory / ".partial-notgalis" / "notes.txt").write_text("mine")
    odd = sorted(path.name for path in cache_contents(store.directory))
    assert store.entries() == []
    ids, cache = filled_cache(loaded, 6)
    store.save(entry_key({}, ids), ids, cache, {"document": "[notes] draft.txt"})  # eviction reads them all
    assert store.load(entry_key({}, ids), ids, loaded.model) is not None
    warning, = store.warnings
    assert "bad-tokens.safetensors" in warning and "left alone" in warning
    remaining = store.entries()
    assert len(remaining) == 1 and store.clear().removed_bytes == remaining[0].size
    assert store.entries() == [] and sorted(path.name for path in cache_contents(store.directory)) == odd
    assert len(store.warnings) == 1  # named once


def test_a_folder_of_model_weights_used_as_the_cache_loses_nothing(loaded, tmp_path):
    """Pointing the cache at a model's folder: clear and eviction remove only the states gali wrote there."""
    import shutil

    from gali_cli.model.config import demo_model_path

    folder = tmp_path / "demo"
    shutil.copytree(demo_model_path(), folder)
    before = {path.name: path.read_bytes() for path in cache_contents(folder)}
    warnings = []
    ids, cache = filled_cache(loaded, 6)
    DocumentCache(tmp_path / "probe", 2**30, print).save("probe", ids, cache, {})
    entry_size = (tmp_path / "probe" / "probe.safetensors").stat().st_size
    store = DocumentCache(folder, entry_size + 1, warnings.append)  # room for one entry: the second evicts
    store.save(entry_key({"n": 1}, ids), ids, cache, {})
    store.save(entry_key({"n": 2}, ids), ids, cache, {})
    assert [entry.path.name for entry in store.entries()] == [f"{entry_key({'n': 2}, ids)}.safetensors"]
    assert any("model.safetensors" in warning for warning in warnings)
    cleared = store.clear()
    assert len(cleared.removed) == 1 and cleared.kept == ()
    assert {path.name: path.read_bytes() for path in cache_contents(folder)} == before


def test_clear_says_what_it_could_not_remove(loaded, store, monkeypatch):
    ids, cache = filled_cache(loaded, 6)
    for n in range(3):
        store.save(entry_key({"n": n}, ids), ids, cache, {})
    sizes = {entry.path: entry.size for entry in store.entries()}
    stuck = sorted(sizes)[:2]
    unlink = Path.unlink

    def refuse(path, missing_ok=False):
        if path in stuck:
            raise PermissionError(13, "Permission denied")
        unlink(path, missing_ok)

    monkeypatch.setattr(Path, "unlink", refuse)
    cleared = store.clear()
    assert [path for path, _ in cleared.removed] == sorted(set(sizes) - set(stuck))
    assert sorted((path, reason) for path, _, reason in cleared.kept) == [(path, "Permission denied") for path in stuck]
    assert cleared.kept_bytes == sum(sizes[path] for path in stuck)

    def unreadable(path):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(doc_cache.os, "scandir", unreadable)
    assert store.clear().kept == ((store.directory, 0, "Permission denied"),)


def test_an_interrupted_write_leaves_no_file(loaded, store, monkeypatch):
    ids, cache = filled_cache(loaded, 6)

    def interrupted(tensors, filename, metadata):
        Path(filename).write_bytes(b"half a file")
        raise KeyboardInterrupt

    monkeypatch.setattr(doc_cache, "save_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        store.save(entry_key({}, ids), ids, cache, {})
    assert cache_contents(store.directory) == []


@pytest.mark.parametrize("stop_at", [None, 1, 3])  # in the second turn's prefill; after its 2nd / 4th answer piece
def test_an_interrupted_turn_leaves_the_conversation_as_it_was(loaded, stop_at):
    def interrupt(done: int, total: int) -> None:
        raise KeyboardInterrupt

    def conversation_with_interruption(interrupt_it: bool) -> list[int]:
        conversation = Conversation(loaded, "gali", MethodSettings(chunk_size=4, local_window=8), DOCUMENT, "doc")
        answer(conversation, SUMMARIZE, 5)
        if interrupt_it:
            events = conversation.ask("Who repairs the roof?", make_sampler(), 5,
                                      progress=interrupt if stop_at is None else None)
            with pytest.raises(KeyboardInterrupt):
                for index, _ in enumerate(events):
                    if index == stop_at:
                        events.throw(KeyboardInterrupt)
            assert conversation.questions == [SUMMARIZE]
        return answer(conversation, "Who repairs the roof?", 5)[0]

    assert conversation_with_interruption(True) == conversation_with_interruption(False)


def test_a_stopped_answer_is_rolled_back_even_if_its_generator_is_never_closed(loaded):
    """Ctrl-C in the consumer's own code leaves the generator suspended (alive while a traceback holds it): the next
    question must not depend on its finalisation, and a late finalisation must not touch a later turn."""
    def conversation_with_a_stopped_answer(stop: bool) -> list[list[int]]:
        conversation = Conversation(loaded, "gali", MethodSettings(chunk_size=4, local_window=8), DOCUMENT, "doc")
        answer(conversation, SUMMARIZE, 5)
        stopped = conversation.ask("Who repairs the roof?", make_sampler(), 8) if stop else None
        if stop:
            for index, _event in enumerate(stopped):
                if index == 2:
                    break  # `stopped` stays referenced, suspended after its third event
            assert conversation.cache.get_seq_length() > len(conversation.cached_ids)
        answers = [answer(conversation, "Who repairs the roof?", 5)[0]]
        if stop:
            stopped.close()  # finalised only now, after a newer turn
            assert conversation.questions == [SUMMARIZE, "Who repairs the roof?"]
        answers.append(answer(conversation, "And the rent?", 5)[0])
        return answers

    assert conversation_with_a_stopped_answer(True) == conversation_with_a_stopped_answer(False)


def test_an_interrupted_first_prefill_reads_the_document_again(loaded):
    conversation = Conversation(loaded, "gali", MethodSettings(), DOCUMENT, "doc")

    def interrupt(done: int, total: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        list(conversation.ask(SUMMARIZE, make_sampler(), 3, progress=interrupt))
    assert conversation.cache is None
    _, finished = answer(conversation, SUMMARIZE, 3)
    assert finished.prefilled_tokens == finished.prompt_tokens


def test_a_fifo_at_an_entrys_path_is_skipped_not_waited_on(loaded, store):
    """Opening a FIFO blocks until a writer comes: an entry's path that is no regular file is passed over at once."""
    ids, _ = filled_cache(loaded, 6)
    store.directory.mkdir(parents=True)
    os.mkfifo(store.path(entry_key({}, ids)))
    assert store.load(entry_key({}, ids), ids, loaded.model) is None
    assert "not a regular file" in store.warnings[-1] and store.path(entry_key({}, ids)).exists()
