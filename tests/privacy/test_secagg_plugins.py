"""Secure-sum variants of FedSSC (``class_reps: pooled``), FedPCL (``local_sets: global``) and FLESD
(its ensemble is a plain mean): through secure aggregation (64-bit ring) each gives the downlink of
its plain aggregate within the quantisation bound; the pooled class representations follow the
formula; the paper's variants are refused in one sentence naming the setting; a simulated round
completes; the audit shows the class means, prototypes and similarities inside the sum only."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fedcontrast.algorithms import RunFacts, ServerContext, get_algorithm, weight_tensors
from fedcontrast.algorithms.fedpcl import COUNTS, GLOBAL_PROTOTYPES, LOCAL_PROTOTYPES, LOCAL_SETS, PRESENT
from fedcontrast.algorithms.fedssc import CLASS_COUNTS, CLASS_MEANS, CLASS_PRESENT, CLASS_REPS
from fedcontrast.algorithms.flesd import REPRESENTATIONS, public_fingerprint
from fedcontrast.config import RunConfig, SecureAggregationConfig
from fedcontrast.construction import build_algorithm
from fedcontrast.errors import ConfigError
from fedcontrast.models import build_model
from fedcontrast.privacy.secagg import Quantizer
from fedcontrast.privacy.secagg_sim import secure_aggregate

SITES = ["site_0", "site_1", "site_2"]
WEIGHTS = {"site_0": 200.0, "site_1": 150.0, "site_2": 120.0}
C, D = 10, 32
SETTINGS = SecureAggregationConfig(bits=64, max_samples=1000.0)


def tolerance(largest: float, smallest_count: float = 1.0) -> float:
    """How far a secure mean may be from the plain one: the ring's error on a sum of terms (half a
    step per site, times the scale max_samples) over the smallest divisor, on the value and on its
    count, plus one float32 rounding of the result."""
    q = Quantizer.for_sites(SETTINGS.clip, len(SITES), SETTINGS.bits)
    ring = q.error_bound(len(SITES)) * SETTINGS.max_samples
    return 2 * ring * (1 + largest) / smallest_count + 2.0 ** -23 * max(1.0, largest)


def model():
    torch.manual_seed(0)
    return build_model("simple_cnn", in_channels=1, image_size=16, num_classes=C, projection_dim=D)


def class_uploads(seed: int, *, unit: bool):
    """Per-class means (unit-norm rows when ``unit``, else of norm up to ~3) and counts; a class a site
    lacks has count 0 and a zero row, counts sum to at most the site's weight."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for i, site in enumerate(SITES):
        counts = torch.randint(10, 19, (C,), generator=gen)
        counts[torch.randperm(C, generator=gen)[:3]] = 0
        counts[(i + 4) % C] = 0
        counts[0] = 12 if i == 0 else 0  # class 0: one site only
        counts[1] = 0  # class 1: nobody
        means = torch.randn(C, D, generator=gen)
        means = F.normalize(means, dim=1) if unit else means * 0.5
        means[counts == 0] = 0.0
        assert float(counts.sum()) <= WEIGHTS[site]
        out[site] = (means, counts)
    return out


def assert_same_downlink(plain, secure, tol):
    assert set(plain.global_tensors) == set(secure.global_tensors)
    for name, value in plain.global_tensors.items():
        other = secure.global_tensors[name]
        assert other.dtype == value.dtype and other.shape == value.shape, name
        assert float((value.double() - other.double()).abs().max()) <= tol, name


# --- FedSSC, class_reps: pooled ----------------------------------------------------------------------
def fedssc_uploads():
    base = weight_tensors(model())
    gen = torch.Generator().manual_seed(1)
    uploads = {}
    for site, (means, counts) in class_uploads(2, unit=False).items():
        weights = {k: (v + 0.01 * torch.randn(v.shape, generator=gen)) if v.is_floating_point() else v
                   for k, v in base.items()}
        uploads[site] = {**weights, CLASS_MEANS: means, CLASS_COUNTS: counts.long()}
    return uploads


