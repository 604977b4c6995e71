"""``fedcontrast doctor``: what a site checks in its workspace before it joins a federation.

Each check gives one line: OK, WARN (nothing wrong found, but it could not be checked now) or FAIL
with the problem and what to do. The same checks run when ``fx collaborator start`` starts (and
when its connection fails); running them first saves a round-trip with the operator.
"""

from __future__ import annotations

from pathlib import Path

from ..config import RunConfig, site_names
from ..deploy.common import FAIL, OK, WARN, Check
from ..deploy.workspace import read_data_lines
from ..errors import ConfigError, FedContrastError, SiteRefusal
from .fx import read_workspace_plan


def data_lines(workspace: Path) -> dict[str, str]:
    """``plan/data.yaml``'s ``NAME,PATH`` lines read as OpenFL reads them (:func:`.plan.read_data_lines`;
    a line without a comma raises :class:`ConfigError`); {} when the file is missing."""
    path = workspace / "plan" / "data.yaml"
    if not path.is_file():
        return {}
    return read_data_lines(path)


def site_name(workspace: Path, name: str | None) -> str:
    """The site this workspace runs: ``name``, else the one site ``plan/data.yaml`` names."""
    if name:
        return name
    names = list(data_lines(workspace))
    if len(names) != 1:
        raise ConfigError(f"{workspace / 'plan' / 'data.yaml'} names {len(names)} sites "
                          f"({', '.join(names) or 'none'}); "
                          "say which one this is with --name")
    return names[0]


def is_operator_workspace(workspace: str | Path) -> bool:
    """``workspace`` is the operator's (made by ``workspace create``, the aggregator's): its
    ``plan/data.yaml`` names no site (the operator holds no data) and it holds the federation's CA, or
    no site's private key. A site's workspace holds its own data line (``site join`` writes it)."""
    ws = Path(workspace)
    try:
        if data_lines(ws):
            return False
    except ConfigError:  # a line fx would stop on: a site's file, checked as such
        return False
    return (ws / "cert" / "ca").is_dir() or not any((ws / "cert" / "client").glob("*.key"))


