"""Secure aggregation: the aggregator learns only the sum of the sites' vectors (Bonawitz et al., CCS
2017, "Practical Secure Aggregation for Privacy-Preserving Machine Learning", the version secure
against an actively lying server), with signed keys.

One round, engine-free, as messages an engine carries (the aggregator only routes and sums; the
order, checks and dropouts are in :mod:`.secagg_protocol`):

1. **advertise** — each site makes two X25519 key pairs, ``c`` (to encrypt the shares it sends) and
   ``s`` (to agree pairwise masks), draws a self-mask seed ``b`` and commits to it (SHA-256), and
   signs both public keys and the commitment with its long-term key (its federation certificate's or
   SuperNode key), bound to the session (the plan's digest), the round, the threshold and its name
   (:func:`bound`), so no advert replays into another round, run or federation.
2. **share** — each site checks every peer's signature against that peer's long-term key (checked
   by the engine: certificate, registration and the site's own pinned roster), splits ``b`` and its
   ``s`` private key into Shamir shares with threshold ``t`` (pycryptodome's GF(2^128) scheme,
   16-byte halves), and encrypts each peer's shares with ChaCha20-Poly1305 under
   HKDF(X25519(c_u, c_v)); the aggregator routes ciphertexts it cannot read.
3. **mask** — each site clips its vector to ``[-clip, clip]``, encodes it in fixed point in the ring
   Z/2^32 or Z/2^64 (:class:`Quantizer`: wide enough that the sum of every site cannot wrap) and adds
   ``PRG(b_u) + Σ_{v>u} PRG(s_uv) − Σ_{v<u} PRG(s_uv)``, ``s_uv`` = HKDF(X25519(s_u, s_v)), the PRG
   ChaCha20's keystream.
4. **consistency** — each site signs the survivor set U3 it was told (bound like the advert).
5. **reveal** — only once it holds at least ``t`` valid signatures over that same U3 from members of
   U3, each surviving site sends, for every survivor, its share of ``b`` and, for every site that
   dropped out after the shares went round, its share of ``s`` — never both for one site.
6. **unmask** — the aggregator rebuilds each survivor's ``b`` and each dropped site's ``s`` key,
   checks each against the site's commitment or public key (a garbage share is found and its sender
   named, never summed), removes the masks from the sum of the masked vectors and decodes it: the sum
   of the survivors' clipped vectors, within ``Quantizer.error_bound(n)`` per element.

Nothing here is a home-made cipher or RNG: X25519, HKDF-SHA256, SHA-256, ChaCha20(-Poly1305),
ECDSA/RSA-PSS/Ed25519 come from ``cryptography``; Shamir sharing from ``pycryptodome``; randomness
from ``os.urandom``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding, rsa, x25519
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from ..config.sections import colluders_tolerated, default_threshold, minimum_threshold  # noqa: F401
from ..errors import FedContrastError

RAW = serialization.Encoding.Raw, serialization.PublicFormat.Raw
PROTOCOL = "fedcontrast secagg v2"
# The decoded weighted mean may be off by at most this much per value (every site at the plan's
# min_samples); coarser settings are refused at plan time (:func:`precision`).
MAX_MEAN_ERROR = 1e-2


class SecureAggregationError(FedContrastError):
    """The protocol cannot go on (a bad signature, too few survivors, a share that does not decrypt);
    the message names the site."""


# --- fixed point in Z/2^64 --------------------------------------------------------------------------
@dataclass(frozen=True)
class Quantizer:
    """Values clipped to ``[-clip, clip]`` and scaled by ``2**frac_bits``, as two's-complement words of
    ``bits`` bits (32 or 64): sums wrap modulo 2^bits exactly like the masks, and decode correctly
    while ``|sum| < 2^(bits-1)``. A 32-bit ring sends as many bytes as float32 uploads."""

    clip: float
    frac_bits: int
    bits: int = 32

    @classmethod
    def for_sites(cls, clip: float, sites: int, bits: int = 32) -> Quantizer:
        """The finest scale at which the sum of ``sites`` clipped values cannot wrap:
        sites·clip·2^f < 2^(bits-2)."""
        if not (clip > 0 and sites >= 1) or bits not in (32, 64):
            raise SecureAggregationError(f"secure aggregation needs clip > 0, at least one site and a 32- or 64-bit "
                                         f"ring, got clip {clip}, {sites} sites, {bits} bits")
        frac_bits = bits - 2 - math.ceil(math.log2(clip * sites + 1))
        if frac_bits < 8:
            raise SecureAggregationError(f"{sites} sites with values up to {clip} leave a {bits}-bit ring under 8 bits "
                                         "of precision: lower the clip or use 64 bits")
        return cls(clip, min(frac_bits, 40), bits)

    @property
    def unsigned(self):
        return np.uint32 if self.bits == 32 else np.uint64

    @property
    def signed(self):
        return np.int32 if self.bits == 32 else np.int64

    @property
    def step(self) -> float:
        """The spacing of the ring's fixed-point values."""
        return 2.0 ** -self.frac_bits

    @property
    def reach(self) -> float:
        """How far one hostile site can move each summed value: a masked word is unverifiable, so it can
        add any word of the ring, i.e. anything in ``[-reach, reach)`` after decoding (``2^(bits-1-f)``,
        two to four times ``sites·clip``), not only values within the clip."""
        return 2.0 ** (self.bits - 1 - self.frac_bits)

    def encode(self, x: np.ndarray) -> np.ndarray:
        scaled = np.rint(np.clip(np.asarray(x, dtype=np.float64), -self.clip, self.clip) * 2.0**self.frac_bits)
        return scaled.astype(self.signed).view(self.unsigned)

    def decode(self, total: np.ndarray) -> np.ndarray:
        return total.view(self.signed).astype(np.float64) / 2.0**self.frac_bits

    def error_bound(self, sites: int) -> float:
        """Largest difference between the decoded sum and the sum of the clipped values: half a step per site."""
        return sites * 0.5 / 2.0**self.frac_bits


