"""Who the aggregator waits for: exactly the plan's sites, each once, as plan/cols.yaml lists them.
A name missing, added (``fx collaborator certify`` appends every name it signs) or repeated would
have the federation run without a site or count one site's data twice: refused at start, in one
sentence naming the difference and the operator's step to fix it."""

import pytest
import yaml

from fedcontrast.errors import ConfigError
from fedcontrast.openfl.components import _check_collaborators
from fedcontrast.openfl.plan import create_workspace

from .conftest import small_config


def start_aggregator(ws, monkeypatch, capsys) -> str:
    """The aggregator as `fx aggregator start` builds it from the plan; its one line on stderr."""
    from openfl.federated import Plan

    monkeypatch.chdir(ws)
    plan = Plan.parse(plan_config_path=ws / "plan" / "plan.yaml", cols_config_path=ws / "plan" / "cols.yaml")
    with pytest.raises(SystemExit) as info:
        plan.get_aggregator()
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and len(err) == 1 and err[0].startswith("fedcontrast aggregator: error:"), err
    return err[0]


@pytest.mark.parametrize("cols, words", [
    (["site_0", "site_2"], "plan/cols.yaml lacks site_1, a site of the plan (site_0, site_1, site_2)"),
    (["site_0", "site_1", "site_2", "hosp_new"], "plan/cols.yaml admits hosp_new, which the plan does not name"),
    (["site_0", "site_1", "site_2", "site_1"], "plan/cols.yaml lists site_1 more than once"),
])
def test_the_aggregator_refuses_cols_yaml_that_differs_from_the_plans_sites(tmp_path, monkeypatch, capsys,
                                                                          cols, words):
    ws = create_workspace(tmp_path / "ws", small_config(algorithm="fedavg", clients=3))
    (ws / "plan" / "cols.yaml").write_text(yaml.safe_dump({"collaborators": cols}))
    before = sorted(p.relative_to(ws) for p in ws.rglob("*"))
    err = start_aggregator(ws, monkeypatch, capsys)
    assert words in err and "cols.yaml" in err
    assert "fedcontrast workspace create" in err  # the operator's explicit step
    assert sorted(p.relative_to(ws) for p in ws.rglob("*")) == before  # nothing written (no tensor.db, no report)


def test_cols_yaml_listing_exactly_the_plans_sites_is_accepted():
    config = small_config(algorithm="fedavg", clients=3)
    _check_collaborators(config, ["site_2", "site_0", "site_1"], 2)  # order is OpenFL's business
    with pytest.raises(ConfigError, match="lacks site_2"):
        _check_collaborators(config, ["site_0", "site_1"], 2)  # min_sites does not excuse a site left out
