"""Issue 46: the guard covers building any plan component, however it is reached — OpenFL's
``Plan.get_data_loader`` / ``get_task_runner``, ``Plan.build`` and ``Plan.import_`` called directly,
``fx plan initialize`` (which imports the data loader with importlib itself) — not a list of launchers.
Each refusal is one sentence, and the foreign module (which writes a marker file at import) is never
imported."""

import os
import subprocess
import sys
from pathlib import Path

import yaml

from fedcontrast.openfl.guard import OPENFL_DEFAULT_TEMPLATES, component_refusal, foreign_modules, plan_refusal
from fedcontrast.openfl.plan import build_plan, create_workspace

from .conftest import small_config
from .test_launchers import evil_workspace
from .test_package_trust import EVIL

REFUSED_PLAN = "this plan is refused before any of its components is imported: "
NOT_OURS = ("which is not the installed fedcontrast's component (fedcontrast.openfl.loader.SiteDataLoader) nor one "
            "declared by an installed plugin")


def test_which_components_are_built_and_which_modules_are_never_imported():
    plan = build_plan(small_config())
    assert plan_refusal(plan, "plan.yaml") is None and foreign_modules(plan) == set()
    for template in ("fedcontrast.openfl.loader.SiteDataLoader", "openfl.pipelines.NoCompressionPipeline",
                     *OPENFL_DEFAULT_TEMPLATES):
        assert component_refusal(template) is None
    for template in ("src.evil.EvilLoader", "subprocess.Popen", "openfl.component.Assigner", None):
        refusal = component_refusal(template)
        assert refusal.startswith(f"the plan component {template!r} is neither the installed fedcontrast's nor one "
                                  "declared by an installed plugin") and "\n" not in refusal
    plan["data_loader"]["template"] = "src.evil.EvilLoader"
    plan["task_runner"]["template"] = "fedcontrast.openfl.evil.Runner"
    assert plan_refusal(plan, "plan.yaml").startswith(REFUSED_PLAN + "plan.yaml's data_loader.template names "
                                                      "'src.evil.EvilLoader', " + NOT_OURS)
    # every module the foreign components would import, never one of fedcontrast's or OpenFL's own
    assert foreign_modules(plan) == {"src", "src.evil", "fedcontrast.openfl.evil"}
    # a component of ours named in the wrong section is refused with its plan, though its module is ours
    plan = build_plan(small_config())
    plan["data_loader"]["template"] = "fedcontrast.openfl.components.SafeAggregator"
    assert plan_refusal(plan, "plan.yaml") is not None and foreign_modules(plan) == set()


PROGRAM = """
import importlib
from pathlib import Path
from openfl.federated import Plan
from fedcontrast.deploy.trust import PackageRefused

def attempt(what, call):
    try:
        call()
        print(what, "BUILT")
    except PackageRefused as exc:
        print(what, "REFUSED", exc)

# the guard's accepted components still build
Plan.build("openfl.pipelines.NoCompressionPipeline", {})
Plan.import_("openfl.component.aggregator.straggler_handling.WaitForAllPolicy")
for name in ("plan/plan.yaml", "plan/runner.yaml"):
    plan = Plan.parse(plan_config_path=Path(name), data_config_path=Path("plan/data.yaml"))
    attempt(name + " get_data_loader", lambda: plan.get_data_loader("site_0"))
    attempt(name + " get_task_runner", lambda: plan.get_task_runner(None))
    attempt(name + " Plan.build(section)", lambda: Plan.build(**plan.config["data_loader"]))
attempt("Plan.build", lambda: Plan.build("src.evil.EvilLoader", {}))
attempt("Plan.import_", lambda: Plan.import_("src.evil.EvilLoader"))
attempt("importlib", lambda: importlib.import_module("src.evil"))
print("MARKER", Path("EVIL_RAN").exists())
"""


def test_every_way_into_a_plan_component_refuses_foreign_code_in_one_sentence(tmp_path):
    ws, env = evil_workspace(tmp_path, module_outside=True)  # only the plan names the module, on PYTHONPATH
    plan = yaml.safe_load((ws / "plan" / "plan.yaml").read_text())
    plan["data_loader"]["template"] = "fedcontrast.openfl.loader.SiteDataLoader"
    plan["task_runner"]["template"] = "src.evil.EvilLoader"  # a plan whose task runner is the foreign one
    (ws / "plan" / "runner.yaml").write_text(yaml.safe_dump(plan, sort_keys=False))
    (ws / "plan" / "data.yaml").write_text("site_0,shard:0\n")
    proc = subprocess.run([sys.executable, "-c", PROGRAM], cwd=ws, capture_output=True, text=True, timeout=180,
                          env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    results = {}
    for line in proc.stdout.splitlines():
        for verdict in (" REFUSED ", " BUILT"):
            if verdict in line:
                what, _, message = line.partition(verdict)
                results[what] = (verdict.strip(), message)
    assert "MARKER False" in proc.stdout.splitlines(), proc.stdout  # the foreign module was never imported
    assert len(results) == 9 and all(verdict == "REFUSED" for verdict, _ in results.values()), results
    assert all("\n" not in message for _, message in results.values())
    plan_file = ws / "plan" / "plan.yaml"
    for what in ("get_data_loader", "get_task_runner", "Plan.build(section)"):
        message = results[f"plan/plan.yaml {what}"][1]
        assert message == (f"{REFUSED_PLAN}{plan_file}'s data_loader.template names 'src.evil.EvilLoader', {NOT_OURS}")
        message = results[f"plan/runner.yaml {what}"][1]
        assert message.startswith(f"{REFUSED_PLAN}{ws / 'plan' / 'runner.yaml'}'s task_runner.template names "
                                  "'src.evil.EvilLoader', which is not the installed fedcontrast's component "
                                  "(fedcontrast.openfl.runner.PluginTaskRunner)")
    for what in ("Plan.build", "Plan.import_"):
        assert results[what][1] == ("the plan component 'src.evil.EvilLoader' is neither the installed fedcontrast's "
                                    "nor one declared by an installed plugin (entry points "
                                    "fedcontrast.openfl_templates): refused before its module was imported")
    assert results["importlib"][1].startswith(REFUSED_PLAN)  # a module a parsed plan names, by any route


def test_fx_plan_initialize_refuses_a_foreign_component_before_importing_it(tmp_path):
    ws = create_workspace(tmp_path / "fed", small_config())
    plan = yaml.safe_load((ws / "plan" / "plan.yaml").read_text())
    plan["data_loader"]["template"] = "src.evil.EvilLoader"
    (ws / "plan" / "plan.yaml").write_text(yaml.safe_dump(plan, sort_keys=False))
    (ws / "src" / "evil.py").write_text(EVIL)  # the operator's code in the workspace, which fx puts on sys.path
    (ws / "save" / "init.pbuf").unlink(missing_ok=True)
    fx = Path(sys.executable).with_name("fx")
    proc = subprocess.run([str(fx), "plan", "initialize"], cwd=ws, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "PYTHONPATH": ""})
    err = proc.stderr.strip()
    assert proc.returncode == 1 and "Traceback" not in err + proc.stdout, err[-3000:]
    assert len(err.splitlines()) == 1, err
    assert err == (f"fedcontrast fx plan initialize: error: {REFUSED_PLAN}{ws / 'plan' / 'plan.yaml'}'s "
                   f"data_loader.template names 'src.evil.EvilLoader', {NOT_OURS}")
    assert not (ws / "EVIL_RAN").exists()  # the operator's module was never imported
    assert not (ws / "save" / "init.pbuf").exists()