def prg(seed: bytes, length: int, dtype=np.uint64) -> np.ndarray:
    """``length`` words (``dtype``) of ChaCha20's keystream under the 32-byte ``seed``."""
    size = np.dtype(dtype).itemsize
    encryptor = Cipher(algorithms.ChaCha20(seed, b"\0" * 16), mode=None).encryptor()
    return np.frombuffer(encryptor.update(b"\0" * (size * length)), dtype=dtype).copy()


def _kdf(secret: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(secret)


def _split(secret: bytes, t: int, n: int) -> list[tuple[int, bytes]]:
    """A 32-byte secret as ``n`` shares (index, 32 bytes), any ``t`` of which rebuild it."""
    from Crypto.Protocol.SecretSharing import Shamir

    halves = [Shamir.split(t, n, secret[i:i + 16]) for i in (0, 16)]
    return [(a[0], a[1] + b[1]) for a, b in zip(*halves)]


def _combine(shares: list[tuple[int, bytes]]) -> bytes:
    from Crypto.Protocol.SecretSharing import Shamir

    return b"".join(Shamir.combine([(i, s[h:h + 16]) for i, s in shares]) for h in (0, 16))


def commitment(seed: bytes) -> bytes:
    """A site's commitment to its self-mask seed (SHA-256; the seed is 32 random bytes, so it hides it):
    the aggregator checks the seed it rebuilds from shares against it."""
    return hashlib.sha256(PROTOCOL.encode() + b"|self-mask seed|" + seed).digest()


def s_public(secret: bytes) -> bytes:
    """The X25519 public key of a rebuilt ``s`` private key (to check it against the site's advert)."""
    return x25519.X25519PrivateKey.from_private_bytes(secret).public_key().public_bytes(*RAW)


# --- signatures with the site's long-term key -------------------------------------------------------
def sign(key: Any, data: bytes) -> bytes:
    if isinstance(key, ec.EllipticCurvePrivateKey):
        return key.sign(data, ec.ECDSA(hashes.SHA256()))
    if isinstance(key, rsa.RSAPrivateKey):
        return key.sign(data, padding.PSS(padding.MGF1(hashes.SHA256()), padding.PSS.MAX_LENGTH), hashes.SHA256())
    if isinstance(key, ed25519.Ed25519PrivateKey):
        return key.sign(data)
    raise SecureAggregationError(f"a site's signing key must be EC, RSA or Ed25519, not {type(key).__name__}")


def verify(key: Any, signature: bytes, data: bytes) -> bool:
    try:
        if isinstance(key, ec.EllipticCurvePublicKey):
            key.verify(signature, data, ec.ECDSA(hashes.SHA256()))
        elif isinstance(key, rsa.RSAPublicKey):
            key.verify(signature, data, padding.PSS(padding.MGF1(hashes.SHA256()), padding.PSS.MAX_LENGTH),
                       hashes.SHA256())
        elif isinstance(key, ed25519.Ed25519PublicKey):
            key.verify(signature, data)
        else:
            return False
    except (InvalidSignature, ValueError):
        return False
    return True


def fingerprint(public_key: Any) -> str:
    """A long-term public key's fingerprint, ``SHA256:`` and the hex SHA-256 of its DER
    SubjectPublicKeyInfo: what hospitals read to each other to pin their peers' keys (the same for a
    certificate's key and a SuperNode's OpenSSH key)."""
    raw = public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return "SHA256:" + hashlib.sha256(raw).hexdigest()


def bound(kind: str, session: bytes, round_num: int, threshold: int, signer: str, *parts: Any) -> bytes:
    """What a site signs: ``kind`` (advert or consistency) and ``parts`` bound to the session (the
    plan's digest: federation, sites, settings, run), the round, the threshold and the signer —
    unambiguous (JSON, bytes as hex), so a signature never fits another round, run, federation or signer."""
    fields = [PROTOCOL, kind, session.hex(), int(round_num), int(threshold), signer,
              *[p.hex() if isinstance(p, bytes) else p for p in parts]]
    return json.dumps(fields, separators=(",", ":"), sort_keys=True).encode()


# --- a site --------------------------------------------------------------------------------------
@dataclass
class SecAggSite:
    """One site's side of one round. ``sites``: every site of the round, in order (``index`` = its
    position + 1 is its Shamir x-coordinate); ``signing_key``: its long-term private key;
    ``session``: the digest every party derives from its own copy of the plan (:func:`bound`)."""

    name: str
    sites: list[str]
    threshold: int
    round_num: int
    signing_key: Any
    session: bytes = b""
    _c: x25519.X25519PrivateKey = field(default_factory=x25519.X25519PrivateKey.generate, repr=False)
    _s: x25519.X25519PrivateKey = field(default_factory=x25519.X25519PrivateKey.generate, repr=False)
    _b: bytes = field(default_factory=lambda: os.urandom(32), repr=False)
    peers: dict[str, dict[str, bytes]] = field(default_factory=dict, repr=False)  # verified adverts
    held: dict[str, tuple[int, bytes, bytes]] = field(default_factory=dict, repr=False)  # shares others sent me
    signed: list[str] | None = None  # the survivor set this site signed (one per round)

    def _advert_bytes(self, site: str, advert: dict[str, bytes]) -> bytes:
        return bound("advert", self.session, self.round_num, self.threshold, site,
                     advert["c_pk"], advert["s_pk"], advert["commit"])

    def advertise(self) -> dict[str, bytes]:
        advert = {"c_pk": self._c.public_key().public_bytes(*RAW), "s_pk": self._s.public_key().public_bytes(*RAW),
                  "commit": commitment(self._b)}
        return {**advert, "signature": sign(self.signing_key, self._advert_bytes(self.name, advert))}

    def share(self, adverts: dict[str, dict[str, bytes]], signing_keys: dict[str, Any]) -> dict[str, bytes]:
        """Checks every advert against its site's long-term public key; the encrypted shares of
        ``b`` and of the ``s`` key, one ciphertext per peer (the aggregator routes them)."""
        for site in self.sites:
            advert = adverts.get(site)
            if advert is None:
                raise SecureAggregationError(f"site {site} sent no keys for round {self.round_num + 1}")
            if site not in signing_keys or not verify(signing_keys[site], advert["signature"],
                                                      self._advert_bytes(site, advert)):
                raise SecureAggregationError(f"site {site}'s key-agreement keys for round {self.round_num + 1} do not "
                                             "carry its signature over this session, round and threshold: refused "
                                             "(keys swapped, forged or replayed on the way)")
            self.peers[site] = advert
        n = len(self.sites)
        b_shares = _split(self._b, self.threshold, n)
        s_shares = _split(self._s.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                                serialization.NoEncryption()), self.threshold, n)
        out = {}
        for k, site in enumerate(self.sites):
            if site == self.name:  # its own shares stay here
                self.held[site] = (b_shares[k][0], b_shares[k][1], s_shares[k][1])
                continue
            plain = bytes([b_shares[k][0]]) + b_shares[k][1] + s_shares[k][1]
            out[site] = self._aead(site).encrypt(self._nonce(self.name, site), plain, self._aad(self.name, site))
        return out

    def receive(self, ciphertexts: dict[str, bytes]) -> None:
        """Decrypts the shares every other site sent this site (routed by the aggregator)."""
        for sender, ciphertext in ciphertexts.items():
            try:
                plain = self._aead(sender).decrypt(self._nonce(sender, self.name), ciphertext,
                                                   self._aad(sender, self.name))
            except InvalidTag:
                raise SecureAggregationError(f"the shares from site {sender} do not decrypt at site {self.name}: "
                                             "altered on the way") from None
            self.held[sender] = (plain[0], plain[1:33], plain[33:65])

    def mask(self, vector: np.ndarray, quantizer: Quantizer, peers: list[str] | None = None) -> np.ndarray:
        """The vector as the aggregator receives it: encoded, plus the self mask and pairwise masks
        with ``peers`` (default: every site; in a deployment, those whose shares arrived)."""
        y = quantizer.encode(vector).ravel()
        with np.errstate(over="ignore"):
            y = y + prg(self._b, y.size, quantizer.unsigned)
            for site in (self.sites if peers is None else peers):
                if site == self.name:
                    continue
                pairwise = prg(self._pair_seed(self._s, self.peers[site]["s_pk"]), y.size, quantizer.unsigned)
                y = y + pairwise if self.sites.index(self.name) < self.sites.index(site) else y - pairwise
        return y

    # --- the consistency round ---------------------------------------------------------------
    def _consistency_bytes(self, signer: str, survivors: list[str]) -> bytes:
        return bound("consistency", self.session, self.round_num, self.threshold, signer, sorted(survivors))

    def sign_survivors(self, survivors: list[str]) -> bytes:
        """This site's signature over the survivor set it was told; it signs one set per round."""
        if self.signed is not None and sorted(self.signed) != sorted(survivors):
            raise SecureAggregationError(f"site {self.name} was asked to sign a second survivor set in round "
                                         f"{self.round_num + 1}: refused")
        self.signed = sorted(survivors)
        return sign(self.signing_key, self._consistency_bytes(self.name, survivors))

    def check_consistency(self, signatures: dict[str, bytes], signing_keys: dict[str, Any]) -> list[str]:
        """The members of the signed survivor set whose signatures over that same set verify; refused
        with fewer than the threshold (sites were told different sets, or signatures were forged)."""
        if self.signed is None:
            raise SecureAggregationError(f"site {self.name} has signed no survivor set in round {self.round_num + 1}")
        valid = [s for s in self.signed if s in signatures and s in signing_keys
                 and verify(signing_keys[s], signatures[s], self._consistency_bytes(s, self.signed))]
        if len(valid) < self.threshold:
            bad = sorted(s for s in signatures if s not in valid)
            raise SecureAggregationError(
                f"only {len(valid)} of the sites told that {', '.join(self.signed)} survived round "
                f"{self.round_num + 1} signed that same set, fewer than the threshold {self.threshold}"
                + (f" (no valid signature from {', '.join(bad)})" if bad else "")
                + ": the aggregator may have told sites different survivor sets; nothing is revealed")
        return valid

    def reveal(self, survivors: list[str], dropped: list[str]) -> dict[str, tuple[str, int, bytes]]:
        """This site's shares for unmasking: of ``b`` for each survivor, of the ``s`` key for each
        dropped site; refused when a site is named both ways or too few survive."""
        if set(survivors) & set(dropped):
            raise SecureAggregationError(f"the aggregator asked site {self.name} to reveal both masks of "
                                         f"{', '.join(sorted(set(survivors) & set(dropped)))}: refused")
        if len(survivors) < self.threshold:
            raise SecureAggregationError(f"only {len(survivors)} sites survived round {self.round_num + 1}, fewer than "
                                         f"the threshold {self.threshold}: nothing is revealed")
        out = {}
        for site in survivors:
            index, b_share, _ = self.held[site]
            out[site] = ("b", index, b_share)
        for site in dropped:
            index, _, s_share = self.held[site]
            out[site] = ("s", index, s_share)
        return out

    # --- helpers --------------------------------------------------------------------------------
    def _aead(self, peer: str) -> ChaCha20Poly1305:
        shared = self._c.exchange(x25519.X25519PublicKey.from_public_bytes(self.peers[peer]["c_pk"]))
        return ChaCha20Poly1305(_kdf(shared, b"fedcontrast secagg shares"))

    def _nonce(self, sender: str, receiver: str) -> bytes:
        return _kdf((sender + "\0" + receiver + "\0" + str(self.round_num)).encode(), b"nonce")[:12]

    def _aad(self, sender: str, receiver: str) -> bytes:
        return f"{sender}->{receiver}@{self.round_num}|".encode() + self.session

    @staticmethod
    def _pair_seed(private: x25519.X25519PrivateKey, peer_public: bytes) -> bytes:
        return _kdf(private.exchange(x25519.X25519PublicKey.from_public_bytes(peer_public)), b"fedcontrast secagg mask")


