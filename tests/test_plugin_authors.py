"""What a plugin author outside this repository relies on: the public names docs/plugins.md imports,
``--plugin MODULE`` on ``simulate`` and ``workspace create`` (a file or a module name, imported before
the settings are read; one sentence for a module that is missing, broken or registers nothing), and a
page that documents every field of ``TrainingConfig`` and ``TrainStats``."""

import ast
import csv
import dataclasses
import re
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

import fedcontrast.algorithms as algorithms
from fedcontrast.algorithms import registry
from fedcontrast.algorithms.training import TrainStats
from fedcontrast.cli import main
from fedcontrast.config import RunConfig, TrainingConfig
from fedcontrast.errors import ConfigError

DOC = Path(__file__).resolve().parents[1] / "docs" / "plugins.md"
TINY = ["--dataset", "synthetic", "--image-size", "16", "--clients", "2", "--local-epochs", "1", "--min-samples", "5",
        "--public-fraction", "0", "--quiet"]  # test_cli.py's, without its one round
PLUGIN = '''
from fedcontrast.algorithms import (Algorithm, Downlink, TaskResult, load_weights, register_algorithm, weight_specs,
                                    weight_tensors)
from fedcontrast.algorithms.training import site_generator, train_supervised


@register_algorithm
class AuthorsAverage(Algorithm):
    name = "authors_average"
    task_metrics = {"train": ("loss", "accuracy")}

    def task_train(self, site, received):
        load_weights(site.model, received)
        stats = train_supervised(site.model, site.data, site.training, generator=site_generator(site.seed),
                                 device=site.device)
        return TaskResult(weight_tensors(site.model), float(len(site.data)),
                          {"loss": stats.loss, "accuracy": stats.accuracy})

    def aggregate(self, uploads, weights, server):
        return Downlink(self.average_weights(uploads, weights), metrics={"authors_sites": float(len(uploads))})

    def upload_specs(self, model, num_classes):
        return weight_specs(model, "upload", "the site's weights")
'''


