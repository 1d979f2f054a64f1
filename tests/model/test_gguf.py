"""GGUF files: read as transformers reads them (weights in their blocks: tests/model/test_gguf_weights.py), the config
and tokenizer read once into the user cache, damaged ones refused in one line. The GGUFs are written at test time
with the gguf package's own writer (tests/helpers/gguf_files.py's write_gguf)."""

import importlib.util
import json
import math
import os
import shutil
import time
import warnings
from pathlib import Path

import gguf
import pytest
import torch
from helpers.caches import cache_contents
from helpers.gguf_files import write_gguf
from helpers.tiny_models import save_tiny_llama
from transformers import AutoModelForCausalLM, AutoTokenizer

from gali_cli.cli import main
from gali_cli.errors import GaliWarning, ModelLoadError, UnsupportedModelError
from gali_cli.loading import load_config, load_model, resolve_source
from gali_cli.model import companions as model_cache
from gali_cli.model.gguf import read_header

IDS = torch.tensor([[0, 274, 269, 284, 73, 304, 283, 309, 307, 297, 18, 5, 9, 11]])
TOLERANCE = 1e-5  # relative: the same float32 weights, their products tiled differently


def transformers_own(path: Path):
    """The model as transformers itself loads the GGUF (the reference gali must equal)."""
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


@pytest.fixture
def dequantizations(monkeypatch):
    """Counts the tensors transformers dequantizes (it calls gguf.dequantize once per tensor)."""
    calls = []
    original = gguf.dequantize

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(gguf, "dequantize", counting)
    return calls


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch) -> Path:
    directory = tmp_path / "models"
    monkeypatch.setenv("GALI_MODEL_CACHE", str(directory))
    return directory


def test_header_is_read_without_transformers(tiny_gguf):
    header = read_header(tiny_gguf)
    assert (header.version, header.architecture, header.name) == (3, "llama", "tiny llama")
    assert header.metadata["llama.context_length"] == 32 and header.metadata["tokenizer.ggml.tokens"] > 300
    assert {tensor.name for tensor in header.tensors} >= {"token_embd.weight", "blk.1.attn_q.weight", "output.weight"}
    assert max(header.data_start + t.offset + t.nbytes for t in header.tensors) <= tiny_gguf.stat().st_size


def test_gguf_loads_as_transformers_loads_it(tiny_gguf, tiny_model_dir, fresh_cache, dequantizations):
    loaded = load_model(str(tiny_gguf), device="cpu")
    assert not dequantizations  # read into grids, never a float copy through the gguf package
    reference = transformers_own(tiny_gguf)
    ours, theirs = loaded.model(IDS).logits, reference(IDS).logits
    assert (ours - theirs).abs().max() <= TOLERANCE * theirs.abs().max()
    source = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()  # what was written, before Q8_0 blocks
    assert torch.allclose(loaded.model(IDS).logits, source(IDS).logits, atol=0.1)
    theirs = AutoTokenizer.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name)
    text = "The tenant pays rent monthly.\ndef read(path):"
    assert loaded.tokenizer(text).input_ids == theirs(text).input_ids
    assert loaded.tokenizer.chat_template == theirs.chat_template
    assert loaded.identity["weights"][0]["path"] == str(tiny_gguf.resolve())
    assert "quantization_config" not in loaded.model.config.to_dict()