# --- the aggregator --------------------------------------------------------------------------------
def rebuild(target: str, what: str, shares: list[tuple[str, int, bytes]], threshold: int,
            valid: Callable[[bytes], bool]) -> tuple[bytes, dict[str, str]]:
    """``target``'s secret from ``shares`` (sender, index, share), checked by ``valid`` (its
    commitment or public key), and the senders whose shares disagree with it (sender → sentence).

    A secret rebuilt from ``t`` shares equals the committed one only if every one of those shares is
    right (each enters the interpolation with a non-zero coefficient), so checking the first ``t``
    and the last ``t`` — together every share, since ``2t > n`` — checks them all at twice the cost of
    one rebuild. A window that fails is searched for a subset that rebuilds the commitment; the
    shares off it are named. When no subset works, the round ends and the suspects are named."""
    m = len(shares)
    if m < threshold:
        raise SecureAggregationError(f"only {m} shares of site {target}'s {what} arrived, fewer than the "
                                     f"threshold {threshold}")

    def combine(window: list[tuple[str, int, bytes]]) -> bytes | None:
        try:
            return _combine([(i, s) for _, i, s in window])
        except ValueError:  # repeated x-coordinates: not shares of one polynomial
            return None

    def checked(window: list[tuple[str, int, bytes]]) -> bytes | None:
        secret = combine(window)
        return secret if secret is not None and valid(secret) else None

    secret = checked(shares[:threshold])
    if secret is not None and (m == threshold or combine(shares[m - threshold:]) == secret):
        return secret, {}
    good = shares[:threshold] if secret is not None else None
    for start in range(1, m if good is None else 0):
        window = [shares[(start + j) % m] for j in range(threshold)]
        secret = checked(window)
        if secret is not None:
            good = window
            break
    if good is None or secret is None:
        raise SecureAggregationError(
            f"the {m} shares of site {target}'s {what} from {', '.join(sorted(s for s, _, _ in shares))} do not rebuild "
            f"what {target} committed to, and no {threshold} of them do (a garbage share; with more than {threshold} "
            "shares its sender is named): the round ends without a sum")
    base = good[:-1]
    bad = {sender: f"its share of site {target}'s {what} does not match what {target} committed to; left out"
           for sender, i, share in shares if (sender, i, share) not in good and checked(base + [(sender, i, share)]) is None}
    return secret, bad


