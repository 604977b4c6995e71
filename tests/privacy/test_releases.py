"""Everything that leaves a site is a declared release with a stated guarantee: the sample count
(noised once and accounted under DP, unless the site's policy makes it public), the tasks' and the
evaluation's metrics (withheld under DP unless the site opts in), ε; a conditional guarantee does not
pass a max-ε policy unless the policy accepts it; noise can be sampled securely."""

import json

import pytest
import torch

from fedcontrast.algorithms import available_algorithms
from fedcontrast.audit.report import audit_plan
from fedcontrast.cli import main
from fedcontrast.config import PrivacyConfig, RunConfig
from fedcontrast.openfl.loader import SiteDataLoader
from fedcontrast.openfl.packing import GLOBAL_PACKED
from fedcontrast.openfl.plan import build_plan, create_workspace
from fedcontrast.openfl.runner import WEIGHT_METRIC, PluginTaskRunner
from fedcontrast.privacy import SitePrivacy
from fedcontrast.privacy.policy import POLICY_ENV, SitePolicy, check_policy, compared_guarantee
from fedcontrast.privacy.representations import gaussian_noise
from fedcontrast.sim import Federation

REPS = {"representations": {"noise_multiplier": 2.0, "clip": 1.0}}
DP_SGD = {"dp_sgd": {"noise_multiplier": 1.0, "max_grad_norm": 1.0}}


def releases(config, policy=None):
    report = audit_plan(build_plan(config), source="t", policy=policy)
    return report, {r.name.split(" (")[0]: r for r in report.releases}


def test_without_dp_every_number_that_leaves_is_listed_as_not_covered():
    report, lines = releases(RunConfig(algorithm="moon", clients=2))
    assert lines["aggregation weight"].guarantee == "not covered" and "exact" in lines["aggregation weight"].source
    assert lines["train metrics"].guarantee == "not covered" and "contrastive" in lines["train metrics"].name
    assert lines["train metrics"].bytes_per_round == 4 * 4
    assert lines["evaluate metrics"].guarantee == "not covered" and lines["evaluate metrics"].source.startswith(
        "the site's held-out")
    assert lines["model.classifier.weight"].guarantee == "not covered"
    assert "dp_epsilon, dp_epsilon_round" not in lines


def test_under_dp_the_count_is_noised_and_accounted_and_metrics_are_withheld():
    report, lines = releases(RunConfig(algorithm="fedssc", clients=2, privacy={**DP_SGD, **REPS}))
    assert lines["aggregation weight"].guarantee == "covered" and "noised once" in lines["aggregation weight"].source
    assert lines["train metrics"].guarantee == "withheld" and lines["train metrics"].bytes_per_round == 0
    assert lines["evaluate metrics"].guarantee == "withheld"
    assert lines["dp_epsilon, dp_epsilon_round"].guarantee == "withheld"  # with DP-SGD ε reveals the exact count
    assert lines["fedssc.class_means"].guarantee == "covered" and report.guarantee_kind == "end-to-end"
    assert "not covered" not in report.guarantee
    # the site's own choices: count public, training metrics shared; the audit says what is not covered
    report, lines = releases(RunConfig(algorithm="fedssc", clients=2, privacy={**DP_SGD, **REPS}),
                             SitePolicy(public_sample_count=True, share_training_metrics=True))
    assert lines["aggregation weight"].guarantee == "public (site policy)"
    assert lines["train metrics"].guarantee == "not covered"
    assert lines["dp_epsilon, dp_epsilon_round"].guarantee == "public (site policy)"
    assert "not covered, shared by this site's choice: train metrics" in report.guarantee
    data = report.to_dict()
    assert [r["name"] for r in data["sites"][0]["releases"]] == [r.name for r in report.releases]


def test_the_noised_count_is_in_the_audited_epsilon_and_a_public_one_is_not():
    config = RunConfig(algorithm="fedpcl", clients=2, rounds=3, privacy=REPS)
    noised, _ = releases(config)
    public, _ = releases(config, SitePolicy(public_sample_count=True))
    assert noised.sites[0].epsilon_total > public.sites[0].epsilon_total


def test_fedpcls_conditional_epsilon_does_not_pass_a_max_epsilon_policy_unless_accepted():
    config = RunConfig(algorithm="fedpcl", clients=2, rounds=2,
                       privacy={"representations": {"noise_multiplier": 8.0, "clip": 1.0}})
    report, lines = releases(config)
    assert report.guarantee_kind == "conditional" and report.guarantee.startswith("conditional (given the local model)")
    assert lines["fedpcl.local_prototypes"].guarantee == "conditional"
    strict = SitePolicy(max_epsilon=100.0)  # ε ≈ 1: the number alone would pass
    assert report.sites[0].epsilon_total < 100.0
    violations = check_policy(report, strict)
    assert violations
    assert "is a conditional guarantee" in violations[0] and "accept_conditional_guarantees" in violations[0]
    assert "treated as unbounded" in compared_guarantee(report, strict)
    lenient = SitePolicy(max_epsilon=100.0, accept_conditional_guarantees=True)
    assert check_policy(report, lenient) == []
    assert "accepted by accept_conditional_guarantees" in compared_guarantee(report, lenient)
    end_to_end, _ = releases(RunConfig(algorithm="fedavg", clients=2, rounds=2, privacy=DP_SGD))
    assert compared_guarantee(end_to_end, strict) == "max_epsilon 100 against the end-to-end (sample-level) ε"


