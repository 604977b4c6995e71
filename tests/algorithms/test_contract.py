"""The plugin contract: run facts come in once, at construction; a built plugin takes no attribute
from outside; the core is small and the capabilities are opt-in classes."""

import ast
import dataclasses
from pathlib import Path

import pytest

from fedcontrast.algorithms import (
    Algorithm,
    PersonalEvaluation,
    RunFacts,
    SecureSum,
    SharedFiles,
    UploadChecks,
    available_algorithms,
    get_algorithm,
    secure_summable,
)
from fedcontrast.algorithms.fedavg import FedAvg
from fedcontrast.config import RunConfig
from fedcontrast.construction import build_algorithm, build_algorithm_with_public, run_facts
from fedcontrast.errors import ConfigError

SRC = Path(__file__).resolve().parents[2] / "src" / "fedcontrast"
FACTS = {f.name for f in dataclasses.fields(RunFacts)} | {"private_representations", "exact_weights", "facts", "hp"}


@pytest.mark.parametrize("name", available_algorithms())
def test_a_built_plugin_refuses_every_assignment_from_outside(name):
    plugin = build_algorithm(RunConfig(algorithm=name, clients=3))
    assert plugin.facts.num_sites == 3
    for attribute in sorted(FACTS) + ["anything_new"]:
        with pytest.raises(AttributeError, match="cannot be set from outside"):
            setattr(plugin, attribute, 1)
    with pytest.raises(AttributeError):
        del plugin.hp


def test_a_plugin_built_without_facts_gets_the_defaults():
    plugin = FedAvg()
    assert plugin.facts == RunFacts()
    assert plugin.facts.exact_weights and not plugin.facts.private_representations
    with pytest.raises(AttributeError):
        plugin.robustness = None  # the old way: set by the engine after construction


def test_the_engines_facts_follow_the_plan():
    config = RunConfig(algorithm="fedssc", clients=4, robustness={"rule": "median"},
                       privacy={"representations": {"noise_multiplier": 1.0, "clip": 1.0}})
    facts = run_facts(config, public_size=12)
    assert (facts.num_sites, facts.public_size, facts.robustness.rule) == (4, 12, "median")
    assert facts.private_representations and not facts.exact_weights
    assert facts.count_noise == config.privacy.count_noise_multiplier
    assert build_algorithm(config).facts == run_facts(config)
    with pytest.raises(ValueError):
        RunFacts(num_sites=0)


def test_a_plugin_needing_a_public_set_gets_its_size_at_construction_or_a_refusal():
    config = RunConfig(algorithm="flesd", dataset="synthetic", image_size=16, clients=2, public_fraction=0.2)
    with pytest.raises(ConfigError, match="needs a public data set"):
        build_algorithm_with_public(config, None)
    assert build_algorithm_with_public(config, list(range(30))).facts.public_size == 30


def _assigned_attributes(path: Path):
    """``(line, receiver, attribute)`` of every assignment to an attribute of something other than
    ``self``/``cls``, and of every ``setattr``/``object.__setattr__`` call on a name holding a plugin
    (the attribute's name where it is a literal)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for target in targets:
            for t in (target.elts if isinstance(target, ast.Tuple) else [target]):
                own = isinstance(t, ast.Attribute) and ast.unparse(t.value) in ("self", "cls")
                if isinstance(t, ast.Attribute) and not own:
                    yield node.lineno, ast.unparse(t.value), t.attr
        if isinstance(node, ast.Call) and ast.unparse(node.func) in ("setattr", "object.__setattr__") and node.args:
            receiver = ast.unparse(node.args[0])
            if "algorithm" in receiver or "plugin" in receiver:
                name = node.args[1] if len(node.args) > 1 else None
                yield node.lineno, receiver, name.value if isinstance(name, ast.Constant) else "<setattr>"


def test_no_code_sets_a_plugins_facts_after_construction():
    offending = []
    for path in sorted(SRC.rglob("*.py")):
        for line, receiver, attribute in _assigned_attributes(path):
            if (path.name, attribute) == ("base.py", "_built"):  # the plugin marking itself built
                continue
            if attribute in FACTS or "algorithm" in receiver or "plugin" in receiver or attribute == "<setattr>":
                offending.append(f"{path.relative_to(SRC)}:{line}: {receiver}.{attribute}")
    assert offending == []


def test_the_scan_would_find_an_engine_setting_a_fact(tmp_path):
    source = tmp_path / "engine.py"
    source.write_text("def build(algorithm, n, name):\n    algorithm.public_size = n\n    setattr(algorithm, 'x', 1)\n"
                      "    object.__setattr__(algorithm, name, 1)\n")
    assert [a for _, _, a in _assigned_attributes(source)] == ["public_size", "x", "<setattr>"]


def test_the_core_is_small_and_capabilities_are_opt_in():
    assert Algorithm.__abstractmethods__ == frozenset({"aggregate"})
    capability_members = {"secure_sum", "secure_variant", "secure_terms", "secure_scale", "aggregate_secure",
                          "secure_specs", "secure_mean", "check_upload", "check_class_counts", "check_mean_norms",
                          "count_allowance", "mean_norm_allowance", "share_files", "check_shared_files",
                          "evaluate_site", "personalized"}
    assert not capability_members & set(dir(Algorithm))
    public = [m for m in vars(Algorithm) if not m.startswith("_")]
    assert len(public) <= 24, public
    assert not secure_summable(get_algorithm("fedsiam_da")())
    assert secure_summable(get_algorithm("fedavg")()) and not secure_summable(get_algorithm("fedpcl")())
    assert isinstance(get_algorithm("fedpcl")(), (PersonalEvaluation, SharedFiles, UploadChecks, SecureSum))
    assert not isinstance(get_algorithm("fedavg")(), (PersonalEvaluation, SharedFiles, UploadChecks))