def unmask(masked: dict[str, np.ndarray], reveals: dict[str, dict[str, tuple[str, int, bytes]]],
           adverts: dict[str, dict[str, bytes]], sites: list[str], threshold: int, quantizer: Quantizer,
           blamed: dict[str, str] | None = None) -> np.ndarray:
    """The sum of the survivors' vectors from their masked vectors (``masked``: survivor → vector) and
    the survivors' reveals (survivor → its :meth:`SecAggSite.reveal`). Every rebuilt secret is checked
    against the advert (``commit`` for a self-mask seed, ``s_pk`` for a dropped site's key); senders of
    shares that disagree go into ``blamed`` (sender → sentence) and are left out."""
    survivors = [s for s in sites if s in masked]
    if len(survivors) < threshold:
        raise SecureAggregationError(f"only {len(survivors)} of {len(sites)} sites sent masked uploads, fewer than the "
                                     f"threshold {threshold}; the round ends without a sum")
    size = next(iter(masked.values())).size
    total = np.zeros(size, dtype=quantizer.unsigned)
    with np.errstate(over="ignore"):
        for site in survivors:
            total = total + masked[site]
        for site in sites:
            survived = site in survivors
            kind = "b" if survived else "s"
            shares = [(sender, idx, share) for sender, r in reveals.items() for target, (k, idx, share) in r.items()
                      if target == site and k == kind]
            advert = adverts[site]
            if survived:
                check = (lambda secret, a=advert: "commit" not in a or commitment(secret) == a["commit"])
                secret, bad = rebuild(site, "self-mask seed", shares, threshold, check)
            else:
                secret, bad = rebuild(site, "pairwise-mask key", shares, threshold,
                                      lambda secret, a=advert: s_public(secret) == a["s_pk"])
            if blamed is not None:
                blamed.update(bad)
            if survived:
                total = total - prg(secret, size, quantizer.unsigned)
                continue
            dropped_key = x25519.X25519PrivateKey.from_private_bytes(secret)
            for other in survivors:  # the dropped site's pairwise masks left in the survivors' vectors
                pairwise = prg(SecAggSite._pair_seed(dropped_key, adverts[other]["s_pk"]), size, quantizer.unsigned)
                total = total - pairwise if sites.index(other) < sites.index(site) else total + pairwise
    return quantizer.decode(total)