def operator_checks(workspace: str | Path) -> list[Check]:
    """What the operator needs in its workspace: its plan (and the code it names), the federation's CA
    and the aggregator's certificate (dates, signature, the plan's host name, the keys' permissions),
    which sites hold a signed certificate, that it holds no site's data, its transport and its run."""
    import datetime as dt

    from ..deploy.certificates import certificate_names, load_certificates, names_host, out_of_date, subject
    from ..jsonl import read_jsonl

    ws = Path(workspace)
    plan, config = read_workspace_plan(ws)
    sites = site_names(config)
    checks = [Check("role", OK, f"{ws} is the operator's workspace (plan/data.yaml names no site's data): its plan, "
                                "certificates and run are checked, not a site's"),
              Check("plan", OK, f"{config.algorithm}, {len(sites)} sites ({', '.join(sites)}), {config.rounds} rounds"
                                + (", secure aggregation" if config.secure_aggregation is not None else "")
                                + (f", DP ({', '.join(sorted(config.privacy.kinds))})" if config.privacy else "")),
              check_code(ws, plan, config)]
    now = dt.datetime.now(dt.timezone.utc)
    chain = ws / "cert" / "cert_chain.crt"
    if not (ws / "cert" / "ca").is_dir() or not chain.is_file():
        checks.append(Check("CA", WARN, f"no certificate authority in {ws / 'cert'} yet: make it with `fedcontrast ca "
                                        f"init {ws}` (or `workspace create --pki-from` an earlier workspace)"))
    else:
        try:
            authorities = load_certificates(chain)
            late = [f"{subject(c)} {why}" for c in authorities for why in [out_of_date(c, now)] if why]
        except (ConfigError, ValueError) as exc:
            authorities, late = [], [f"{chain} cannot be read ({exc})"]
        checks.append(Check("CA", FAIL, "; ".join(late) + ": make a new CA for a new experiment") if late else
                      Check("CA", OK, f"{' / '.join(subject(c) for c in authorities)} ({chain.relative_to(ws)}), valid "
                                      f"until {min(c.not_valid_after_utc for c in authorities):%Y-%m-%d}"))
        keys = sorted((ws / "cert" / "ca").glob("*/private/*.key"))
        loose = [k for k in keys if k.stat().st_mode & 0o077]
        checks.append(Check("CA keys", FAIL, f"{', '.join(map(str, loose))}: others on this machine may read them; "
                                             f"run `chmod 600` on each") if loose else
                      Check("CA keys", OK, f"{len(keys)} CA key(s) readable by their owner only"))
        checks.append(_aggregator_certificate(ws, plan, chain, names_host, certificate_names))
    signed = [s for s in sites if (ws / "cert" / "client" / f"col_{s}.crt").is_file()]
    missing = [s for s in sites if s not in signed]
    checks.append(Check("sites", WARN, f"signed: {', '.join(signed) or 'none'}; not yet: {', '.join(missing)} "
                                       f"(`fedcontrast ca sign {ws} REQUEST.zip --site S` for each site's request)")
                  if missing else Check("sites", OK, f"every site holds a certificate of this CA: {', '.join(signed)}"))
    site_keys = sorted((ws / "cert" / "client").glob("*.key"))
    checks.append(Check("data", WARN if site_keys else OK,
                        "no site's data here (plan/data.yaml names none): the sites' data stays with them"
                        + (f"; but {', '.join(p.name for p in site_keys)} is a site's private key, which belongs on "
                           "that site's machine only" if site_keys else "")))
    checks.append(check_transport(ws, plan))
    records = [r for r in read_jsonl(ws / "save" / "rounds.jsonl", "the aggregator's round records")
               if isinstance(r, dict)] if (ws / "save" / "rounds.jsonl").is_file() else []
    checks.append(Check("run", OK, f"{len(records)} of {config.rounds} rounds recorded in {ws / 'save'} "
                                   f"(`fedcontrast report {ws}`)" if records else
                        f"no round yet; start the aggregator with `cd {ws} && fx aggregator start`"))
    return checks


def _aggregator_certificate(ws: Path, plan: dict, chain: Path, names_host, certificate_names) -> Check:
    from ..deploy.certificates import check_own_certificate, load_certificates, subject

    host = str(((plan.get("network") or {}).get("settings") or {}).get("agg_addr", "")).lower()
    crt, key = ws / "cert" / "server" / f"agg_{host}.crt", ws / "cert" / "server" / f"agg_{host}.key"
    if not crt.is_file() or not key.is_file():
        return Check("aggregator certificate", FAIL, f"{crt.relative_to(ws)} or its key is missing: the aggregator "
                                                     f"cannot start TLS; make it with `fedcontrast ca init {ws}`")
    try:
        check_own_certificate(crt, key, chain)
        cert = load_certificates(crt)[0]
    except FedContrastError as exc:
        return Check("aggregator certificate", FAIL, str(exc))
    if not names_host(certificate_names(cert), host):
        names = ", ".join(certificate_names(cert))
        return Check("aggregator certificate", FAIL, f"{crt.relative_to(ws)} names {names}, not the plan's agg_addr "
                                                     f"{host} the sites connect to")
    if key.stat().st_mode & 0o077:
        return Check("aggregator certificate", FAIL, f"{key} has permissions {key.stat().st_mode & 0o777:04o}: others "
                                                     f"on this machine may read it; run `chmod 600 {key}`")
    return Check("aggregator certificate", OK, f"{crt.relative_to(ws)} ({subject(cert)}) fits its key, is signed by "
                                               f"the federation's CA and names {host}, valid until "
                                               f"{cert.not_valid_after_utc:%Y-%m-%d}")