def test_pooled_fedssc_follows_the_formula_and_secure_aggregation_gives_the_same_downlink():
    algorithm = get_algorithm("fedssc").from_settings({"class_reps": "pooled"})
    assert algorithm.secure_sum and not get_algorithm("fedssc")().secure_sum
    uploads = fedssc_uploads()
    server = ServerContext(model=model(), round_num=0, seed=3, device=torch.device("cpu"), num_classes=C, sites=SITES)
    plain = algorithm.aggregate(uploads, WEIGHTS, server)
    reps, present = plain.global_tensors[CLASS_REPS], plain.global_tensors[CLASS_PRESENT]
    for c in range(C):  # s^c = Σ_k n_kc·mean_kc / Σ_k n_kc over every sender (an explicit loop)
        n = sum(int(uploads[s][CLASS_COUNTS][c]) for s in SITES)
        expected = (sum(int(uploads[s][CLASS_COUNTS][c]) * uploads[s][CLASS_MEANS][c].double() for s in SITES) / n
                    if n else torch.zeros(D, dtype=torch.float64))
        assert float(present[c]) == float(n > 0)
        torch.testing.assert_close(reps[c].double(), expected, atol=1e-6, rtol=0)
    assert float(present[1]) == 0.0 and float(present[0]) == 1.0
    torch.testing.assert_close(reps[0], uploads["site_0"][CLASS_MEANS][0])  # one sender: its own mean
    secure, cost = secure_aggregate(algorithm, uploads, WEIGHTS, SETTINGS, 0, server)
    tol = tolerance(largest=max(float(u[CLASS_MEANS].abs().max()) for u in uploads.values()), smallest_count=10.0)
    assert tol < 1e-6
    assert_same_downlink(plain, secure, tol)
    assert secure.metrics == plain.metrics and cost.threshold == 3


# --- FedPCL, local_sets: global --------------------------------------------------------------------
@pytest.mark.parametrize("weighting", ["count", "paper_eq6"])
def test_fedpcl_with_global_local_sets_gives_the_same_downlink_under_secure_aggregation(weighting):
    algorithm = get_algorithm("fedpcl").from_settings({"local_sets": "global", "prototype_weighting": weighting})
    assert algorithm.secure_sum and not get_algorithm("fedpcl")().secure_sum
    uploads = {s: {LOCAL_PROTOTYPES: m, COUNTS: n.long()} for s, (m, n) in class_uploads(3, unit=True).items()}
    server = ServerContext(model=None, round_num=0, seed=0, device=torch.device("cpu"), num_classes=C, sites=SITES)
    plain = algorithm.aggregate(uploads, WEIGHTS, server)
    paper = (get_algorithm("fedpcl").from_settings({"prototype_weighting": weighting})
             .aggregate(uploads, WEIGHTS, server))
    assert torch.equal(plain.global_tensors[GLOBAL_PROTOTYPES], paper.global_tensors[GLOBAL_PROTOTYPES])
    sets = plain.global_tensors[LOCAL_SETS]
    assert sets.shape == (len(SITES), C, D)
    assert all(torch.equal(s, plain.global_tensors[GLOBAL_PROTOTYPES]) for s in sets)
    assert not torch.equal(sets, paper.global_tensors[LOCAL_SETS])  # the paper sends each site's own prototypes
    secure, _ = secure_aggregate(algorithm, uploads, WEIGHTS, SETTINGS, 0, server)
    tol = tolerance(largest=1.0, smallest_count=10.0)
    assert tol < 1e-6
    assert_same_downlink(plain, secure, tol)
    assert torch.equal(secure.global_tensors[PRESENT], plain.global_tensors[PRESENT])


# --- FLESD --------------------------------------------------------------------------------------------
def test_flesd_ensemble_under_secure_aggregation_is_the_plain_one():
    from fedcontrast.data import load_dataset

    public = load_dataset("synthetic", image_size=16, synthetic_samples=200, public_fraction=0.0).train.subset(
        torch.arange(100, 140))
    targets = []

    class Recording(get_algorithm("flesd")):  # test only: records each distillation target
        def distilled(self, target, srv, answered):
            targets.append(target)
            return super().distilled(target, srv, answered)

    algorithm = Recording.from_settings({"distill_epochs": 1, "distill_batch_size": 16},
                                        RunFacts(public_size=len(public)))
    assert algorithm.secure_sum
    gen = torch.Generator().manual_seed(4)
    uploads = {s: {REPRESENTATIONS: F.normalize(torch.randn(len(public), D, generator=gen), dim=1)} for s in SITES}
    server = ServerContext(model=model(), round_num=0, seed=7, device=torch.device("cpu"), num_classes=C, public=public)
    server.previous = weight_tensors(server.model)
    plain = algorithm.aggregate(uploads, WEIGHTS, server)
    secure, _ = secure_aggregate(algorithm, uploads, WEIGHTS, SETTINGS, 0, server)
    tau = algorithm.hp.target_temperature
    expected = sum(uploads[s][REPRESENTATIONS].double() @ uploads[s][REPRESENTATIONS].double().T
                   for s in SITES) / 3 / tau
    tol = tolerance(largest=1.0) / tau  # the sum of the sites' M_k, over |S| = 3 and τ_T
    assert tol < 1.3e-6  # mostly float32's own step at |M| up to 1/τ_T = 10 (9.5e-7); the ring's is ~1e-8
    torch.testing.assert_close(targets[0].double(), expected, atol=1e-5, rtol=0)
    assert float((targets[0] - targets[1]).abs().max()) <= tol
    assert secure.metrics["sites_answered"] == 3.0
    assert torch.equal(secure.global_tensors["flesd.public_fingerprint"], public_fingerprint(public))
    assert_same_downlink(plain, secure, 1e-5)  # one distillation epoch from targets within 1e-6