def test_the_second_load_reads_the_tokenizer_from_the_cache(tiny_gguf, fresh_cache):
    notices = []
    first = load_model(str(tiny_gguf), device="cpu", notice=notices.append)
    assert len(notices) == 1 and "tokenizer once" in notices[0]
    (entry,) = cache_contents(fresh_cache)
    assert not list(entry.glob("*.safetensors"))  # no weights in the cache: they come from the GGUF itself
    assert sum(path.stat().st_size for path in entry.iterdir()) < tiny_gguf.stat().st_size
    second = load_model(str(tiny_gguf), device="cpu", notice=notices.append)
    assert len(notices) == 1  # nothing read again
    assert torch.equal(first.model(IDS).logits, second.model(IDS).logits)
    assert load_config(str(tiny_gguf)).max_position_embeddings == 32


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_the_cached_tokenizer_is_the_loaded_one_read_without_a_python_vocabulary(tiny_gguf, tmp_path, fresh_cache,
                                                                                model_type, monkeypatch):
    """An entry holds the tokenizer a load of transformers' reading makes (Qwen2Tokenizer rebuilds its pre-tokenizer
    as it loads), saved so that it loads straight into the Rust tokenizer: no tokenizer.json parsed in Python, no
    Python copy of the vocabulary kept (Gemma 3's: 0.3 GB at the peak of `gali ask`)."""
    path = tiny_gguf if model_type == "llama" else write_gguf(
        tmp_path / f"tiny-{model_type}.gguf", save_tiny_llama(tmp_path / "model", model_type, hidden=64))
    AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(tmp_path / "read")
    before = AutoTokenizer.from_pretrained(tmp_path / "read")  # what gali loaded from an entry as transformers saved it
    load_model(str(path), device="cpu")
    parsed, parse = [], json.load
    monkeypatch.setattr(json, "load", lambda file, *args, **kwargs: (
        parsed.append(Path(getattr(file, "name", "")).name), parse(file, *args, **kwargs))[1])
    tokenizer = load_model(str(path), device="cpu").tokenizer
    assert "tokenizer.json" not in parsed
    assert tokenizer.backend_tokenizer.to_str() == before.backend_tokenizer.to_str()
    assert all(getattr(tokenizer, name) == getattr(before, name) for name in (
        "padding_side", "model_input_names", "chat_template", "all_special_ids", "added_tokens_decoder"))
    text = "The tenant pays rent monthly.\ndef read(path):  <|eot_id|> \u00e9 \t\t end"
    assert tokenizer(text).input_ids == before(text).input_ids

    def python_vocabulary(loaded) -> list[str]:
        """The attributes of `loaded` that hold a Python copy of the vocabulary (or of most of it)."""
        return [name for name, value in vars(loaded).items()
                if isinstance(value, dict | list) and len(value) >= len(loaded) // 2]

    assert not python_vocabulary(tokenizer)
    assert bool(python_vocabulary(before)) == (model_type == "qwen2")  # what Qwen2Tokenizer's own load keeps


def test_an_entry_an_older_gali_wrote_is_read_again_without_a_warning(tiny_gguf, fresh_cache):
    load_model(str(tiny_gguf), device="cpu")
    (entry,) = cache_contents(fresh_cache)
    manifest = json.loads((entry / model_cache.MANIFEST).read_text())
    (entry / model_cache.MANIFEST).write_text(json.dumps({**manifest, "format": "2"}))
    (listed,) = model_cache.GgufCompanions().entries()
    assert listed.reason_unusable == ("written by an older gali: a tokenizer that transformers loads through Python "
                                      "copies of its vocabulary") and listed.dtype == "tokenizer"
    notices = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_model(str(tiny_gguf), device="cpu", notice=notices.append)
    assert len(notices) == 1 and "tokenizer once" in notices[0]
    assert json.loads((entry / model_cache.MANIFEST).read_text())["format"] == model_cache.FORMAT


def test_a_foreign_folder_where_an_entry_goes_is_refused_not_replaced(tiny_gguf, fresh_cache):
    """A folder of the user's, named as gali names the entry: never replaced, and the load says what to do."""
    load_model(str(tiny_gguf), device="cpu")
    (entry,) = cache_contents(fresh_cache)
    shutil.rmtree(entry)
    entry.mkdir()
    (entry / "config.json").write_text("{}")
    (entry / "notes.txt").write_text("mine")
    with pytest.raises(ModelLoadError, match=f"which gali did not write, where it keeps {tiny_gguf.name}'s tokenizer: "
                                             "move it away, or choose another cache with GALI_MODEL_CACHE"):
        load_model(str(tiny_gguf), device="cpu")
    assert model_cache.GgufCompanions(fresh_cache).entries() == []
    with pytest.warns(GaliWarning, match="which gali did not write: they are left alone"):
        assert model_cache.GgufCompanions(fresh_cache).clear() == ([], [])
    assert sorted(path.name for path in entry.iterdir()) == ["config.json", "notes.txt"]


@pytest.mark.parametrize("damage", ["flipped byte", "truncated tokenizer", "no manifest", "manifest of another file"])
def test_a_damaged_entry_is_rebuilt(tiny_gguf, fresh_cache, damage):
    expected = load_model(str(tiny_gguf), device="cpu").model(IDS).logits
    (entry,) = cache_contents(fresh_cache)
    tokenizer = entry / "tokenizer.json"
    if damage == "flipped byte":
        data = bytearray(tokenizer.read_bytes())
        data[len(data) // 2] ^= 0x01
        tokenizer.write_bytes(bytes(data))
    elif damage == "truncated tokenizer":
        tokenizer.write_bytes(tokenizer.read_bytes()[:-100])
    elif damage == "no manifest":
        (entry / model_cache.MANIFEST).unlink()
    else:
        text = (entry / model_cache.MANIFEST).read_text()
        (entry / model_cache.MANIFEST).write_text(text.replace('"key": "', '"key": "0'))
    notices = []
    with pytest.warns(GaliWarning, match="damaged.*reading it again"):
        again = load_model(str(tiny_gguf), device="cpu", notice=notices.append)
    assert len(notices) == 1
    assert torch.equal(again.model(IDS).logits, expected)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_model(str(tiny_gguf), device="cpu", notice=notices.append)  # rebuilt: sound again
    assert len(notices) == 1


def test_a_replaced_gguf_gets_a_new_entry_and_the_old_one_goes(tiny_gguf, tmp_path, fresh_cache):
    copy = shutil.copy(tiny_gguf, tmp_path / "model.gguf")
    load_model(str(copy), device="cpu")
    (old,) = cache_contents(fresh_cache)
    Path(copy).touch()  # a new modification time: another file as far as gali knows
    load_model(str(copy), device="cpu")
    (new,) = cache_contents(fresh_cache)
    assert new != old


def test_another_dtype_dequantizes_as_it_loads(tiny_gguf, fresh_cache):
    half = load_model(str(tiny_gguf), device="cpu", dtype="bfloat16")
    assert half.model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert half.model.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    assert half.identity["dtype"] == "torch.bfloat16"
    assert len(cache_contents(fresh_cache)) == 1  # one entry whatever the dtype: the tokenizer's


def _truncated(path: Path, good: Path) -> None:
    path.write_bytes(good.read_bytes()[: good.stat().st_size // 2])


def _bad_magic(path: Path, good: Path) -> None:
    path.write_bytes(b"GGML" + good.read_bytes()[4:])


def _huge_string(path: Path, good: Path) -> None:
    data = bytearray(good.read_bytes())
    data[24:32] = (2**40).to_bytes(8, "little")  # the first key's length
    path.write_bytes(bytes(data))


def _bad_version(path: Path, good: Path) -> None:
    path.write_bytes(good.read_bytes()[:4] + (7).to_bytes(4, "little") + good.read_bytes()[8:])


def _edited(key: str, value: int):
    """The GGUF with one metadata number changed in place, as gguf's own gguf-set-metadata does it."""
    def edit(path: Path, good: Path) -> None:
        shutil.copyfile(good, path)
        reader = gguf.GGUFReader(path, "r+")
        field = reader.fields[key]
        field.parts[field.data[0]][0] = value
        reader.data.flush()
    return edit


def _shifted_offset(path: Path, good: Path) -> None:
    shutil.copyfile(good, path)
    reader = gguf.GGUFReader(path, "r+")
    reader.tensors[0].field.parts[-1][0] += 2  # the first tensor's data offset, two bytes on
    reader.data.flush()


def _nested_metadata(path: Path, good: Path) -> None:
    """A header whose one metadata value is an array of an array of ... 100,000 deep."""
    depth = 100_000
    key = b"general.nested"
    head = b"GGUF" + (3).to_bytes(4, "little") + (0).to_bytes(8, "little") + (1).to_bytes(8, "little")
    head += len(key).to_bytes(8, "little") + key + (9).to_bytes(4, "little")  # the value is an array
    level = (9).to_bytes(4, "little") + (1).to_bytes(8, "little")  # of one array ...
    path.write_bytes(head + level * depth + (4).to_bytes(4, "little") + (0).to_bytes(8, "little"))


def _huge_count(path: Path, good: Path) -> None:
    """The first metadata value made an array of 2**62 arrays."""
    data = bytearray(good.read_bytes())
    length = int.from_bytes(data[24:32], "little")
    value = 32 + length  # after the first key: its type, then the value
    data[value : value + 4] = (9).to_bytes(4, "little")
    data[value + 4 : value + 16] = (9).to_bytes(4, "little") + (2**62).to_bytes(8, "little")
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, message", [
    (_edited("llama.block_count", 10**9), "llama.block_count is 1000000000 and the file holds 2 blocks"),
    (_edited("llama.vocab_size", 100), "token_embd.weight has shape [64, 320], the metadata says [64, 100]"),
    (_edited("llama.attention.head_count", 0), "llama.attention.head_count is 0"),
    (_edited("llama.context_length", 0), "llama.context_length is 0"),
    (_shifted_offset, "tensor 'token_embd.weight' starts at offset 2, not a multiple of its alignment 32"),
    (_nested_metadata, "metadata arrays nested more than 3 deep"),
    (_huge_count, "truncated"),
], ids=["block_count 10^9", "vocab_size against token_embd", "zero heads", "zero context", "offset shifted by 2",
        "nested 100,000 deep", "2^62 arrays"])
def test_hostile_ggufs_are_refused_from_their_header(tiny_gguf, tmp_path, damage, message, capsys):
    """Refused before transformers reads the file: a GGUF's metadata against sane bounds and against its tensors."""
    path = tmp_path / "model.gguf"
    damage(path, tiny_gguf)
    assert main(["info", "-m", str(path)]) == 4
    error = capsys.readouterr().err
    assert message in error and len(error.strip().splitlines()) == 1 and "unexpected" not in error, error


@pytest.mark.parametrize("damage, message", [
    (_truncated, "is truncated"),
    (_bad_magic, "is not a GGUF file"),
    (_huge_string, "truncated"),
    (_bad_version, "GGUF version 7 is not supported"),
])
def test_damaged_ggufs_are_one_line_errors(tiny_gguf, tmp_path, damage, message, capsys):
    path = tmp_path / "model.gguf"
    damage(path, tiny_gguf)
    assert main(["info", "-m", str(path)]) == 4
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert message in error and "Traceback" not in error


def test_an_empty_or_foreign_file_is_refused(tmp_path, capsys):
    (tmp_path / "empty.gguf").write_bytes(b"")
    (tmp_path / "notes.txt").write_text("not a model")
    assert main(["info", "-m", str(tmp_path / "empty.gguf")]) == 4
    assert main(["info", "-m", str(tmp_path / "notes.txt")]) == 4
    assert main(["info", "-m", str(tmp_path / "missing.gguf")]) == 4
    errors = capsys.readouterr().err
    assert "empty.gguf is not a GGUF file" in errors and "no such file or directory" in errors
    assert "a directory (with config.json) or a GGUF file" in errors


def test_another_architecture_is_refused_before_dequantizing(tiny_model_dir, tmp_path, dequantizations):
    path = write_gguf(tmp_path / "gemma.gguf", tiny_model_dir, architecture="gemma2")
    with pytest.raises(UnsupportedModelError, match=r"'gemma2' GGUF; gali reads GGUFs of llama, qwen2, qwen3, "
                                                    r"gemma3 \(Mistral's are llama\)$"):
        load_model(str(path), device="cpu")
    assert not dequantizations
    assert main(["info", "-m", str(path)]) == 4


def test_a_missing_gguf_package_is_one_line(tiny_gguf, monkeypatch, capsys):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else find_spec(name, *a))
    with pytest.raises(ModelLoadError, match="needs the gguf package: pip install gguf"):
        load_config(str(tiny_gguf))
    assert main(["info", "-m", str(tiny_gguf)]) == 4
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith("pip install gguf")


def test_ppl_of_a_gguf_equals_transformers_own(tiny_gguf, tmp_path, capsys):
    text = "The lease ends in March. The tenant pays rent monthly, and the landlord repairs the roof. " * 3
    (tmp_path / "doc.txt").write_text(text)
    assert main(["ppl", str(tmp_path / "doc.txt"), "-m", str(tiny_gguf), "--method", "original"]) == 0
    ours = float(capsys.readouterr().out)
    tokenizer = AutoTokenizer.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name)
    ids = tokenizer(text, return_tensors="pt").input_ids
    reference = math.exp(transformers_own(tiny_gguf)(ids, labels=ids).loss.item())
    assert ours == pytest.approx(reference, rel=1e-4)


