import pytest

from gali_cli import ConfigError, GaliConfig


@pytest.mark.parametrize(
    "settings, flag",
    [
        ({"train_len": 16, "local_window": 16}, "--local-window"),
        ({"chunk_size": 0}, "--chunk-size"),
        ({"train_len": 1}, "--train-len"),
        ({"local_window": -1}, "--local-window"),
        ({"noise_scale": -1.0}, "--noise-scale"),
        ({"seed": 1.5}, "--noise-seed"),
        ({"chunk_size": True}, "--chunk-size"),
    ],
)
def test_bad_settings_name_the_flag(settings, flag):
    with pytest.raises(ConfigError, match=flag):
        GaliConfig(**settings)


def test_resolved_fills_defaults_from_train_len():
    assert GaliConfig().resolved(8192) == GaliConfig(train_len=8192, chunk_size=2048, local_window=4096)
    assert GaliConfig(train_len=256).resolved(8192) == GaliConfig(train_len=256, chunk_size=64, local_window=128)
    assert GaliConfig(chunk_size=7, local_window=0).resolved(16) == GaliConfig(16, 7, 0)
    with pytest.raises(ConfigError, match="--train-len"):
        GaliConfig(train_len=9000).resolved(8192)


@pytest.mark.parametrize("arguments, variable", [
    (["--cache-dir", "~nosuchuser-gali/states"], None),
    ([], "GALI_CACHE_DIR"),
    ([], "GALI_MODEL_CACHE"),
])
def test_a_cache_path_under_an_unknown_users_home_is_a_one_line_error(arguments, variable, monkeypatch, capsys):
    from gali_cli.cli import main

    if variable:
        monkeypatch.setenv(variable, "~nosuchuser-gali/states")
    assert main(["cache", "list", *arguments]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "cannot expand '~nosuchuser-gali'" in error
    assert (variable or "--cache-dir") in error and "unexpected" not in error
