"""The federation's roster as the hospitals confirm it among themselves: each member's long-term key
fingerprint (``SHA256:`` and the hex SHA-256 of its public key), read from certificates, SuperNode
keys or the operator's folders, so that each site can pin its peers' keys in its own policy
(``peers:``) and no operator can put a key of its own in a peer's place under secure aggregation.
The roster also pins the federation's name and its secure-aggregation threshold, and one digest over
all of it is what the hospitals read to each other: the sites, not the operator, fix who is in a
secure sum and how many of them it takes.

Sources (any mix, engine-free; nothing is trusted because of where it came from — that is what the
out-of-band comparison is for):

* an OpenFL workspace (``cert/client/col_NAME.crt``: a site's own, or every site's at the operator);
* a Flower operator folder (``sites.json``: the registered SuperNode keys) or a folder of ``NAME.pub``;
* a certificate (PEM), an OpenSSH public key, or a private key (OpenSSH or PEM) file.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config.sections import FEDERATION_ID, default_threshold, minimum_threshold
from ..errors import ConfigError
from ..privacy.policy import roster_digest
from ..privacy.secagg import fingerprint
from ..yamlio import read_bytes


@dataclass(frozen=True)
class Member:
    name: str
    fingerprint: str
    source: str


def _certificate_name(cert: Any) -> str | None:
    from cryptography.x509.oid import NameOID

    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(names[0].value).lower() if names else None


def _from_file(path: Path, name: str | None) -> list[Member]:
    from cryptography import x509
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization

    try:
        data = read_bytes(path, "key file", limit=1 << 20)  # a FIFO or a huge file: one sentence
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from None
    stem = name or path.stem.removeprefix("col_")
    if b"-----BEGIN CERTIFICATE-----" in data:
        try:
            certs = x509.load_pem_x509_certificates(data)
        except ValueError:
            raise ConfigError(f"{path} holds a certificate that cannot be read") from None
        return [Member(name or _certificate_name(c) or stem, fingerprint(c.public_key()), str(path)) for c in certs[:1]]
    loaders = ((lambda d: serialization.load_ssh_public_key(d)),
               (lambda d: serialization.load_ssh_private_key(d, None).public_key()),
               (lambda d: serialization.load_pem_private_key(d, None).public_key()),
               (lambda d: serialization.load_pem_public_key(d)))
    for load in loaders:
        try:
            return [Member(stem, fingerprint(load(data.strip())), str(path))]
        except (ValueError, TypeError, UnsupportedAlgorithm):
            continue
    raise ConfigError(f"{path} is no certificate, public key or unencrypted private key")


def _from_folder(folder: Path, name: str | None) -> list[Member]:
    members: list[Member] = []
    registry = folder / "sites.json"  # a Flower operator folder: the keys it registered
    if registry.is_file():
        from cryptography.hazmat.primitives import serialization

        try:
            nodes = json.loads(registry.read_text())
            for site, entry in sorted(nodes.items()):
                key = serialization.load_ssh_public_key(str(entry["public_key"]).encode())
                members.append(Member(site, fingerprint(key), f"{registry} (registered)"))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ConfigError(f"{registry} is not a Flower operator's registry of site keys") from None
    for cert in sorted((folder / "cert" / "client").glob("col_*.crt")):  # an OpenFL workspace
        members += _from_file(cert, None)
    if not members:
        for key_file in sorted(folder.glob("*.pub")):  # a folder of SuperNode keys
            members += _from_file(key_file, None)
    if not members:
        raise ConfigError(f"{folder} holds no site certificate (cert/client/col_NAME.crt), registry (sites.json) or "
                          "public key (NAME.pub)")
    return members


def read_roster(paths: list[str | Path], name: str | None = None) -> list[Member]:
    """Every member found in ``paths`` (``name`` names a lone key file's site); one entry per site,
    refused when two sources disagree about a site's key."""
    found: dict[str, Member] = {}
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            raise ConfigError(f"{path} does not exist")
        for member in (_from_folder(path, name) if path.is_dir() else _from_file(path, name)):
            seen = found.get(member.name)
            if seen is not None and seen.fingerprint != member.fingerprint:
                raise ConfigError(f"{member.name} has two different keys: {seen.fingerprint} in {seen.source} and "
                                  f"{member.fingerprint} in {member.source}; find out which is right before pinning")
            found.setdefault(member.name, member)
    check_one_site_per_key(list(found.values()))
    return [found[k] for k in sorted(found)]


def check_one_site_per_key(members: list[Member]) -> None:
    """Refuse a key registered under two site names, in one sentence naming both: whoever holds it could
    speak for both sites (two shares of one secure sum, two votes of the threshold)."""
    by_key: dict[str, Member] = {}
    for member in sorted(members, key=lambda m: m.name):
        other = by_key.setdefault(member.fingerprint.lower(), member)
        if other.name != member.name:
            raise ConfigError(f"sites {other.name} and {member.name} have the same key {member.fingerprint} (in "
                              f"{other.source} and {member.source}): one party could speak for both sites; each site "
                              "needs a key of its own (make a new one for one of them) before the roster is pinned")


def roster_terms(members: list[Member], federation: str | None = None,
                 threshold: int | None = None) -> tuple[str, int, list[str]]:
    """The federation's name, its threshold and a line on each: ``federation`` checked, else one derived
    from the members' keys; ``threshold`` checked against the members' majority, else
    :func:`~fedcontrast.config.sections.default_threshold`."""
    n = len(members)
    if federation is None:
        keys = json.dumps([[m.name, m.fingerprint.lower()] for m in sorted(members, key=lambda m: m.name)])
        federation = "fed-" + hashlib.sha256(keys.encode()).hexdigest()[:12]
        named = (f"federation {federation} (derived from the members' keys, as no --federation was given: name it "
                 "with --federation ID instead when these hospitals run more than one federation)")
    elif not FEDERATION_ID.fullmatch(federation):
        raise ConfigError(f"--federation must be a name of letters, digits, '.', '_' and '-' (at most 100), got "
                          f"{federation!r}")
    else:
        named = f"federation {federation}"
    low = max(2, minimum_threshold(n))
    if threshold is None:
        threshold = default_threshold(n)
        needed = (f"threshold {threshold} of {n} (the default ⌊2n/3⌋ + 1; --threshold T sets another, from {low} to "
                  f"{n})")
    elif not low <= threshold <= n:
        raise ConfigError(f"--threshold {threshold} is outside {low}..{n} for a roster of {n} members: below a "
                          "majority an operator that lies could unmask one site, and above n no round could end")
    else:
        needed = f"threshold {threshold} of {n}"
    return federation, threshold, [named, needed]


def _yaml_text(text: str) -> str:
    """``text`` as YAML reads it back as that text (quoted where YAML would read a number, true, null …)."""
    from ..errors import ConfigError
    from ..yamlio import loads_yaml

    try:
        plain = loads_yaml(text, "a roster value") == text
    except ConfigError:  # not YAML by itself (e.g. "a: [b"): quoted
        plain = False
    return text if plain else json.dumps(text)


def format_roster(members: list[Member], federation: str | None = None, threshold: int | None = None) -> str:
    width = max(len(m.name) for m in members)
    lines = [f"{m.name:<{width}}  {m.fingerprint}  ({m.source})" for m in members]
    if len(members) < 2:  # one key: to compare with what the others hold, not a roster to pin
        return "\n".join(lines + ["", "One member: compare its fingerprint with what the other hospitals hold; the "
                                       "roster each site pins lists every member of the federation."])
    federation, threshold, notes = roster_terms(members, federation, threshold)
    digest = roster_digest(federation, threshold, {m.name: m.fingerprint for m in members})
    lines += ["", *notes, f"roster digest: {digest}", "",
              "Each hospital checks its own line above, and all read the roster digest to each other by another "
              "channel (phone, signed e-mail): it covers the federation, the threshold and every member's "
              "fingerprint, so equal digests mean equal rosters. Only then put this in your site_policy.yaml "
              "(secure aggregation then shares nothing with a peer whose key differs; with "
              "require_secure_aggregation: true, a plan of other members, another threshold or another federation "
              "is refused):", "", f"federation: {_yaml_text(federation)}", f"secure_threshold: {threshold}",
              "peers:"]
    lines += [f"  {m.name}: {m.fingerprint}" for m in members]
    return "\n".join(lines)