def run_checks(workspace: str | Path, name: str | None = None, *, plan_path: str | Path | None = None,
               data_path: str | Path | None = None) -> list[Check]:
    """Every check, in order; a workspace without a readable plan raises :class:`ConfigError`.
    ``plan_path``/``data_path``: the plan and data file the collaborator will be started with (default
    the workspace's ``plan/plan.yaml`` and ``plan/data.yaml``)."""
    ws = Path(workspace)
    if plan_path is None:
        plan, config = read_workspace_plan(ws)
    else:
        from ..deploy.workspace import load_plan_file

        plan = load_plan_file(plan_path)
        config = RunConfig.from_dict(plan["task_runner"]["settings"]["run_config"])
    name = site_name(ws, name)
    network = dict(plan.get("network", {}).get("settings") or {})
    checks = [_check_name(config, name)]
    if network.get("use_tls", True):
        checks.append(check_certificate(ws, name))
    checks.append(check_aggregator(ws, name, network))
    try:
        lines = data_lines(ws) if data_path is None else read_data_lines(Path(data_path))
        data, unreadable = lines.get(name), None
    except ConfigError as exc:  # a line fx would stop on
        data, unreadable = None, Check("data", FAIL, str(exc))
    checks.append(unreadable or _check_data(ws, config, name, data))
    checks.append(_check_policy(ws, config, plan, data))
    checks.append(check_shared(ws, config))
    checks += [check_code(ws, plan, config), check_transport(ws, plan)]
    return checks


def report_check(workspace: str | Path, name: str | None) -> list[Check]:
    """What the site took home so far (``local_state/site_report/<name>/``): one run per folder, never
    rows of several runs in one table (a line, when it has a report)."""
    from ..site.report import REPORT_DIR
    from ..site.report_checks import report_checks  # engine-free: the same check on both engines

    try:
        name = site_name(Path(workspace), name)
    except ConfigError:
        return []
    own = Path(workspace) / "local_state" / REPORT_DIR / name
    return report_checks([own]) if own.is_dir() else []


def _check_name(config: RunConfig, name: str) -> Check:
    sites = site_names(config)
    if name not in sites:
        return Check("site", FAIL, f"{name} is not one of the plan's sites ({', '.join(sites)}); use the name the "
                                   "operator enrolled you under, or ask for a plan that names this site")
    return Check("site", OK, f"{name} is site {sites.index(name) + 1} of {len(sites)} in the plan ({config.algorithm}, "
                             f"{config.rounds} rounds)")


def check_shared(ws: Path, config: RunConfig) -> Check:
    """What every site must hold identically, as the collaborator will check it at start: the plan's
    public folder (its fingerprint) and the plugin's shared files (e.g. FedPCL's backbones, by hash)."""
    from ..algorithms.capabilities import check_shared_files
    from ..construction import build_algorithm
    from ..data.schema import verify_public_folder

    held = []
    try:
        if config.public_data is not None:
            verify_public_folder(config.public_data, ws)
            held.append(f"the public folder {config.public_data.folder} matches the plan's fingerprint "
                        f"{config.public_data.sha256[:16]}…")
        refuse_unlisted_plugins(ws, config)
        check_shared_files(build_algorithm(config), ws)
    except FedContrastError as exc:
        return Check("shared files", FAIL, str(exc))
    pinned = [k for k in config.hyperparameters.get(config.algorithm, {}) if "sha256" in k or "hash" in k]
    if pinned:
        held.append(f"{config.algorithm}'s shared files match the plan's hashes")
    return Check("shared files", OK, "; ".join(held) if held else "the plan shares no files among the sites")


def refuse_unlisted_plugins(ws: Path, config: RunConfig) -> None:
    """Raise :class:`SiteRefusal` (one sentence) when the workspace's site policy does not list a plugin
    module the plan imports: the doctor imports none that the collaborator would refuse."""
    from ..deploy.trust import check_policy_for_workspace
    from ..privacy.policy import plugin_violation

    unlisted = plugin_violation(config.plugins, check_policy_for_workspace(ws)) if config.plugins else None
    if unlisted is not None:
        raise SiteRefusal(unlisted)


