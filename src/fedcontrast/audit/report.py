"""``fedcontrast audit``: what leaves each site under a plan, with which DP guarantee, over which
transport — read from the plugin's declarations and the plan alone (no data of the sites).

:func:`audit_plan` gathers the facts into an :class:`AuditReport`; :mod:`.policy` checks them.
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..algorithms import SecureSum
from ..config import RunConfig, site_names
from ..errors import ConfigError
from ..privacy.accounting import planned_epsilon
from ..privacy.releases import ReleaseLine, describe_releases, release_choices
from .secure import _hostile_reach, _neighbourhoods, _secure_ring  # noqa: F401 (their home was here)

GUARANTEE_KINDS = ("none", "conditional", "end-to-end", "site-level")


@dataclass(frozen=True)
class TensorLine:
    name: str
    shape: tuple[int, ...]
    dtype: str
    bytes_per_round: int
    kind: str  # weights | representation | count | metadata
    mechanism: str  # the DP mechanism applied before it leaves, or "none"


@dataclass(frozen=True)
class SiteLine:
    name: str
    data: str
    samples: int | None  # training samples; None: not known here (another site's data, or the operator's)
    samples_note: str
    epsilon_round: float  # inf: something leaves without DP
    epsilon_total: float
    classes: dict[str, int] | None = None  # training samples per class: only for data on this machine
    held_out: int | None = None  # its held-out samples (evaluated every round, never trained on)
    classes_under_minimum: list[str] | None = None  # present, but fewer than the plugin's min_class_samples


@dataclass(frozen=True)
class Certificate:
    path: str
    subject: str
    not_after: str
    days_left: int


@dataclass
class AuditReport:
    source: str
    algorithm: str
    tasks: tuple[str, ...]
    rounds: int
    delta: float | None
    accountant: str | None
    mechanisms: list[str]
    guarantee: str
    tensors: list[TensorLine]
    sites: list[SiteLine]
    tls: bool
    client_auth: bool
    certificates: list[Certificate] | None  # None: no certificates found
    class_minimum: int | None  # fewest samples behind a shared per-class feature (None: none shared)
    guarantee_kind: str = "none"  # none | conditional (given the local model) | end-to-end | site-level
    releases: list[ReleaseLine] = field(default_factory=list)  # everything that leaves (tensors and the rest)
    secure_noise: str = ""  # how DP noise is sampled under OpenFL
    notes: list[str] = field(default_factory=list)
    here: list[str] = field(default_factory=list)  # the sites whose data is on this machine (counted from it)
    code: list[Any] = field(default_factory=list)  # provenance.CodeLine: the code every party runs (pinned, here)
    foreign_code: list[str] = field(default_factory=list)  # plan components that are not installed code
    plugins: list[str] = field(default_factory=list)  # the plan's plugin modules, which every party imports
    # Secure aggregation: the fewest sites inside any sum the aggregator unmasks (None: it sees each upload)
    secure_sum_sites: int | None = None
    secure_terms: list[TensorLine] = field(default_factory=list)  # what each site masks into the sum (ring words)
    plan_sites: list[str] = field(default_factory=list)  # every site the plan names
    secure_ring: list[str] = field(default_factory=list)  # the ring's precision and what a lying party can do
    # How far one hostile site can move each value of the averaged model under secure aggregation (the
    # largest over the plugin's averages, privacy/secagg_reach.py), and the plan setting that lowers it
    secure_reach: float | None = None
    secure_reach_setting: str | None = None
    # The plan's threshold over all its sites (as the deployment engines run it) and its federation's name
    # (secure_aggregation.federation): what a site's pinned roster is checked against
    secure_threshold: int | None = None
    federation: str | None = None

    @property
    def weights_leave(self) -> list[str]:
        return [t.name for t in self.tensors if t.kind == "weights"]

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["weights_leave"] = bool(self.weights_leave)
        for site in out["sites"]:  # JSON has no infinity
            for key in ("epsilon_round", "epsilon_total"):
                site[key] = None if math.isinf(site[key]) else site[key]
            site["releases"] = out["releases"]  # what leaves this site, each with its guarantee
        return out


def _mechanisms(config: RunConfig, algorithm) -> tuple[dict[str, str], list[str]]:
    """Per tensor kind, the mechanism text; and the list of mechanisms on."""
    p = config.privacy
    by_kind = {"weights": "none", "representation": "none", "count": "none", "metadata": "none"}
    lines = []
    if p is not None and p.dp_sgd is not None:
        s = p.dp_sgd
        by_kind["weights"] = f"DP-SGD (Opacus; σ={s.noise_multiplier:g}, clip {s.max_grad_norm:g})"
        lines.append(f"DP-SGD on local training: noise multiplier {s.noise_multiplier:g}, max grad norm "
                     f"{s.max_grad_norm:g}, Poisson batches (q = 1/⌈n/{config.training.batch_size}⌉), "
                     f"{config.training.local_epochs} epochs per round")
    if p is not None and p.representations is not None and algorithm.representation_releases == 1:
        r = p.representations  # public-set representations (FLESD): see gaussian_public_representations
        by_kind["representation"] = f"Gaussian (σ={r.noise_multiplier:g} × Δ = 2√N, site-level)"
        lines.append(f"Gaussian mechanism on the public-set representations: unit rows plus noise std "
                     f"{r.noise_multiplier:g}·2√N per entry (sensitivity to any change of the site's data)")
    elif p is not None and p.representations is not None:
        r = p.representations
        by_kind["representation"] = f"Gaussian (σ={r.noise_multiplier:g}, clip C={r.clip:g}, std σC on class sums)"
        by_kind["count"] = f"Gaussian (σ={r.noise_multiplier:g}, sensitivity 1)"
        lines.append(f"Gaussian mechanism on per-class sums: each sample clipped to L2 ≤ {r.clip:g}, noise std "
                     f"{r.noise_multiplier * r.clip:g} on every class sum and {r.noise_multiplier:g} on every count")
    return by_kind, lines


def _guarantee(config: RunConfig, algorithm, tensors: list[TensorLine]) -> tuple[str, str]:
    """The kind of guarantee on the uploaded tensors (see GUARANTEE_KINDS) and its sentence."""
    if any(t.mechanism == "none" for t in tensors):
        return "none", "none: some tensors leave without differential privacy (ε unbounded)"
    p = config.privacy
    assert p is not None  # without privacy every tensor's mechanism is "none" (answered above)
    if algorithm.representation_releases == 1 and p.representations is not None:  # FLESD's public-set release
        return "site-level", ("end-to-end at site level: the noise on the public-set representations covers any "
                              "change of the site's whole data set (Δ = 2√N), whatever the local training; "
                              "sample-level follows")
    if "dp_sgd" in algorithm.dp_kinds and p.dp_sgd is None:
        return "conditional", ("conditional (given the local model): representations only; the model computing them "
                               "is trained on the same data without DP-SGD")
    if "dp_sgd" not in algorithm.dp_kinds and p.representations is not None:
        return "conditional", (f"conditional (given the local model): {algorithm.name} trains its local network "
                               "without DP-SGD, so the guarantee covers each sample's direct contribution to the "
                               "uploads, not its influence through that network")
    return "end-to-end", "end-to-end (sample-level, add/remove adjacency): every upload is covered by the accountant"


def _secure_noise(config: RunConfig) -> str:
    from ..privacy.site import secure_csprng_available

    if config.privacy is None:
        return "no DP noise"
    if config.privacy.secure_mode is False:
        return "off (privacy.secure_mode: false): plain Gaussian sampling from an OS-seeded Mersenne Twister"
    how = ("Opacus secure_mode with torchcsprng" if secure_csprng_available() else
           "Opacus's floating-point-safe Gaussian sampling from an OS-seeded Mersenne Twister (torchcsprng, "
           "which Opacus's full secure_mode needs, is not installed)")
    return f"on under OpenFL{' and in the simulator' if config.privacy.secure_mode else ''}: {how}"


def read_certificates(cert_dir: Path) -> list[Certificate] | None:
    """Every ``*.crt`` under ``cert_dir`` with its expiry; None when there are none."""
    from cryptography import x509

    paths = sorted(cert_dir.rglob("*.crt")) if cert_dir.is_dir() else []
    if not paths:
        return None
    now = dt.datetime.now(dt.timezone.utc)
    out = []
    for path in paths:
        try:
            cert = x509.load_pem_x509_certificate(path.read_bytes())
        except ValueError:
            continue
        expiry = cert.not_valid_after_utc
        out.append(Certificate(str(path.relative_to(cert_dir.parent)), cert.subject.rfc4514_string(),
                               expiry.isoformat(), (expiry - now).days))
    return out or None


NOT_HERE = "its own folder (not here)"


def _site_data(workspace: Path | None, config: RunConfig) -> list[tuple[str, str]]:
    """(site, data) per line of the workspace's ``plan/data.yaml``, then the plan's sites it has no
    line for (a site's workspace holds its own line only); without lines (no workspace, or an
    operator's, who holds no data) the plan's sites with their shards, or "its own folder"."""
    from ..config import site_names
    from ..deploy.workspace import SHARD_PREFIX, read_data_lines

    path = workspace / "plan" / "data.yaml" if workspace is not None else None
    rows = list(read_data_lines(path).items()) if path is not None and path.is_file() else []  # as fx reads it
    if rows:
        listed = {name for name, _ in rows}
        return rows + [(name, NOT_HERE) for name in site_names(config) if name not in listed]
    own = config.data_schema is not None
    return [(name, NOT_HERE if own else f"{SHARD_PREFIX}{i}") for i, name in enumerate(site_names(config))]


def _folder(data: str, workspace: Path) -> Path:
    """A data line's folder: relative paths are from the workspace (where the collaborator runs)."""
    path = Path(data).expanduser()
    return path if path.is_absolute() else workspace / path


def _sites_here(rows: list[tuple[str, str]], workspace: Path, config: RunConfig, site: str | None) -> list[str]:
    """The sites whose data is on this machine: ``site`` (checked), else every line whose folder exists.
    Shard lines of the embedded demo count only when named: anyone can compute them from the plan."""
    from ..config import site_names
    from ..deploy.workspace import SHARD_PREFIX

    if site is None:
        return [name for name, data in rows if not data.startswith(SHARD_PREFIX) and data != NOT_HERE
                and _folder(data, workspace).is_dir()]
    if site not in site_names(config):
        raise ConfigError(f"--site {site}: not a site of this plan ({', '.join(site_names(config))})")
    data = dict(rows).get(site, NOT_HERE)
    if data == NOT_HERE:
        raise ConfigError(f"{workspace / 'plan' / 'data.yaml'} has no line for {site}: add one ({site},PATH to its "
                          "data), e.g. with `fedcontrast site join`")
    if not data.startswith(SHARD_PREFIX) and not _folder(data, workspace).is_dir():
        raise ConfigError(f"{site}'s data folder {_folder(data, workspace)} (from plan/data.yaml) does not exist on "
                          "this machine; audit on the site's own machine or fix its line")
    return [site]


def _own_data(config: RunConfig, data: str, workspace: Path) -> tuple[dict[str, int], int | None]:
    """A site's data on this machine as its collaborator splits it: training samples per class (what
    its accountant and its per-class uploads count) and held-out samples — no image is decoded."""
    import numpy as np

    from ..deploy.workspace import SHARD_PREFIX, shard_index

    if data.startswith(SHARD_PREFIX):  # the embedded demo's shard N
        from ..construction import load_splits, partition

        splits = load_splits(config)
        parts = partition(config, splits)
        labels = splits.train.y.numpy()[parts[shard_index(data, len(parts))]]  # the index as its collaborator reads it
        names = splits.class_names or tuple(str(c) for c in range(splits.num_classes))
        return {name: int((labels == c).sum()) for c, name in enumerate(names)}, None
    from ..data.schema import summarise_folder
    from ..data.splits import stratified_holdout

    schema = config.data_schema
    if schema is None:
        raise ConfigError(f"plan/data.yaml names the folder {data}, but the plan has no data_schema to read it under")
    summary = summarise_folder(_folder(data, workspace), schema)
    if summary.split_folders:
        return dict(summary.counts), sum(summary.test_counts.values())
    labels = np.repeat(np.arange(len(schema.classes)), [summary.counts[c] for c in schema.classes])
    kept, held = stratified_holdout(labels, config.test_fraction, np.random.default_rng(config.split_seed))
    kept_labels = labels[kept]
    return {c: int((kept_labels == i).sum()) for i, c in enumerate(schema.classes)}, int(held.size)


def load_plan(path: str | Path) -> tuple[dict[str, Any], Path | None]:
    """A plan (from a workspace folder or a plan file) and its workspace folder, if any."""
    p = Path(path)
    if p.is_dir():
        plan_path = p / "plan" / "plan.yaml"
        if not plan_path.is_file():
            raise ConfigError(f"{p} is neither a plan file nor a workspace (no plan/plan.yaml)")
        workspace: Path | None = p
    elif p.is_file():
        plan_path = p
        workspace = p.parent.parent if p.parent.name == "plan" and p.name == "plan.yaml" else None
    else:
        raise ConfigError(f"{p} does not exist")
    from ..deploy.workspace import load_plan_file

    # a duplicate key is refused, not silently overridden; what is audited is what every component runs
    return load_plan_file(plan_path), workspace


def shard_sizes(config: RunConfig) -> list[int]:
    """Samples of each shard of the configured partition (the embedded/demo data sets)."""
    from ..construction import load_splits, partition

    return [len(p) for p in partition(config, load_splits(config))]


def audit_plan(plan: dict[str, Any], *, source: str, workspace: Path | None = None,
               sites: list[tuple[str, str]] | None = None, site_samples: dict[str, int] | None = None,
               policy: Any = None, site: str | None = None, cert_dir: Path | None = None) -> AuditReport:
    """The facts of ``plan``. ``sites`` (name, data) defaults to the workspace's ``plan/data.yaml``;
    ``site_samples`` gives a site's sample count (e.g. from its own policy) instead of the partition's;
    ``policy`` (a site's :class:`~.policy.SitePolicy`) decides what that site lets leave besides its
    uploads (its count public or noised, metrics shared or withheld; default: the plan's defaults).

    At a site (its data line's folder exists here, or ``site`` names it) that site is counted from
    its own data, and nothing is computed for the others: their data is not on this machine (given
    ``sites`` and a ``workspace``, ``site`` names the one of them whose folder is here). ``cert_dir``:
    the certificates listed (default: the workspace's ``cert/``; a Flower folder's are elsewhere)."""
    from ..construction import build_algorithm, initial_model
    from ..deploy.workspace import SHARD_PREFIX

    if site is not None and workspace is None:
        raise ConfigError(f"--site {site}: {source} is not in a workspace (WORKSPACE/plan/plan.yaml), so no "
                          "plan/data.yaml says where its data is; audit the site's workspace folder instead")
    config = RunConfig.from_dict(plan["task_runner"]["settings"]["run_config"])
    agg = plan.get("aggregator", {}).get("settings", {})
    shape = agg.get("model_shape")
    if not shape:
        from ..construction import data_shape

        shape = data_shape(config)
    rounds = int(agg.get("rounds_to_train", config.rounds))
    network = plan.get("network", {}).get("settings", {})
    algorithm = build_algorithm(config)
    if algorithm.requires_public:  # FLESD's upload shapes depend on the public set's size: built with it
        from ..construction import build_algorithm_with_public, load_public

        public = load_public(config, base_dir=workspace if workspace is not None else ".")
        algorithm = build_algorithm_with_public(config, public)
    model = initial_model(config, **shape)
    by_kind, mechanism_lines = _mechanisms(config, algorithm)
    tensors = [TensorLine(s.name, s.shape, s.dtype, s.nbytes, s.kind, by_kind[s.kind])
               for s in algorithm.upload_specs(model, shape["num_classes"])]
    kind, guarantee = _guarantee(config, algorithm, tensors)
    choices = release_choices(config.privacy, policy)
    secure, secure_sites, terms = config.secure_aggregation, None, []
    if secure is not None:  # the plugin's secure-sum terms, as words of the ring
        assert isinstance(algorithm, SecureSum)  # build_algorithm refused secure aggregation otherwise
        secure_sites = secure.sites_needed(max(1, int(round(config.sample_fraction * config.clients))))
        terms = [TensorLine(s.name, s.shape, f"int{secure.bits}", math.prod(s.shape) * secure.bits // 8, s.kind,
                            by_kind[s.kind]) for s in algorithm.secure_specs(model, shape["num_classes"])]
    releases = describe_releases(config, algorithm, tensors, choices, conditional=kind == "conditional",
                                 secure_sites=secure_sites, weight_in_sum=any(t.name == "count" for t in terms))
    uncovered = [r.name for r in releases[len(tensors):] if r.guarantee == "not covered"]
    if config.privacy is not None and uncovered:
        guarantee += f"; not covered, shared by this site's choice: {', '.join(uncovered)}"
    unbounded = any(t.mechanism == "none" for t in tensors)
    lines = []
    sizes: list[int] | None = None
    rows = sites if sites is not None else _site_data(workspace, config)
    here = (_sites_here(rows, workspace, config, site)
            if workspace is not None and (sites is None or site is not None) else [])
    minimum = algorithm.shared_class_minimum()
    for name, data in rows:
        samples, note, classes, held_out, under = (site_samples or {}).get(name), "given", None, None, None
        if samples is None and name in here and workspace is not None:  # here: only with a workspace
            classes, held_out = _own_data(config, data, workspace)
            samples, note = sum(classes.values()), "counted from its data on this machine"
            if minimum is not None:
                under = [c for c, n in classes.items() if 0 < n < minimum]
        elif samples is None and not here and data.startswith(SHARD_PREFIX) and data[len(SHARD_PREFIX):].isdigit():
            if sizes is None:
                sizes = shard_sizes(config)
            index = int(data[len(SHARD_PREFIX):])
            samples, note = (sizes[index], "shard of the plan's partition") if index < len(sizes) else (None, "")
        if samples is None:
            note = (f"not known here{': another site' if here else ''}; ε for the smallest site the plan allows "
                    f"(min_samples {config.min_samples})")
        if unbounded or config.privacy is None:
            eps_round = eps_total = math.inf
        else:
            planned = planned_epsilon(config.privacy, config.training, n=samples or config.min_samples, rounds=rounds,
                                      representations=any(t.kind != "weights" for t in tensors),
                                      representation_releases=algorithm.representation_releases,
                                      count=not choices.exact_count)
            eps_round, eps_total = planned.per_round, planned.total
        lines.append(SiteLine(name, data, samples, note, eps_round, eps_total, classes, held_out, under))
    certs = read_certificates(cert_dir if cert_dir is not None else workspace / "cert") \
        if workspace is not None else None
    from ..provenance import code_lines, read_requirements

    code = code_lines(config.algorithm, read_requirements(workspace / "requirements.txt") if workspace else None)
    from ..deploy.templates import template_problems

    hostile = _hostile_reach(config, algorithm)
    return AuditReport(code=code, foreign_code=template_problems(plan, "the plan"), plugins=list(config.plugins),
                       source=source, algorithm=config.algorithm, tasks=tuple(algorithm.tasks), rounds=rounds,
                       delta=config.privacy.delta if config.privacy else None,
                       accountant=config.privacy.accountant if config.privacy else None,
                       mechanisms=mechanism_lines or ["none"], guarantee=guarantee, tensors=tensors, sites=lines,
                       tls=bool(network.get("use_tls", True)),
                       client_auth=bool(network.get("require_client_auth", True)),
                       certificates=certs, class_minimum=minimum, guarantee_kind=kind,
                       releases=releases, secure_noise=_secure_noise(config), here=here,
                       secure_sum_sites=secure_sites, secure_terms=terms, plan_sites=site_names(config),
                       secure_ring=_secure_ring(config, algorithm),
                       secure_reach=hostile[0], secure_reach_setting=hostile[1],
                       secure_threshold=secure.sites_needed(len(site_names(config))) if secure is not None else None,
                       federation=secure.federation if secure is not None else None)
