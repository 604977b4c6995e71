"""Secure aggregation: the aggregator learns only the sum of the sites' vectors (Bonawitz et al., CCS
2017, "Practical Secure Aggregation for Privacy-Preserving Machine Learning"), with signed keys.

One round, engine-free, as messages an engine carries (the aggregator only routes and sums):

1. **advertise** — each site makes two X25519 key pairs, ``c`` (to encrypt the shares it sends) and
   ``s`` (to agree pairwise masks), and signs both public keys, its name and the round with its
   long-term key (its federation certificate's key), so the aggregator cannot swap keys.
2. **share** — each site checks every peer's signature (a bad one is refused, naming the peer), draws
   a self-mask seed ``b``, splits ``b`` and its ``s`` private key into ``n`` Shamir shares with
   threshold ``t`` (pycryptodome's GF(2^128) scheme, 16-byte halves), and encrypts each peer's shares
   with ChaCha20-Poly1305 under HKDF(X25519(c_u, c_v)); the aggregator routes ciphertexts it cannot read.
3. **mask** — each site clips its vector to ``[-clip, clip]``, encodes it in fixed point in the ring
   Z/2^32 or Z/2^64 (:class:`Quantizer`: wide enough that the sum of every site cannot wrap) and adds
   ``PRG(b_u) + Σ_{v>u} PRG(s_uv) − Σ_{v<u} PRG(s_uv)``, ``s_uv`` = HKDF(X25519(s_u, s_v)), the PRG
   ChaCha20's keystream.
4. **reveal** — each surviving site sends, for every survivor, its share of ``b`` and, for every site
   that dropped out after the shares went round, its share of ``s`` — never both for one site; the
   aggregator needs ``t`` of them per site.
5. **unmask** — the aggregator rebuilds each survivor's ``b`` and each dropped site's ``s`` key,
   removes their masks from the sum of the masked vectors and decodes it: the sum of the survivors'
   clipped vectors, within ``Quantizer.error_bound(n)`` per element.

Nothing here is a home-made cipher or RNG: X25519, HKDF-SHA256, ChaCha20(-Poly1305), ECDSA/RSA-PSS/
Ed25519 come from ``cryptography``; Shamir sharing from ``pycryptodome``; randomness from ``os.urandom``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding, rsa, x25519
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from ..errors import FedContrastError

RAW = serialization.Encoding.Raw, serialization.PublicFormat.Raw


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
    except InvalidSignature:
        return False
    return True


def _advert_bytes(site: str, round_num: int, c_pk: bytes, s_pk: bytes) -> bytes:
    return b"fedcontrast secagg v1|" + site.encode() + b"|" + str(round_num).encode() + b"|" + c_pk + s_pk


# --- a site --------------------------------------------------------------------------------------
@dataclass
class SecAggSite:
    """One site's side of one round. ``sites``: every site of the round, in order (``index`` = its
    position + 1 is its Shamir x-coordinate); ``signing_key``: its long-term private key."""

    name: str
    sites: list[str]
    threshold: int
    round_num: int
    signing_key: Any
    _c: x25519.X25519PrivateKey = field(default_factory=x25519.X25519PrivateKey.generate, repr=False)
    _s: x25519.X25519PrivateKey = field(default_factory=x25519.X25519PrivateKey.generate, repr=False)
    _b: bytes = field(default_factory=lambda: os.urandom(32), repr=False)
    peers: dict[str, dict[str, bytes]] = field(default_factory=dict, repr=False)  # verified adverts
    held: dict[str, tuple[int, bytes, bytes]] = field(default_factory=dict, repr=False)  # shares others sent me

    def advertise(self) -> dict[str, bytes]:
        c_pk, s_pk = self._c.public_key().public_bytes(*RAW), self._s.public_key().public_bytes(*RAW)
        return {"c_pk": c_pk, "s_pk": s_pk,
                "signature": sign(self.signing_key, _advert_bytes(self.name, self.round_num, c_pk, s_pk))}

    def share(self, adverts: dict[str, dict[str, bytes]], signing_keys: dict[str, Any]) -> dict[str, bytes]:
        """Checks every advert against its site's long-term public key; the encrypted shares of
        ``b`` and of the ``s`` key, one ciphertext per peer (the aggregator routes them)."""
        for site in self.sites:
            advert = adverts.get(site)
            if advert is None:
                raise SecureAggregationError(f"site {site} sent no keys for round {self.round_num + 1}")
            if site not in signing_keys or not verify(signing_keys[site], advert["signature"],
                                                      _advert_bytes(site, self.round_num, advert["c_pk"], advert["s_pk"])):
                raise SecureAggregationError(f"site {site}'s key-agreement keys for round {self.round_num + 1} do not "
                                             "carry its signature: refused (keys swapped or forged on the way)")
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
        return f"{sender}->{receiver}@{self.round_num}".encode()

    @staticmethod
    def _pair_seed(private: x25519.X25519PrivateKey, peer_public: bytes) -> bytes:
        return _kdf(private.exchange(x25519.X25519PublicKey.from_public_bytes(peer_public)), b"fedcontrast secagg mask")


# --- the aggregator --------------------------------------------------------------------------------
def unmask(masked: dict[str, np.ndarray], reveals: dict[str, dict[str, tuple[str, int, bytes]]],
           adverts: dict[str, dict[str, bytes]], sites: list[str], threshold: int, quantizer: Quantizer) -> np.ndarray:
    """The sum of the survivors' vectors from their masked vectors (``masked``: survivor → vector) and
    the survivors' reveals (survivor → its :meth:`SecAggSite.reveal`)."""
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
            shares = [(idx, share) for r in reveals.values() for target, (kind, idx, share) in r.items()
                      if target == site and kind == ("b" if site in survivors else "s")]
            if len(shares) < threshold:
                raise SecureAggregationError(f"only {len(shares)} shares of site {site}'s mask arrived, fewer than the "
                                             f"threshold {threshold}")
            secret = _combine(shares[:threshold])
            if site in survivors:
                total = total - prg(secret, size, quantizer.unsigned)
                continue
            dropped_key = x25519.X25519PrivateKey.from_private_bytes(secret)
            for other in survivors:  # the dropped site's pairwise masks left in the survivors' vectors
                pairwise = prg(SecAggSite._pair_seed(dropped_key, adverts[other]["s_pk"]), size, quantizer.unsigned)
                total = total - pairwise if sites.index(other) < sites.index(site) else total + pairwise
    return quantizer.decode(total)