def test_answers_from_a_gguf(tiny_gguf, tmp_path, capsys):
    (tmp_path / "doc.txt").write_text("The lease ends in March. The tenant pays rent monthly. " * 8)
    assert main(["ask", str(tmp_path / "doc.txt"), "When does the lease end?", "-m", str(tiny_gguf),
                 "--max-new-tokens", "5", "--train-len", "16", "--json"]) == 0
    assert '"generated_tokens": 5' in capsys.readouterr().out


def test_sources(tiny_gguf, tmp_path):
    assert resolve_source(str(tiny_gguf)).gguf.path == tiny_gguf.resolve()
    renamed = shutil.copy(tiny_gguf, tmp_path / "weights.bin")  # the magic decides, not the suffix
    assert resolve_source(str(renamed)).gguf is not None


def _as_if_written_by(entry: Path, release: str, days_ago: float) -> Path:
    """`entry` renamed and relabelled as another transformers release's copy, last used `days_ago`."""
    other = entry.with_name(entry.name.replace(f"transformers-{model_cache.transformers.__version__}",
                                               f"transformers-{release}"))
    shutil.copytree(entry, other)
    manifest = other / model_cache.MANIFEST
    manifest.write_text(manifest.read_text().replace(f'"transformers": "{model_cache.transformers.__version__}"',
                                                     f'"transformers": "{release}"'))
    when = time.time() - days_ago * 86400
    os.utime(other, (when, when))
    return other


