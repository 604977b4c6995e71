"""`fedcontrast report WORKSPACE --score` at a site: the final model it took home, scored again on its
own held-out split (read by the data loader its collaborator uses), next to what its report states."""

import shutil

import pytest
import torch

from fedcontrast.cli import main
from fedcontrast.config import RunConfig
from fedcontrast.openfl.packing import pack, unpack
from fedcontrast.openfl.plan import create_workspace
from fedcontrast.site.report import read_rows, score_in_workspace

from .test_site_report import BASE, run_rounds


def site_workspace(tmp_path, *, finished=True):
    """A workspace (plan, cols.yaml, data.yaml: site_0,shard:0 …) where site_0's collaborator ran the
    rounds as OpenFL schedules them; the final round's downlink is another model than the initial one."""
    config = RunConfig(algorithm="moon", **BASE)
    ws = create_workspace(tmp_path / "ws", config, log=lambda m: None)
    runner, _ = run_rounds(config, ws / "local_state" / "sites", [0, 1])
    if finished:
        received = unpack(runner.initial_packed, runner.global_specs)
        generator = torch.Generator().manual_seed(1)
        packed = pack({k: v + 0.05 * torch.randn(v.shape, generator=generator) if v.is_floating_point() else v
                       for k, v in received.items()}, runner.global_specs)
        run_rounds(config, ws / "local_state" / "sites", [2], input_packed=packed)
    return ws, ws / "local_state" / "site_report" / "site_0" / "latest"  # this run's folder (site/report.py)


def report(capsys, *args):
    code = main(["report", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def test_score_prints_the_final_models_accuracy_on_the_sites_held_out_data_as_its_report_states(tmp_path, capsys):
    ws, folder = site_workspace(tmp_path)
    final = read_rows(folder)[-1]
    assert final["round"] == 2 and final["accuracy"] is not None
    code, out, err = report(capsys, ws, "--score")
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0] == (f"final model on site_0's held-out data: accuracy {final['accuracy']:.4f} (the site's report "
                        f"says {final['accuracy']:.4f})")
    assert lines[1].startswith("other metrics: ") and "loss" in lines[1]
    name, scored, reported = score_in_workspace(ws)
    assert name == "site_0" and scored["accuracy"] == final["accuracy"] == reported["accuracy"]  # exactly
    assert scored == final["evaluation"]


def test_score_before_the_final_round_says_there_is_no_final_model_yet(tmp_path, capsys):
    ws, folder = site_workspace(tmp_path, finished=False)
    code, out, err = report(capsys, ws, "--score")
    assert code == 2 and out == ""
    assert err.strip() == (f"fedcontrast: error: {folder} holds no final model yet (the last model it scored is the "
                           "one after round 1 of 2): "
                           "a site takes the final model home in the federation's final round; score it once the "
                           "federation has finished")


def test_score_without_the_sites_data_folder_is_refused(tmp_path, capsys):
    ws, _ = site_workspace(tmp_path)
    (ws / "plan" / "data.yaml").write_text("site_0,images\n")
    code, out, err = report(capsys, ws, "--score")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert err.startswith(f"fedcontrast: error: site_0's data folder {ws.resolve() / 'images'} (plan/data.yaml: "
                          "site_0,images) does not exist")


def test_several_sites_reports_need_a_name(tmp_path, capsys):
    ws, folder = site_workspace(tmp_path)
    shutil.copytree(folder.parent, folder.parent.parent / "site_1", symlinks=True)  # the local demo: every
    # collaborator on one disk
    code, out, err = report(capsys, ws, "--score")
    assert code == 2 and out == ""
    assert err.strip().endswith("holds the reports of 2 sites (site_0, site_1); say which one with --name")
    code, out, _ = report(capsys, ws, "--score", "--name", "site_0")
    assert code == 0 and out.startswith("final model on site_0's held-out data: accuracy ")
    code, _, err = report(capsys, ws, "--score", "--name", "hosp1")
    assert code == 2 and "holds no report of hosp1 (it holds site_0, site_1's)" in err
    code, out, err = report(capsys, ws, "--name", "hosp1")  # the listing too: a typo is not an empty listing
    assert code == 2 and out == "" and "holds no report of hosp1 (it holds site_0, site_1's)" in err
    code, out, _ = report(capsys, ws, "--name", "site_1")
    assert code == 0 and "site_1" in out and "site_0" not in out


@pytest.mark.parametrize("workspace", ["operator", "empty"])
def test_score_where_no_site_report_is_says_so(tmp_path, capsys, workspace):
    ws = tmp_path / "ws"
    if workspace == "operator":
        create_workspace(ws, RunConfig(algorithm="moon", **BASE), log=lambda m: None)
    code, _, err = report(capsys, ws, "--score")
    assert code == 2 and err.strip().endswith("run this in a site's workspace once the federation has run there")