# --- declarations, refusals, the simulator, the audit -------------------------------------------------
def test_each_secure_terms_declaration_matches_the_terms():
    net = model()
    for name, settings, uploads in [("fedssc", {"class_reps": "pooled"}, fedssc_uploads()["site_0"]),
                                    ("fedpcl", {"local_sets": "global"},
                                     {LOCAL_PROTOTYPES: torch.zeros(C, D), COUNTS: torch.zeros(C, dtype=torch.long)}),
                                    ("flesd", {}, {REPRESENTATIONS: F.normalize(torch.randn(40, D), dim=1)})]:
        algorithm = get_algorithm(name).from_settings(settings, RunFacts(public_size=40))
        terms = algorithm.secure_terms(uploads, 200.0, 10.0)
        assert ({s.name: s.shape for s in algorithm.secure_specs(net, C)}
                == {k: tuple(v.shape) for k, v in terms.items()})
        assert all(float(v.abs().max()) <= 10.0 * 200.0 for v in terms.values()), name  # within clip·weight


@pytest.mark.parametrize("algorithm,setting", [("fedssc", "fedssc.class_reps: pooled"),
                                               ("fedpcl", "fedpcl.local_sets: global")])
def test_the_papers_variants_are_refused_in_one_sentence_naming_the_setting(algorithm, setting):
    with pytest.raises(ConfigError) as refused:
        build_algorithm(RunConfig(algorithm=algorithm, secure_aggregation={}))
    message = str(refused.value)
    assert f"set {setting} (its secure-summable variant) or turn secure aggregation off" in message
    assert message.count(". ") == 0 and "\n" not in message
    with pytest.raises(ConfigError, match="class_reps must be one of sampled, pooled"):
        get_algorithm("fedssc").from_settings({"class_reps": "all"})


VARIANTS = [("fedssc", {"class_reps": "pooled"}), ("fedpcl", {"local_sets": "global", "pretrain_epochs": 1}),
            ("flesd", {"distill_epochs": 1, "probe_epochs": 5})]


@pytest.mark.parametrize("algorithm,settings", VARIANTS)
def test_a_simulated_round_with_secure_aggregation_completes(tmp_path, algorithm, settings):
    import csv

    from fedcontrast.sim import run_simulation

    config = RunConfig(algorithm=algorithm, dataset="digits", clients=3, rounds=1, seed=1, device="cpu",
                       min_samples=5, projection_dim=32, training={"local_epochs": 1},
                       hyperparameters={algorithm: settings}, secure_aggregation={"bits": 64})
    summary = run_simulation(config, tmp_path / algorithm)
    assert summary["rounds_completed"] == 1
    with open(tmp_path / algorithm / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["round"] for r in rows if r["task"] == "secure_aggregation"] == ["1"]
    assert 0.0 <= float([r for r in rows if r["site"] == "global"][-1]["accuracy"]) <= 1.0


def audited(config):
    from fedcontrast.audit.report import audit_plan

    plan = {"task_runner": {"settings": {"run_config": config.to_dict()}}, "network": {"settings": {}},
            "aggregator": {"settings": {"rounds_to_train": config.rounds}}}
    return audit_plan(plan, source="plan", sites=[], site_samples={})


@pytest.mark.parametrize("algorithm,settings,shared,summed", [
    ("fedssc", {"class_reps": "pooled"}, "fedssc.class_means", "classes.sum"),
    ("fedpcl", {"local_sets": "global"}, "fedpcl.local_prototypes", "classes.sum"),
    ("flesd", {}, "flesd.similarity", "similarity.sum")])
def test_the_audit_shows_class_means_prototypes_and_similarities_only_inside_the_sum(algorithm, settings, shared,
                                                                                     summed):
    from fedcontrast.audit.format import format_report

    hp = {algorithm: settings} if settings else {}
    secure = audited(RunConfig(algorithm=algorithm, clients=3, hyperparameters=hp, secure_aggregation={}))
    plain = audited(RunConfig(algorithm=algorithm, clients=3, hyperparameters=hp))
    seen = {r.name: r.seen for r in secure.releases}
    assert seen[shared] == "only inside sums of >= 3 sites"
    assert {r.name: r.seen for r in plain.releases}[shared] == "individually" and not plain.secure_terms
    assert all(v == "individually" for k, v in seen.items() if "metrics" in k)  # metrics still leave one by one
    terms = {t.name: t for t in secure.secure_terms}
    assert summed in terms and terms[summed].kind == "representation" and terms[summed].dtype == "int32"
    text = format_report(secure)
    line = next(line for line in text.splitlines() if line.strip().startswith(shared) and "through the model" in line)
    assert line.endswith("[aggregator: only inside sums of >= 3 sites]")
    assert "what each site masks into the sum" in text and summed in text
