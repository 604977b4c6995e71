"""A site's trust in its peers' long-term keys (:class:`PinnedKeys`: the engine's check, then the
roster the hospitals pinned) and the key inside an advert (:func:`public_key_of`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from .secagg import SecureAggregationError, fingerprint


def public_key_of(site: str, text: str) -> Any:
    """The long-term public key inside an advert's ``certificate`` text, whatever the engine put
    there (an X.509 certificate, a PEM public key, an OpenSSH key): what the aggregator checks a
    site's signed deal against (the sites check the key itself, :class:`PinnedKeys`)."""
    from cryptography import x509
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization

    data = text.strip().encode()
    loaders = ((lambda d: x509.load_pem_x509_certificate(d).public_key()), serialization.load_pem_public_key,
               serialization.load_ssh_public_key)
    for load in loaders:
        try:
            return load(data)
        except (ValueError, TypeError, UnsupportedAlgorithm):
            continue
    raise SecureAggregationError(f"site {site}'s advert carries no key the aggregator can read")


# --- a site's trust in its peers' keys ------------------------------------------------------------
class PinnedKeys:
    """A site's check of a peer's long-term key: the engine's own check (``verify(site, text)``: a
    certificate against the federation's CA, a registered SuperNode key, …) and then the site's
    roster (``pins``: site → :func:`~.secagg.fingerprint`, from its policy's ``peers:``), which the
    hospitals confirmed among themselves and the operator cannot change. A pinned peer whose key
    differs is refused; an unpinned one is refused when ``required`` (the policy requires secure
    aggregation), else accepted and listed in ``unpinned``. ``members`` and ``threshold``: the roster
    the policy pins (None: none), which :class:`SecAggSteps` checks the plan's sites and threshold against."""

    def __init__(self, verify: Callable[[str, str], Any], pins: Mapping[str, str] | None = None,
                 required: bool = False, members: list[str] | None = None, threshold: int | None = None) -> None:
        self.verify, self.pins, self.required = verify, dict(pins or {}), required
        self.members, self.threshold = members, threshold
        self.unpinned: set[str] = set()

    def __call__(self, site: str, text: str) -> Any:
        key = self.verify(site, text)
        seen = fingerprint(key)
        pinned = self.pins.get(site)
        if pinned is not None and pinned.lower() != seen.lower():
            raise SecureAggregationError(f"site {site}'s key {seen} is not the key pinned for it in this site's policy "
                                         f"({pinned}): refused, nothing is shared with it (a key substituted on the "
                                         "way, or a site that changed its key without telling the others)")
        if pinned is None:
            if self.required:
                raise SecureAggregationError(f"site {site}'s key ({seen}) is not pinned in this site's policy "
                                             "(peers:), "
                                             "which requires secure aggregation: nothing is shared with it (confirm "
                                             "its "
                                             "fingerprint with that site, e.g. by phone, and add it under peers:)")
            self.unpinned.add(site)
        return key