def check_code(ws: Path, plan: dict, config: RunConfig) -> Check:
    """The workspace holds no Python file, the plan names only installed components, this machine runs
    the versions ``requirements.txt`` pins; and a raw ``fx collaborator start`` here is checked the
    same way (the guard is installed)."""
    from ..construction import algorithm_class
    from ..deploy.templates import template_problems
    from ..deploy.trust import code_files
    from ..provenance import code_lines, read_requirements
    from .guard import GUARD_PTH, covered_launchers, guard_installed

    found = code_files(ws, limit=3)
    if found:
        return Check("code", FAIL, f"the workspace holds Python code ({', '.join(map(str, found))}), which fx would "
                                   "import before the installed packages; remove it and ask the operator why it was "
                                   "sent")
    problems = template_problems(plan, "plan/plan.yaml")
    if problems:
        return Check("code", FAIL, "; ".join(problems) + "; refuse this plan and tell the operator")
    try:
        refuse_unlisted_plugins(ws, config)
        algorithm_class(config)  # the plan's plugin modules, imported as the collaborator will import them
    except FedContrastError as exc:
        return Check("code", FAIL, str(exc))
    lines = code_lines(config.algorithm, read_requirements(ws / "requirements.txt"))
    differ = [f"requirements.txt pins {c.distribution}=={c.pinned} but this machine runs "
              f"{c.installed or 'none'}" for c in lines if c.mismatch]
    if differ:
        return Check("code", FAIL, "; ".join(differ) + ": install the pinned versions (or ask the operator)")
    covered, uncovered = covered_launchers()
    if guard_installed() is None:
        return Check("code", WARN, f"the plan names only installed components, but {GUARD_PTH} is not installed in "
                                   "this environment, so a raw `fx collaborator start` would not check the workspace "
                                   "first: start with `fedcontrast site start`, or reinstall fedcontrast with pip"
                                   f" (checked first here: {', '.join(covered) or 'no launcher'})")
    return Check("code", OK, "no code in the workspace; the plan runs only installed code: "
                             + ", ".join(f"{c.distribution} {c.installed}" for c in lines if c.installed)
                             + f"; checked first whatever starts the site: {', '.join(covered)} (not: "
                             + "; ".join(uncovered) + ")")


def check_transport(ws: Path, plan: dict) -> Check:
    from ..deploy.trust import check_policy_for_workspace, transport_problems

    try:
        policy = check_policy_for_workspace(ws)
    except FedContrastError as exc:
        return Check("transport", FAIL, f"the site policy cannot be read: {exc}")
    problems = transport_problems(plan, policy, "the plan")
    if problems:
        return Check("transport", FAIL, "; ".join(problems))
    network = (plan.get("network") or {}).get("settings") or {}
    if network.get("use_tls", True) and network.get("require_client_auth", True):
        return Check("transport", OK, "mutual TLS (the aggregator and this site each prove who they are)")
    return Check("transport", WARN, "TLS or client authentication is off in the plan; this site's policy allows it")


def check_certificate(ws: Path, name: str) -> Check:
    from ..deploy.anchor import check_installed_chain
    from ..deploy.certificates import check_certificate_name, check_own_certificate, load_certificates, subject

    cert_dir = ws / "cert"
    crt, key, chain = cert_dir / "client" / f"col_{name}.crt", cert_dir / "client" / f"col_{name}.key", \
        cert_dir / "cert_chain.crt"
    missing = [str(p.relative_to(ws)) for p in (crt, key, chain) if not p.is_file()]
    if missing:
        return Check("certificate", FAIL, f"{', '.join(missing)} missing in {ws}; make this site's key and request "
                                          "with `fedcontrast site join`, then install the signed certificate with "
                                          "`fedcontrast site import-cert`")
    try:
        check_installed_chain(cert_dir)  # the CA pinned at join: nothing replaced it since
        check_own_certificate(crt, key, chain)
        check_certificate_name(crt, name)  # the aggregator admits a name only with a certificate for that name
        cert = load_certificates(crt)[0]
    except FedContrastError as exc:
        return Check("certificate", FAIL, str(exc))
    return Check("certificate", OK, f"{crt.relative_to(ws)} ({subject(cert)}) fits its key, is signed by the "
                                    f"federation's CA in {chain.relative_to(ws)} and is valid until "
                                    f"{cert.not_valid_after_utc:%Y-%m-%d}")