# --- a round of weighted sums, all parties in one process (the simulator) --------------------------
@dataclass
class SecureRound:
    """What :func:`secure_weighted_mean` measured: the bytes one site sent (keys, shares, masked
    vector, reveals) and those it would have sent as a plain float32 upload."""

    sites: int
    threshold: int
    bytes_per_site: float
    plain_bytes_per_site: float
    site_seconds: float = 0.0  # one site's protocol work (keys, shares, masking, reveal), mean over sites
    aggregator_seconds: float = 0.0  # routing and unmasking


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


def secure_sum(vectors: dict[str, np.ndarray], settings: Any, round_num: int, *,
               dropped: tuple[str, ...] = ()) -> tuple[np.ndarray, SecureRound]:
    """``Σ vectors`` (site → float64 vector within ``[-settings.clip, settings.clip]``) by the
    protocol, every party in this process (each site with a fresh Ed25519 signing key standing in for
    its certificate's); ``dropped``: sites that go silent after masking (their vectors are not in the
    sum). Returns the sum and what it cost (:class:`SecureRound`)."""
    import time

    t0 = time.process_time()
    names = sorted(vectors)
    t = settings.sites_needed(len(names))
    private = {n: ed25519.Ed25519PrivateKey.generate() for n in names}
    sites = {n: SecAggSite(n, names, t, round_num, private[n]) for n in names}
    adverts = {n: site.advertise() for n, site in sites.items()}
    public = {n: key.public_key() for n, key in private.items()}
    boxes = {n: site.share(adverts, public) for n, site in sites.items()}
    for n, site in sites.items():
        site.receive({sender: box[n] for sender, box in boxes.items() if sender != n})
    quantizer = Quantizer.for_sites(settings.clip, len(names), settings.bits)
    masked = {n: sites[n].mask(vectors[n], quantizer) for n in names}
    survivors = [n for n in names if n not in dropped]
    reveals = {n: sites[n].reveal(survivors, [d for d in names if d in dropped]) for n in survivors}
    t1 = time.process_time()
    total = unmask({n: masked[n] for n in survivors}, reveals, adverts, names, t, quantizer)
    t2 = time.process_time()
    size = masked[names[0]].nbytes
    key_bytes = sum(len(v) for v in adverts[names[0]].values())
    share_bytes = sum(len(c) for c in boxes[names[0]].values())
    reveal_bytes = sum(1 + 1 + len(r[2]) for r in reveals[survivors[0]].values()) if survivors else 0
    plain = vectors[names[0]].size * 4
    return total, SecureRound(len(names), t, float(size + key_bytes + share_bytes + reveal_bytes), float(plain),
                              (t1 - t0) / len(names), t2 - t1)


def secure_aggregate(algorithm: Any, uploads: dict[str, dict[str, Any]], weights: dict[str, float], settings: Any,
                     round_num: int, server: Any, *, dropped: tuple[str, ...] = ()):
    """A plugin's downlink from the secure sum of its sites' :meth:`~fedcontrast.algorithms.Algorithm.secure_terms`
    (:func:`site_terms`), every party in this process: (downlink, :class:`SecureRound`)."""
    names = sorted(uploads)
    terms = {n: site_terms(algorithm, uploads[n], weights[n], settings) for n in names}
    layout = SumLayout({k: tuple(v.shape) for k, v in terms[names[0]].items()},
                       {k: v.dtype for k, v in uploads[names[0]].items()}, term_scale(algorithm, settings))
    total, cost = secure_sum({n: flatten_terms(terms[n], layout.scale) for n in names}, settings, round_num,
                             dropped=dropped)
    cost.plain_bytes_per_site = float(sum(v.numel() * v.element_size() for v in uploads[names[0]].values()) + 4)
    return layout.downlink(algorithm, total, server), cost


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


def term_scale(algorithm: Any, settings: Any) -> float:
    """What a plugin's terms are divided by before the ring (``max_samples`` for count-weighted terms,
    :meth:`~fedcontrast.algorithms.Algorithm.secure_scale`), and the sums multiplied by after."""
    return float(algorithm.secure_scale(float(settings.max_samples)))