def precision(algorithm: Any, settings: Any, sites: int, min_samples: int) -> tuple[Quantizer, float, float]:
    """The ring of a federation of ``sites`` under ``settings``, the scale of the plugin's terms in it,
    and the worst-case error of the decoded weighted mean per value when every site holds
    ``min_samples`` samples: the ring's step times the scale, over a site's count (terms weighted by
    it) — ``n·step/2`` of error in a sum of ``n`` sites, divided by at least ``n·min_samples``."""
    quantizer = Quantizer.for_sites(float(settings.clip), sites, int(settings.bits))
    scale = float(algorithm.secure_scale(float(settings.max_samples)))
    weighted = scale != 1.0
    error = quantizer.step / 2 * scale / (max(1, min_samples) if weighted else 1)
    return quantizer, scale, error


def check_precision(algorithm: Any, settings: Any, sites: int, min_samples: int) -> None:
    """Refuses settings whose ring is too coarse for the plugin's terms, in one sentence that says what to change."""
    try:
        quantizer, scale, error = precision(algorithm, settings, sites, min_samples)
    except SecureAggregationError as exc:
        raise SecureAggregationError(f"secure_aggregation: {exc}") from None
    if error > MAX_MEAN_ERROR:
        fix = ("set secure_aggregation.bits: 64" if settings.bits == 32 else "lower secure_aggregation.clip")
        raise SecureAggregationError(
            f"secure_aggregation with clip {settings.clip:g}, max_samples {settings.max_samples:g} and a {settings.bits}-bit "
            f"ring over {sites} sites leaves {quantizer.frac_bits} fractional bits (step {quantizer.step:.3g}): the "
            f"averaged model could be off by {error:.3g} per value for sites of {min_samples} samples (at most "
            f"{MAX_MEAN_ERROR:g} is allowed); {fix}, lower the clip, or lower max_samples towards the largest "
            "site's sample count")