def check_aggregator(ws: Path, name: str, network: dict) -> Check:
    import socket

    from ..deploy.certificates import check_aggregator_certificate

    host, port = str(network.get("agg_addr")), network.get("agg_port")
    if host == "auto" or port in (None, "auto"):
        return Check("aggregator", WARN, f"the plan gives no fixed aggregator address ({host}:{port}); ask the "
                                         "operator for the plan with the aggregator's host name and port")
    where = f"{host}:{port} (the plan's agg_addr:agg_port)"
    if not network.get("use_tls", True):
        try:
            socket.create_connection((host, int(port)), timeout=3).close()
        except OSError as exc:
            return Check("aggregator", WARN, f"{where} cannot be reached now ({exc}); run the doctor again once the "
                                             "operator has started the aggregator")
        return Check("aggregator", OK, f"{where} answers (plain gRPC, no TLS)")
    cert_dir = ws / "cert"
    crt, key = cert_dir / "client" / f"col_{name}.crt", cert_dir / "client" / f"col_{name}.key"
    client = network.get("require_client_auth", True) and crt.is_file() and key.is_file()
    try:
        unreachable = check_aggregator_certificate(host, int(port), cert_dir / "cert_chain.crt",
                                                   certificate=crt if client else None,
                                                   private_key=key if client else None)
    except FedContrastError as exc:
        return Check("aggregator", FAIL, str(exc))
    if unreachable is not None and "does not resolve" in unreachable:
        return Check("aggregator", FAIL, f"{where}: {unreachable}; check the host name with the operator "
                                         "(and this machine's DNS or /etc/hosts)")
    if unreachable is not None:
        return Check("aggregator", WARN, f"{unreachable}; its certificate could not be checked: run the doctor "
                                         "again once the operator has started the aggregator")
    return Check("aggregator", OK, f"{where} presents a certificate for {host} signed by the federation's CA"
                                   + (" and accepts this site's certificate" if client else ""))


def _check_data(ws: Path, config: RunConfig, name: str, data: str | None) -> Check:
    from ..deploy.workspace import SHARD_PREFIX, shard_index  # not .loader: it imports OpenFL, which fx imports again

    if data is None:
        return Check("data", FAIL, f"plan/data.yaml has no line for {name}: add one ({name},PATH to its data), e.g. "
                                   "with `fedcontrast site join`")
    try:
        if data.startswith(SHARD_PREFIX):
            index = shard_index(data, config.clients)
            return Check("data", OK, f"{name} reads shard {index} of the plan's {config.dataset} partition")
        if config.data_schema is None:
            return Check("data", FAIL, f"this site reads its own folder {data}, but the plan has no data_schema to "
                                       "check it against; ask the operator for a plan made with `fedcontrast "
                                       "workspace create --input-shape C×H×W --classes ...`")
        from ..data.schema import summarise_folder

        folder = Path(data) if Path(data).is_absolute() else ws / data
        s = summarise_folder(folder, config.data_schema)
    except FedContrastError as exc:
        return Check("data", FAIL, f"{exc} (plan/data.yaml: {name},{data})")
    present = ", ".join(f"{c}={n}" for c, n in s.counts.items() if n)
    absent = s.missing_classes()
    return Check("data", OK, f"{s.folder} matches the plan's data schema ({s.total} images; training images per "
                             f"class: {present}" + (f"; absent: {', '.join(absent)}" if absent else "")
                             + f"; formats: {s.formats_text()})")


def _check_policy(ws: Path, config: RunConfig, plan: dict, data: str | None) -> Check:
    from ..privacy.policy import site_policy_path
    from ..site.checks import enforce_site_policy  # without OpenFL

    path = site_policy_path(ws)
    if path is None:
        return Check("policy", OK, "no site_policy.yaml in the workspace: this site sets no conditions on the plan")
    loader = plan.get("data_loader", {}).get("settings") or {}
    try:
        enforce_site_policy(config, loader.get("network"), loader.get("model_shape"), data or "", cwd=ws)
    except SiteRefusal as exc:
        return Check("policy", FAIL, str(exc))
    return Check("policy", OK, f"{path} accepts the plan")