def test_cli_audit_verdict_names_the_compared_guarantee(tmp_path, capsys):
    ws = create_workspace(tmp_path / "ws", RunConfig(algorithm="fedpcl", clients=2, privacy=REPS))
    policy = tmp_path / "p.yaml"
    policy.write_text("max_epsilon: 1000\n")
    assert main(["audit", str(ws), "--policy", str(policy)]) == 1
    out = capsys.readouterr().out
    assert "conditional guarantee" in out and "treated as unbounded" in out
    assert "everything that leaves each site" in out and "aggregation weight" in out
    policy.write_text("max_epsilon: 1000\naccept_conditional_guarantees: true\n")
    assert main(["audit", str(ws), "--policy", str(policy), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["violations"] == [] and "accepted" in data["compared"]
    assert {r["guarantee"] for r in data["sites"][0]["releases"]} >= {"conditional", "covered", "withheld"}


def runner_for(config, tmp_path, monkeypatch, policy_text=None):
    if policy_text is not None:
        (tmp_path / "site_policy.yaml").write_text(policy_text)
        monkeypatch.setenv(POLICY_ENV, str(tmp_path / "site_policy.yaml"))
    plan = build_plan(config)
    loader = SiteDataLoader(data_path="shard:0", **plan["data_loader"]["settings"])
    runner = PluginTaskRunner(data_loader=loader, **{**plan["task_runner"]["settings"],
                                                     "state_dir": str(tmp_path / "sites")})
    return loader, runner


def sent(runner, task, round_num=0):
    uploads, _ = getattr(runner, task)(col_name="site_0", round_num=round_num,
                                       input_tensor_dict={GLOBAL_PACKED: runner.initial_packed.copy()})
    return {k.tensor_name: float(v) for k, v in uploads.items() if "metric" in k.tags}


def test_under_dp_a_collaborator_sends_a_noised_count_and_no_metrics(tmp_path, monkeypatch):
    config = RunConfig(algorithm="fedpcl", dataset="synthetic", image_size=16, clients=2, min_samples=5,
                       projection_dim=32, public_fraction=0.2, training={"local_epochs": 1, "batch_size": 32},
                       hyperparameters={"fedpcl": {"pretrain_epochs": 1}}, privacy=REPS)
    loader, runner = runner_for(config, tmp_path, monkeypatch)
    n = len(loader.train)
    assert sent(runner, "evaluate") == {}  # the site's evaluation stays on the site
    after_train = sent(runner, "train")
    assert set(after_train) == {"train_dp_epsilon", "train_dp_epsilon_round"}  # no loss, no accuracy
    size = loader.get_train_data_size()  # what OpenFL sends as the "train" task's data size: noised too
    metrics = sent(runner, "prototypes")
    assert metrics[WEIGHT_METRIC] != n  # the noised count (its rounding may equal n: |N(0, 10²)| < 0.5 in 4 % of draws)
    assert isinstance(size, int) and size == max(1, round(metrics[WEIGHT_METRIC]))  # an int64 protobuf field
    assert not any(k.startswith("prototypes_classes") for k in metrics)


# the evaluation of what a site received: on its held-out split and on its validation part
EVALUATED = {f"evaluate_{m}" for m in ("accuracy", "loss", "samples", "val_accuracy", "val_loss", "val_samples")}


def test_a_site_may_make_its_count_public_and_share_its_metrics(tmp_path, monkeypatch):
    config = RunConfig(algorithm="fedavg", dataset="synthetic", image_size=16, clients=2, min_samples=5,
                       projection_dim=32, training={"local_epochs": 1, "batch_size": 32}, privacy=DP_SGD)
    loader, runner = runner_for(config, tmp_path, monkeypatch, "public_sample_count: true\n"
                                "share_training_metrics: true\nshare_evaluation_metrics: true\n")
    assert set(sent(runner, "evaluate")) == EVALUATED
    metrics = sent(runner, "train")
    assert metrics[WEIGHT_METRIC] == len(loader.train)  # exact, by the site's choice
    assert {"train_loss", "train_ce", "train_accuracy", "train_dp_epsilon"} <= set(metrics)


def test_without_dp_a_site_may_still_withhold_its_metrics(tmp_path, monkeypatch):
    config = RunConfig(algorithm="fedavg", dataset="synthetic", image_size=16, clients=2, min_samples=5,
                       projection_dim=32, training={"local_epochs": 1, "batch_size": 32})
    loader, runner = runner_for(config, tmp_path, monkeypatch, "share_training_metrics: false\n")
    metrics = sent(runner, "train")
    assert metrics == {WEIGHT_METRIC: float(len(loader.train))}
    assert set(sent(runner, "evaluate")) == EVALUATED


@pytest.mark.parametrize("algorithm", available_algorithms())
def test_every_plugin_reports_only_the_metrics_it_declares(algorithm, tmp_path):
    # What the audit lists is what can leave: a metric a plugin reports without declaring it would
    # escape the audit (the OpenFL runner drops it).
    config = RunConfig(algorithm=algorithm, dataset="synthetic", clients=2, rounds=2, min_samples=5,
                       public_fraction=0.2, training={"local_epochs": 1, "batch_size": 32},
                       hyperparameters={"fedpcl": {"pretrain_epochs": 1},
                                        "flesd": {"distill_epochs": 1, "probe_epochs": 5}})
    federation = Federation(config)
    algo = federation.algorithm
    reported: dict[str, set] = {}
    original = algo.run_task

    def spy(task, site, received):
        result = original(task, site, received)
        reported.setdefault(task, set()).update(result.metrics)
        return result

    object.__setattr__(algo, "run_task", spy)  # test only: past the built plugin's guard
    for r in range(2):
        federation.run_round(r + 1)
    for task, names in reported.items():
        assert names <= set(algo.task_metrics.get(task, ())), (task, names - set(algo.task_metrics.get(task, ())))
    ctx = federation.site_context(federation.sites[0], 2, 0)
    evaluated = algo.evaluate_at_site(ctx, federation.downlink.for_site(ctx.name), federation.test)
    assert set(evaluated) <= set(algo.evaluation_metrics)
    # what the engines' evaluation sends (with the validation part's) is what the audit lists
    from fedcontrast.privacy.releases import evaluation_metric_names
    from fedcontrast.rounds import evaluate_site
    from fedcontrast.site.report import SiteReport

    report = SiteReport(tmp_path / "report", ctx.name, config.rounds, None)
    measured = evaluate_site(algo, ctx, federation.downlink.for_site(ctx.name), federation.test, report,
                             config=config, shape={}, validation=federation.site_validations[0])
    assert {*measured, "samples"} <= set(evaluation_metric_names(algo, config))
    assert {"val_accuracy", "val_samples"} <= set(measured)


def test_secure_noise_has_the_same_distribution_and_is_the_deployments_default():
    gen = torch.Generator().manual_seed(0)
    plain = gaussian_noise((200_000,), 3.0, gen)
    secure = gaussian_noise((200_000,), 3.0, torch.Generator().manual_seed(0), secure=True)
    assert abs(float(secure.std()) - 3.0) < 0.02 and abs(float(secure.mean())) < 0.03
    assert not torch.equal(plain, secure)
    # kurtosis of a Gaussian is 3: a sum of Gaussians stays Gaussian
    x = secure.double()
    assert abs(float(((x - x.mean()) ** 4).mean() / x.var() ** 2) - 3.0) < 0.05
    privacy = PrivacyConfig(**REPS)
    assert SitePrivacy(privacy, {}, round_num=0, noise_seed=None).secure  # a deployment: on
    assert not SitePrivacy(privacy, {}, round_num=0, noise_seed=1).secure  # the simulator: off by default
    forced = PrivacyConfig(**REPS, secure_mode=True)
    a = SitePrivacy(forced, {}, round_num=0, noise_seed=1).released_count(50)
    assert a == SitePrivacy(forced, {}, round_num=0, noise_seed=1).released_count(50)  # still reproducible
    assert not SitePrivacy(PrivacyConfig(**REPS, secure_mode=False), {}, round_num=0, noise_seed=None).secure


def test_dp_sgd_sessions_sample_noise_securely_when_asked():
    from fedcontrast.privacy.dp_sgd import DPSGDSession

    def session(secure):
        model = torch.nn.Linear(2, 1)
        return DPSGDSession(model, torch.optim.SGD(model.parameters(), lr=0.1), num_samples=40, batch_size=10,
                            noise_multiplier=1.0, max_grad_norm=1.0, generator=torch.Generator().manual_seed(0),
                            secure=secure)

    on, off = session(True), session(False)
    assert on.optimizer.secure_mode is True and off.optimizer.secure_mode is False
    on.close(), off.close()
    report, _ = releases(RunConfig(algorithm="fedavg", clients=2, privacy=DP_SGD))
    assert report.secure_noise.startswith("on under OpenFL")
    report, _ = releases(RunConfig(algorithm="fedavg", clients=2, privacy={**DP_SGD, "secure_mode": False}))
    assert report.secure_noise.startswith("off")