@pytest.fixture
def isolated(monkeypatch, tmp_path):
    """The registry, the imported plugins, ``sys.path`` and the modules as they were after the test; the
    test runs in ``tmp_path``."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(registry, "_PLUGINS", dict(registry._PLUGINS))
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(tmp_path)
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        if name.startswith("authors_"):
            del sys.modules[name]


def write(folder: Path, name: str, source: str) -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(source))
    return path


def test_weight_specs_and_the_plugin_import_are_public():
    from fedcontrast.algorithms import import_plugin, import_plugins, weight_specs
    from fedcontrast.models import build_model

    assert {"weight_specs", "import_plugin", "import_plugins"} <= set(algorithms.__all__)
    assert callable(import_plugin) and callable(import_plugins)
    model = build_model("simple_cnn", in_channels=1, image_size=16, num_classes=3, projection_dim=8)
    specs = weight_specs(model, "upload", "weights")
    assert [s.name for s in specs] == [f"model.{key}" for key in model.state_dict()]
    assert {s.direction for s in specs} == {"upload"}


def test_the_docs_import_only_public_names_that_exist():
    """Every ``from fedcontrast... import ...`` in the page's Python blocks names something the module
    has; from ``fedcontrast.algorithms``, something in its ``__all__``."""
    import importlib

    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), re.S)
    statements = [m for block in blocks  # the statements alone: the page's first block is an outline, not Python
                  for m in re.findall(r"^from fedcontrast[\w.]* import (?:\([^)]*\)|[^\n]*)", block, re.M)]
    imported = [(node.module, alias.name) for statement in statements for node in ast.parse(statement).body
                if isinstance(node, ast.ImportFrom) for alias in node.names]
    assert ("fedcontrast.algorithms", "register_algorithm") in imported  # the example's imports were found
    for module, name in imported:
        assert hasattr(importlib.import_module(module), name), f"docs/plugins.md imports {name} from {module}"
        if module == "fedcontrast.algorithms":
            assert name in algorithms.__all__, f"docs/plugins.md imports {name}, not public in {module}"


def test_a_plugin_file_runs_a_simulation_through_the_cli(isolated, capsys):
    plugin = write(isolated, "authors_file_plugin.py", PLUGIN)
    (isolated / "run.yaml").write_text("algorithm: authors_average\n")  # the settings name the plugin's algorithm
    code = main(["simulate", "--plugin", "authors_file_plugin.py", "--config", "run.yaml", *TINY, "--rounds", "2",
                 "--name", "mine", "--runs-dir", str(isolated / "runs")])
    assert code == 0, capsys.readouterr().err
    run = isolated / "runs" / "mine"
    assert yaml.safe_load((run / "config.yaml").read_text())["plugins"] == [str(plugin)]  # absolute: resumable
    with open(run / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert {(r["round"], r["site"]) for r in rows if r["task"] == "train"} == \
        {(str(r), s) for r in (1, 2) for s in ("site_0", "site_1")}
    assert "authors_average" in registry.available_algorithms()


def test_importing_a_plugin_twice_imports_it_once(isolated):
    path = write(isolated, "authors_twice.py", PLUGIN)
    assert algorithms.import_plugin(str(path)) == ("authors_average",)
    module = sys.modules["authors_twice"]
    assert algorithms.import_plugin(str(path)) == ("authors_average",)
    assert algorithms.import_plugin("authors_twice") == ("authors_average",)  # by name: the module imported
    assert sys.modules["authors_twice"] is module


BROKEN = {
    "authors_missing_name.py": "x = undefined_name\n",
    "authors_bad_syntax.py": "def f(:\n",
    "authors_missing_dependency.py": "import authors_not_installed\n",
    "authors_nothing.py": "X = 1\n",
}


@pytest.mark.parametrize("command", ["simulate", "workspace create"])
@pytest.mark.parametrize("plugin,fragment", [
    ("authors_nowhere", "no plugin module named 'authors_nowhere' can be imported here"),
    ("authors_nowhere.py", "the plugin file authors_nowhere.py does not exist"),
    ("authors_missing_name.py", "failed to import ({folder}/authors_missing_name.py, line 1): NameError: "
                                "name 'undefined_name' is not defined"),
    ("authors_bad_syntax.py", "failed to import ({folder}/authors_bad_syntax.py, line 1): SyntaxError"),
    ("authors_missing_dependency", "the plugin authors_missing_dependency failed to import "
                                   "({folder}/authors_missing_dependency.py, line 1): ModuleNotFoundError: "
                                   "No module named 'authors_not_installed'"),
    ("authors_nothing", "the plugin authors_nothing registers no algorithm"),
    ("json", "'json' is a module of Python's standard library, not a plugin"),
    ("authors-dash", "'authors-dash' is not a Python module name"),
])
def test_a_bad_plugin_is_one_sentence_and_exit_2(isolated, capsys, command, plugin, fragment):
    for name, source in BROKEN.items():
        write(isolated, name, source)
    more = [] if command == "simulate" else ["--collaborators", "2", str(isolated / "ws")]
    code = main([*command.split(), "--plugin", plugin, *more])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert fragment.format(folder=isolated) in err
    assert len(err.splitlines()) == 1 and "Traceback" not in err


def test_a_plugin_that_fails_after_registering_leaves_nothing_registered(isolated):
    path = write(isolated, "authors_half.py", PLUGIN.replace('name = "authors_average"', 'name = "authors_half"')
                 + "\nraise RuntimeError('the plugin stops here')\n")
    with pytest.raises(ConfigError, match="RuntimeError: the plugin stops here"):
        algorithms.import_plugin(str(path))
    assert "authors_half" not in registry.available_algorithms()
    assert "authors_half" not in sys.modules


def test_workspace_create_records_a_plugin_file_by_its_module_name(isolated, capsys):
    pytest.importorskip("openfl")
    from fedcontrast.openfl.doctor import check_code
    from fedcontrast.openfl.fx import read_workspace_plan

    plugin = write(isolated, "authors_ws_plugin.py", PLUGIN)
    ws = isolated / "ws"
    code = main(["workspace", "create", "--plugin", "authors_ws_plugin.py", "--algorithm", "authors_average",
                 "--collaborators", "2", "--rounds", "1", str(ws)])
    out = capsys.readouterr().out
    assert code == 0
    plan, config = read_workspace_plan(ws)
    assert plan["task_runner"]["settings"]["run_config"]["plugins"] == ["authors_ws_plugin"]  # a name, not a path
    assert "authors_ws_plugin" in (ws / "src" / "README.md").read_text()
    assert "imports authors_ws_plugin by name: install it on every host" in out
    assert not list(ws.rglob("*.py"))  # the package carries no code: sites would refuse it
    # a host where the module cannot be imported: the doctor's code check names it
    plugin.unlink()
    del sys.modules["authors_ws_plugin"]
    registry._PLUGINS.clear()
    check = check_code(ws, plan, config)
    assert check.status == "FAIL"
    assert "no plugin module named 'authors_ws_plugin' can be imported here" in check.message


def test_a_plan_naming_a_plugin_file_is_refused():
    pytest.importorskip("openfl")
    from fedcontrast.openfl.plan import build_plan

    with pytest.raises(ConfigError, match=r"imports the plan's plugins by module name: name the module \(mine\)"):
        build_plan(RunConfig(algorithm="fedavg", clients=2, plugins=("/somewhere/mine.py",)))


def test_a_run_without_plugins_writes_its_configuration_as_before():
    assert "plugins" not in RunConfig().to_dict()
    assert RunConfig(plugins=["mylab.algorithms"]).plugins == ("mylab.algorithms",)
    with pytest.raises(ConfigError, match="plugins: 'os' is a module of Python's standard library"):
        RunConfig(plugins=("os",))


def _documented_rows(section: str) -> dict[str, list[str]]:
    """The rows of the tables under the page's heading ``section``: field → its cells."""
    text = DOC.read_text(encoding="utf-8")
    start = text.index(f"## {section}")
    end = text.find("\n## ", start + 1)
    rows = {}
    for line in text[start:end].splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if len(cells) == 4 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = cells
    return rows


@pytest.mark.parametrize("cls", [TrainingConfig, TrainStats], ids=lambda c: c.__name__)
def test_every_field_of_the_training_settings_and_statistics_is_documented(cls):
    rows = _documented_rows("Local training")
    for field in dataclasses.fields(cls):
        assert field.name in rows, f"docs/plugins.md does not document {cls.__name__}.{field.name}"
        _, typ, meaning, default = rows[field.name]
        assert typ.strip("`").replace("\\|", "|") == str(field.type), (cls.__name__, field.name, typ)
        assert meaning
        if field.default is dataclasses.MISSING:
            assert default == "—", (cls.__name__, field.name, default)
        else:
            assert ast.literal_eval(default.strip("`")) == field.default, (cls.__name__, field.name, default)