# --- what a site masks, and what the sum becomes -------------------------------------------------
def flatten_terms(terms: dict[str, Any], scale: float) -> np.ndarray:
    """A site's secure-sum terms (name → tensor) as one float64 vector, divided by ``scale``, in name order."""
    return np.concatenate([np.asarray(terms[k].detach().cpu().double().numpy()).ravel() / scale for k in sorted(terms)])


def unflatten_terms(total: np.ndarray, layout: dict[str, tuple[int, ...]], scale: float) -> dict[str, Any]:
    """The inverse of :func:`flatten_terms` for a sum: name → float64 tensor of ``layout``'s shape, times ``scale``."""
    import torch

    out, offset = {}, 0
    for k in sorted(layout):
        size = math.prod(layout[k])
        out[k] = torch.from_numpy(total[offset:offset + size].reshape(layout[k]) * scale)
        offset += size
    if offset != total.size:
        raise SecureAggregationError(f"the secure sum has {total.size} values where the plugin's terms declare {offset}")
    return out


@dataclass(frozen=True)
class SumLayout:
    """What every party of a deployment agrees on before a round: the plugin's secure-sum terms
    (name → shape, in the order :func:`flatten_terms` lays them out), the uploads' dtypes and the
    scale of the terms in the ring (:func:`term_scale`)."""

    terms: dict[str, tuple[int, ...]]
    dtypes: dict[str, Any]  # upload name → torch dtype
    scale: float

    @classmethod
    def of(cls, algorithm: Any, specs: list[Any], settings: Any) -> SumLayout:
        """From the plugin's declared uploads (``specs``: name, shape, dtype)."""
        import torch

        zeros = {s.name: torch.zeros(tuple(s.shape), dtype=getattr(torch, s.dtype)) for s in specs}
        terms = algorithm.secure_terms(zeros, 1.0, float(settings.clip))
        return cls({k: tuple(v.shape) for k, v in terms.items()}, {k: v.dtype for k, v in zeros.items()},
                   term_scale(algorithm, settings))

    @property
    def words(self) -> int:
        """The length of the vector each site masks."""
        return sum(math.prod(shape) for shape in self.terms.values())

    def downlink(self, algorithm: Any, total: np.ndarray, server: Any) -> Any:
        """The plugin's next downlink (:meth:`~fedcontrast.algorithms.Algorithm.aggregate_secure`)
        from the unmasked sum ``total``."""
        sums = {k: v.to(server.device) for k, v in unflatten_terms(np.asarray(total), self.terms, self.scale).items()}
        return algorithm.aggregate_secure(sums, server, self.dtypes)


