"""Run configurations and the YAML files fedcontrast reads: a wrong type, an absurd magnitude or a key
given twice is one sentence (exit 2 on the command line) at configuration time, never a traceback or
a silent choice later."""

import pytest

from fedcontrast.cli import main
from fedcontrast.config import RunConfig
from fedcontrast.errors import ConfigError

QUICK = ["--dataset", "synthetic", "--image-size", "16", "--clients", "2", "--rounds", "1", "--local-epochs", "1",
         "--min-samples", "5", "--public-fraction", "0", "--quiet"]


def simulate_with(tmp_path, capsys, text: str) -> str:
    """``fedcontrast simulate --config`` with ``text`` as the file: exit 2, one sentence, no run written."""
    config = tmp_path / "c.yaml"
    config.write_text(text)
    runs = tmp_path / "runs"
    assert main(["simulate", "--config", str(config), *QUICK, "--runs-dir", str(runs)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert not runs.exists()
    return err


@pytest.mark.parametrize("text,fragment", [
    ("training: [1, 2]\n", "training must be a mapping of settings, got [1, 2]"),
    ("hyperparameters: {moon: [1]}\n", "hyperparameters.moon must be a mapping of settings, got [1]"),
    ("hyperparameters: [1]\n", "hyperparameters must be a mapping of settings"),
    ("algorithm: [moon]\n", "algorithm must be a string, got ['moon']"),
    ("device: 5\n", "device must be a string, got 5"),
    ("training: {lr: [1]}\n", "training.lr must be a number, got [1]"),
    ("training: {batch_size: 32.0}\n", "training.batch_size must be an integer, got 32.0"),
    ("sites: site_a\n", "sites must be a list, got 'site_a'"),
    ("privacy: {dp_sgd: {max_grad_norm: {a: 1}}}\n", "privacy.dp_sgd.max_grad_norm must be a number"),
    ("projection_dim: 1000000\n", "projection_dim must be from 1 to 65536, got 1000000"),
])
def test_wrong_types_and_sizes_in_a_config_file_are_one_sentence(tmp_path, capsys, text, fragment):
    assert fragment in simulate_with(tmp_path, capsys, text)


@pytest.mark.parametrize("settings,fragment", [
    ({"image_size": 10**6}, "image_size must be from 8 to 1024 pixels"),
    ({"image_size": "32"}, "image_size must be an integer or left out"),
    ({"projection_dim": 10**6}, "projection_dim must be from 1 to 65536"),
    ({"dataset": "imagefolder", "data_schema": {"input_shape": [1, 30000, 30000], "classes": ["a", "b"]}},
     "from 8×8 to 1024×1024 pixels, got 30000×30000"),
    ({"target_accuracy": "high"}, "target_accuracy must be a number or left out"),
])
def test_sizes_that_would_exhaust_memory_and_wrong_types_are_refused(settings, fragment):
    with pytest.raises(ConfigError) as err:
        RunConfig.from_dict(settings)
    assert fragment in str(err.value)


def test_a_key_given_twice_is_refused_naming_key_file_and_lines(tmp_path, capsys):
    err = simulate_with(tmp_path, capsys, "algorithm: moon\nrounds: 2\nrounds: 50\n")
    assert f"configuration file {tmp_path / 'c.yaml'}" in err
    assert "'rounds' is given twice (lines 2 and 3)" in err
    nested = simulate_with(tmp_path, capsys, "training:\n  lr: 0.1\n  momentum: 0.5\n  lr: 0.01\n")
    assert "'lr' is given twice (lines 2 and 4)" in nested


def test_anchors_and_merge_keys_still_load():
    # The generated plans share one copy by anchor; a merge key may be overridden, as YAML intends.
    from fedcontrast.yamlio import loads_yaml

    data = loads_yaml("a: &x {p: 1, q: 2}\nb: *x\nc:\n  <<: *x\n  p: 3\n", "test")
    assert data == {"a": {"p": 1, "q": 2}, "b": {"p": 1, "q": 2}, "c": {"p": 3, "q": 2}}
    with pytest.raises(ConfigError, match="'p' is given twice"):
        loads_yaml("c:\n  p: 1\n  p: 2\n", "test")