def test_copies_another_release_wrote_are_listed_kept_a_while_then_pruned(tiny_gguf, tmp_path, fresh_cache):
    copy = shutil.copy(tiny_gguf, tmp_path / "model.gguf")
    load_model(str(copy), device="cpu")
    (ours,) = cache_contents(fresh_cache)
    recent = _as_if_written_by(ours, "5.0.0", days_ago=2)
    old = _as_if_written_by(ours, "4.99.0", days_ago=model_cache.UNUSED_DAYS + 1)
    cache = model_cache.GgufCompanions()
    entries = {entry.path: entry for entry in cache.entries()}
    assert entries[ours].usable and entries[ours].reason_unusable is None
    assert entries[recent].reason_unusable == "written by transformers 5.0.0" and not entries[old].usable
    assert list(entries) == [ours, recent, old]  # most recently used first
    used_before = ours.stat().st_mtime
    os.utime(ours, (used_before - 100, used_before - 100))
    load_model(str(copy), device="cpu")
    assert ours.stat().st_mtime > used_before - 100  # a load marks the copy used
    other = shutil.copy(tiny_gguf, tmp_path / "other.gguf")
    load_model(str(other), device="cpu")  # a build, which prunes what is unused for 30 days
    left = {path.name for path in cache_contents(fresh_cache)}
    assert {ours.name, recent.name} < left and old.name not in left and len(left) == 3
    removed, kept = cache.prune()  # now: everything this installation cannot use
    assert [entry.path for entry in removed] == [recent] and kept == []
    assert [entry.usable for entry in cache.entries()] == [True, True]
    Path(copy).unlink()  # the GGUF is gone: its entry is of no use to anyone
    assert {entry.reason_unusable for entry in cache.entries()} == {"its GGUF file is gone or changed", None}