def site_terms(algorithm: Any, uploads: dict[str, Any], weight: float, settings: Any) -> dict[str, Any]:
    """A site's secure-sum terms, its count clipped to ``max_samples``."""
    return algorithm.secure_terms(uploads, min(float(weight), float(settings.max_samples)), float(settings.clip))


def secure_vector(algorithm: Any, uploads: dict[str, Any], weight: float, settings: Any) -> np.ndarray:
    """What a site masks: its :func:`site_terms`, scaled by :func:`term_scale` into the ring's range."""
    return flatten_terms(site_terms(algorithm, uploads, weight, settings), term_scale(algorithm, settings))


def checked_vector(site: str, algorithm: Any, uploads: dict[str, Any], weight: float, settings: Any,
                   specs: list[Any]) -> np.ndarray:
    """What a deployed site masks, once its own input passed the checks the aggregator can no longer
    make: the declared names, shapes and dtypes, finite values, the plugin's own checks
    (:meth:`~fedcontrast.algorithms.Algorithm.check_upload`), a finite count, and the terms clipped
    and finite. Raises :class:`~fedcontrast.tensors.InvalidUploadError` in one sentence; the site then
    withdraws from the round (:func:`~.secagg_protocol.withdrawal`)."""
    from ..tensors import InvalidUploadError, validate_uploads

    validate_uploads(site, uploads, specs)
    if not (math.isfinite(float(weight)) and float(weight) > 0):
        raise InvalidUploadError(f"site {site!r}'s sample count {weight!r} is not a finite positive number; rejected")
    algorithm.check_upload(site, uploads, float(weight))
    vector = secure_vector(algorithm, uploads, weight, settings)
    if not np.isfinite(vector).all():
        raise InvalidUploadError(f"site {site!r}'s secure-sum terms hold NaN or infinite values; rejected")
    return vector


def term_scale(algorithm: Any, settings: Any) -> float:
    """What a plugin's terms are divided by before the ring (``max_samples`` for count-weighted terms,
    :meth:`~fedcontrast.algorithms.Algorithm.secure_scale`), and the sums multiplied by after."""
    return float(algorithm.secure_scale(float(settings.max_samples)))