def test_float_copies_an_older_gali_wrote_are_listed_and_pruned(tiny_gguf, tmp_path, fresh_cache, capsys):
    load_model(str(tiny_gguf), device="cpu")
    (ours,) = cache_contents(fresh_cache)
    older = fresh_cache / ours.name.replace(".tokenizer.", ".float32.")
    shutil.copytree(ours, older)
    manifest = json.loads((older / model_cache.MANIFEST).read_text())
    (older / "model.safetensors").write_bytes(b"\0" * 4096)
    manifest.update(format="1", dtype="float32")
    (older / model_cache.MANIFEST).write_text(json.dumps(manifest))
    entries = {entry.path: entry for entry in model_cache.GgufCompanions().entries()}
    assert entries[older].reason_unusable.startswith("written by an older gali: a float copy of the whole model")
    assert entries[older].dtype == "float32 copy" and entries[ours].usable
    assert main(["cache", "prune"]) == 0
    assert "Removed 1 model cache entry (" in capsys.readouterr().err
    assert cache_contents(fresh_cache) == [ours]


def test_gali_cache_lists_prunes_and_clears_the_model_cache(tiny_gguf, tmp_path, fresh_cache, capsys):
    copy = shutil.copy(tiny_gguf, tmp_path / "model.gguf")
    load_model(str(copy), device="cpu")
    (ours,) = cache_contents(fresh_cache)
    _as_if_written_by(ours, "5.0.0", days_ago=1)
    states = ["--cache-dir", str(tmp_path / "states")]

    def gali(*args: str) -> tuple[int, str, str]:
        code = main([*args])
        out, err = capsys.readouterr()
        return code, out, err

    code, out, err = gali("cache", "list", *states)
    assert code == 0 and "5.0.0" in out and "written by transformers 5.0.0" in out
    assert "2 model cache entries" in err and "1 not usable by this installation" in err and "gali cache prune" in err
    facts = json.loads(gali("cache", "list", "--json", *states)[1])
    assert [model["usable"] for model in facts["models"]] == [True, False]
    assert facts["models"][1]["unusable_because"] == "written by transformers 5.0.0"
    code, out, err = gali("cache", "prune")
    assert code == 0 and err.startswith("Removed 1 model cache entry (") and cache_contents(fresh_cache) == [ours]
    code, out, err = gali("cache", "clear", "--models")
    assert code == 0 and err.startswith("Removed 1 model cache entry (") and cache_contents(fresh_cache) == []


def test_a_model_cache_that_is_a_file_is_refused_before_loading(tiny_gguf, tmp_path, monkeypatch, dequantizations,
                                                                 capsys):
    (tmp_path / "cache-file").write_text("")
    monkeypatch.setenv("GALI_MODEL_CACHE", str(tmp_path / "cache-file"))
    (tmp_path / "doc.txt").write_text("The roof leaks. " * 10)
    assert main(["ppl", str(tmp_path / "doc.txt"), "-m", str(tiny_gguf)]) == 4
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "cache-file: it is a file, not a directory" in error
    assert not dequantizations


def test_a_full_disk_under_the_model_cache_is_a_one_line_error(tiny_gguf, fresh_cache, monkeypatch, capsys):
    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(model_cache.GenerationConfig, "save_pretrained", full)
    (fresh_cache.parent / "doc.txt").write_text("The roof leaks. " * 10)
    assert main(["ppl", str(fresh_cache.parent / "doc.txt"), "-m", str(tiny_gguf)]) == 4
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "cannot write the model cache in" in error and error.endswith(
        "No space left on device (GALI_MODEL_CACHE chooses another place)")
