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
   ``s`` private key into Shamir shares with threshold ``t`` (over the prime field GF(2^130 − 5),
   16-byte pieces, :mod:`.shamir`), and encrypts each peer's shares with ChaCha20-Poly1305 under
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

Above a few dozen sites the masks and shares run over each site's neighbourhood on a random graph
instead of every site (SecAgg+, Bell et al., CCS 2020: :mod:`.secagg_graph`): ``SecAggSite.sites`` is
then its neighbourhood and ``share_threshold`` its ``t_k``.

Nothing here is a home-made cipher or RNG: X25519, HKDF-SHA256, SHA-256, ChaCha20(-Poly1305),
ECDSA/RSA-PSS/Ed25519 come from ``cryptography``; randomness from ``os.urandom``; Shamir's sharing is
the textbook construction over GF(2^130 − 5) (:mod:`.shamir`)."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np
from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding, rsa, x25519
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from ..config.sections import colluders_tolerated, default_threshold, minimum_threshold  # noqa: F401
from .secagg_merkle import MAX_DEPTH, leaf, merkle_path, merkle_root_of, merkle_tree, share_hash, tree_depth  # noqa
from .secagg_ring import MAX_MEAN_ERROR, PROTOCOL, Quantizer, SecureAggregationError  # noqa: F401 (re-exported)
from .shamir import combine as _combine  # noqa: F401 (the relay's rebuild)
from .shamir import split as _split

RAW = serialization.Encoding.Raw, serialization.PublicFormat.Raw


def prg(seed: bytes, length: int, dtype=np.uint64, *, out: np.ndarray | None = None) -> np.ndarray:
    """``length`` words (``dtype``) of ChaCha20's keystream under the 32-byte ``seed``; written into
    ``out`` (a C-contiguous array of ``length`` words of ``dtype``) when given, without a new array."""
    size = np.dtype(dtype).itemsize
    encryptor = Cipher(algorithms.ChaCha20(seed, b"\0" * 16), mode=None).encryptor()
    if out is None:
        return np.frombuffer(encryptor.update(_zeros(size * length)), dtype=dtype).copy()
    if out.dtype != np.dtype(dtype) or out.size != length or not out.flags.c_contiguous:
        raise ValueError(f"prg's out must be {length} contiguous words of {np.dtype(dtype)}")
    encryptor.update_into(_zeros(size * length), out.data.cast("B"))  # the words themselves, as bytes
    return out


@lru_cache(maxsize=4)
def _zeros(size: int) -> bytes:
    """``size`` zero bytes (the keystream is ChaCha20 applied to them), made once per size."""
    return bytes(size)


def _kdf(secret: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(secret)


def expand(secret: bytes, what: bytes) -> bytes:
    """The 32-byte key a shared secret stands for: a 32-byte secret itself (the full graph), a 16-byte
    one (SecAgg+: half the Shamir work, 128 bits like X25519) through HKDF-SHA256 for ``what``."""
    return secret if len(secret) == 32 else _kdf(secret, b"fedcontrast secagg+ " + what)


def commitment(seed: bytes) -> bytes:
    """A site's commitment to its self-mask seed (SHA-256; the seed is 32 random bytes, so it hides it):
    the aggregator checks the seed it rebuilds from shares against it."""
    return hashlib.sha256(PROTOCOL.encode() + b"|self-mask seed|" + seed).digest()


def graph_commitment(session: bytes, round_num: int, site: str, randomness: bytes) -> bytes:
    """A site's commitment to its share of the round's graph randomness (SecAgg+): SHA-256 over the
    session, the round, its name and 32 random bytes, so it binds and hides them."""
    name = site.encode()
    return hashlib.sha256(b"".join((PROTOCOL.encode(), b"|graph randomness|", session,
                                    int(round_num).to_bytes(8, "big"), len(name).to_bytes(4, "big"), name,
                                    randomness))).digest()


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


# Digests of (public key, signature, data) that verified, most recent last: in the simulator every
# party runs in one process and a site's advert and consistency signature are checked by each of its
# neighbours, the same check up to k + 1 times. A hit means exactly these bytes verified before.
_VERIFIED: dict[bytes, None] = {}
_VERIFIED_MAX = 1 << 16
_VERIFIED_LOCK = threading.Lock()


def verify(key: Any, signature: bytes, data: bytes) -> bool:
    """Whether ``signature`` over ``data`` verifies under the long-term public ``key`` (EC: ECDSA with
    SHA-256, RSA: PSS with SHA-256, Ed25519)."""
    try:
        der = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    except (AttributeError, ValueError, TypeError):
        return False
    digest = hashlib.sha256(b"".join(len(part).to_bytes(8, "big") + part for part in (der, signature, data))).digest()
    if digest in _VERIFIED:
        return True
    if not _verify(key, signature, data):
        return False
    with _VERIFIED_LOCK:
        _VERIFIED[digest] = None
        while len(_VERIFIED) > _VERIFIED_MAX:
            del _VERIFIED[next(iter(_VERIFIED))]
    return True


def _verify(key: Any, signature: bytes, data: bytes) -> bool:
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


def deal_bytes(session: bytes, round_num: int, threshold: int, dealer: str, root: bytes,
               graph_terms: tuple[Any, ...] = (), graph_seed: bytes = b"") -> bytes:
    """What a dealer signs over the root of its shares' tree (:func:`bound`, kind ``deal``), with the
    SecAgg+ graph's parameters and seed (empty in the full graph)."""
    return bound("deal", session, round_num, threshold, dealer, root, *graph_terms, graph_seed)


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
    # shares others dealt me: dealer → (index, b share, s share, Merkle path to the dealer's signed root)
    held: dict[str, tuple[int, bytes, bytes, bytes]] = field(default_factory=dict, repr=False)
    refused: dict[str, str] = field(default_factory=dict, repr=False)  # dealer → why its shares failed their check
    deal: tuple[bytes, bytes] | None = field(default=None, repr=False)  # this site's signed root: (root, signature)
    signed: list[str] | None = None  # the survivor set this site signed (one per round)
    # SecAgg+ (:mod:`.secagg_graph`): the shares' threshold t_k among ``sites`` (this site's
    # neighbourhood) and the graph's parameters its advert signs; None and (): the full graph
    share_threshold: int | None = None
    graph_terms: tuple[Any, ...] = ()
    _secrets: tuple[bytes, bytes] | None = field(default=None, repr=False)  # SecAgg+: the 16-byte b and s it shares
    _signed_json: bytes = field(default=b"", repr=False)  # ``signed``, JSON-encoded (:meth:`_consistency_bytes`)
    # SecAgg+: this site's share of the round's graph randomness (committed in its advert, revealed once
    # every advert is in) and the graph's seed drawn from every site's, bound into its deal, its shares'
    # cipher and its consistency signature, so that sites told different graphs cannot go on together
    graph_randomness: bytes = field(default_factory=lambda: os.urandom(32), repr=False)
    graph_seed: bytes = b""
    _ciphers: dict[str, tuple[bytes, ChaCha20Poly1305]] = field(default_factory=dict, repr=False)  # peer → c_pk, cipher

    def short_secrets(self) -> None:
        """SecAgg+: share 16-byte secrets whose :func:`expand` are the self-mask seed and the ``s`` key."""
        self._secrets = (os.urandom(16), os.urandom(16))
        self._b = expand(self._secrets[0], b"self mask")
        self._s = x25519.X25519PrivateKey.from_private_bytes(expand(self._secrets[1], b"mask key"))

    @property
    def secrets(self) -> tuple[bytes, bytes]:
        """What this site shares and commits to: its self-mask seed and its ``s`` key (or their 16-byte seeds)."""
        return self._secrets or (self._b, self._s.private_bytes(serialization.Encoding.Raw,
                                                                serialization.PrivateFormat.Raw,
                                                                serialization.NoEncryption()))

    @property
    def t_shares(self) -> int:
        """The shares that rebuild one of this site's secrets (and the consistency signatures it needs)."""
        return self.threshold if self.share_threshold is None else self.share_threshold

    def _advert_bytes(self, site: str, advert: dict[str, bytes]) -> bytes:
        return bound("advert", self.session, self.round_num, self.threshold, site,
                     advert["c_pk"], advert["s_pk"], advert["commit"], advert["graph"], *self.graph_terms)

    def advertise(self) -> dict[str, bytes]:
        advert = {"c_pk": self._c.public_key().public_bytes(*RAW), "s_pk": self._s.public_key().public_bytes(*RAW),
                  "commit": commitment(self.secrets[0]),
                  "graph": graph_commitment(self.session, self.round_num, self.name, self.graph_randomness)}
        return {**advert, "signature": sign(self.signing_key, self._advert_bytes(self.name, advert))}

    def share(self, adverts: dict[str, dict[str, bytes]], signing_keys: dict[str, Any]) -> dict[str, bytes]:
        """Checks every advert against its site's long-term public key; the encrypted shares of
        ``b`` and of the ``s`` key, one ciphertext per peer (the aggregator routes them)."""
        for site in self.sites:
            advert = adverts.get(site)
            if advert is None:
                raise SecureAggregationError(f"site {site} sent no keys for round {self.round_num}")
            if site not in signing_keys or not verify(signing_keys[site], advert["signature"],
                                                      self._advert_bytes(site, advert)):
                raise SecureAggregationError(f"site {site}'s key-agreement keys for round {self.round_num} do not "
                                             "carry its signature over this session, round and threshold: refused "
                                             "(keys swapped, forged or replayed on the way)")
            self.peers[site] = advert
        n = len(self.sites)
        b_shares, s_shares = (_split(secret, self.t_shares, n) for secret in self.secrets)
        levels = merkle_tree([leaf(site, b_shares[k][0], share_hash("b", b_shares[k][1]),
                                   share_hash("s", s_shares[k][1])) for k, site in enumerate(self.sites)])
        root = levels[-1][0]
        self.deal = (root, sign(self.signing_key, self.deal_bytes(self.name, root)))
        out = {}
        for k, site in enumerate(self.sites):
            path = merkle_path(levels, k)
            if site == self.name:  # its own shares stay here
                self.held[site] = (b_shares[k][0], b_shares[k][1], s_shares[k][1], path)
                continue
            plain = b_shares[k][0].to_bytes(2, "big") + b_shares[k][1] + s_shares[k][1] + path
            out[site] = self._aead(site).encrypt(self._nonce(self.name, site), plain, self._aad(self.name, site))
        return out

    def deal_bytes(self, dealer: str, root: bytes) -> bytes:
        """What ``dealer`` signs over the root of its shares' tree in this site's round (:func:`deal_bytes`)."""
        return deal_bytes(self.session, self.round_num, self.threshold, dealer, root, self.graph_terms,
                          self.graph_seed)

    def receive(self, ciphertexts: dict[str, bytes], deals: dict[str, tuple[bytes, bytes]],
                signing_keys: dict[str, Any]) -> None:
        """Decrypts the shares every other site dealt this site (routed by the aggregator) and checks
        each against its dealer's signed root (``deals``: dealer → (root, signature)). Shares that
        fail are kept out (``refused``, with the reason): this site will say so instead of revealing
        them, so it can never be blamed for its dealer's fault."""
        size = len(self.held[self.name][1]) if self.name in self.held else None
        for sender, ciphertext in ciphertexts.items():
            try:
                plain = self._aead(sender).decrypt(self._nonce(sender, self.name), ciphertext,
                                                   self._aad(sender, self.name))
            except InvalidTag:
                raise SecureAggregationError(f"the shares from site {sender} do not decrypt at site {self.name}: "
                                             "altered on the way") from None
            problem = self._check_deal(sender, plain, size, deals.get(sender), signing_keys.get(sender))
            if problem:
                self.refused[sender] = problem
                continue
            path_bytes = len(plain) - 2 - 2 * size  # type: ignore[operator]  # checked in _check_deal
            index = int.from_bytes(plain[:2], "big")
            self.held[sender] = (index, plain[2:2 + size], plain[2 + size:2 + 2 * size],  # type: ignore[operator]
                                 plain[len(plain) - path_bytes:])

    def _check_deal(self, dealer: str, plain: bytes, size: int | None, deal: tuple[bytes, bytes] | None,
                    key: Any) -> str:
        """Why the shares ``dealer`` sent this site are not what it signed (empty: they are)."""
        if size is None or (len(plain) - 2 - 2 * size) % 32 or len(plain) < 2 + 2 * size:
            return f"the shares site {dealer} dealt site {self.name} have the wrong size"
        if deal is None or key is None or not verify(key, deal[1], self.deal_bytes(dealer, deal[0])):
            return f"site {dealer}'s shares for site {self.name} come without {dealer}'s signature over their tree"
        index = int.from_bytes(plain[:2], "big")
        b, s_share, path = plain[2:2 + size], plain[2 + size:2 + 2 * size], plain[2 + 2 * size:]
        if index < 1 or merkle_root_of(leaf(self.name, index, share_hash("b", b), share_hash("s", s_share)),
                                       index - 1, path) != deal[0]:
            return f"the shares site {dealer} dealt site {self.name} are not the ones {dealer} signed"
        return ""

    def mask(self, vector: np.ndarray, quantizer: Quantizer, peers: list[str] | None = None) -> np.ndarray:
        """The vector as the aggregator receives it: encoded, plus the self mask and pairwise masks
        with ``peers`` (default: every site; in a deployment, those whose shares arrived)."""
        y = np.ascontiguousarray(quantizer.encode(vector).ravel())
        mask = np.empty_like(y)  # each mask's keystream, written in place
        position = {site: i for i, site in enumerate(self.sites)}
        mine = position[self.name]
        with np.errstate(over="ignore"):
            np.add(y, prg(self._b, y.size, quantizer.unsigned, out=mask), out=y)
            for site in (self.sites if peers is None else peers):
                if site == self.name:
                    continue
                prg(self._pair_seed(self._s, self.peers[site]["s_pk"]), y.size, quantizer.unsigned, out=mask)
                (np.add if mine < position[site] else np.subtract)(y, mask, out=y)
        return y

    # --- the consistency round ---------------------------------------------------------------
    def _consistency_bytes(self, signer: str) -> bytes:
        """``bound("consistency", …, signer, self.signed)``, with the survivor set this site signed
        encoded once (:meth:`sign_survivors`) for the up to k + 1 signatures checked over it (equal to
        :func:`bound`, tested)."""
        head = bound("consistency", self.session, self.round_num, self.threshold, signer, self.graph_seed)
        return head[:-1] + b"," + self._signed_json + b"]"

    def sign_survivors(self, survivors: list[str]) -> bytes:
        """This site's signature over the survivor set it was told; it signs one set per round."""
        if self.signed is not None and sorted(self.signed) != sorted(survivors):
            raise SecureAggregationError(f"site {self.name} was asked to sign a second survivor set in round "
                                         f"{self.round_num}: refused")
        self.signed = sorted(survivors)
        self._signed_json = json.dumps(self.signed, separators=(",", ":")).encode()  # as bound() encodes it
        return sign(self.signing_key, self._consistency_bytes(self.name))

    def check_consistency(self, signatures: dict[str, bytes], signing_keys: dict[str, Any]) -> list[str]:
        """The members of the signed survivor set whose signatures over that same set verify; refused
        with fewer than the threshold (sites were told different sets, or signatures were forged)."""
        if self.signed is None:
            raise SecureAggregationError(f"site {self.name} has signed no survivor set in round {self.round_num}")
        valid = [s for s in self.signed if s in signatures and s in signing_keys
                 and verify(signing_keys[s], signatures[s], self._consistency_bytes(s))]
        if len(valid) < self.t_shares:
            bad = sorted(s for s in signatures if s not in valid)
            raise SecureAggregationError(
                f"only {len(valid)} of the sites told that {', '.join(self.signed)} survived round "
                f"{self.round_num} signed that same set, fewer than the threshold {self.t_shares}"
                + (f" (no valid signature from {', '.join(bad)})" if bad else "")
                + ": the aggregator may have told sites different survivor sets; nothing is revealed")
        return valid

    def reveal(self, survivors: list[str], dropped: list[str]) -> dict[str, tuple[Any, ...]]:
        """This site's shares for unmasking: of ``b`` for each survivor, of the ``s`` key for each
        dropped site, each as (kind, index, share, the other share's hash, the Merkle path to its
        dealer's signed root), or ``("withheld", why)`` for a dealer whose shares failed their check
        here; refused when a site is named both ways or too few survive."""
        if set(survivors) & set(dropped):
            raise SecureAggregationError(f"the aggregator asked site {self.name} to reveal both masks of "
                                         f"{', '.join(sorted(set(survivors) & set(dropped)))}: refused")
        if len(survivors) < self.threshold:
            raise SecureAggregationError(f"only {len(survivors)} sites survived round {self.round_num}, fewer than "
                                         f"the threshold {self.threshold}: nothing is revealed")
        out: dict[str, tuple[Any, ...]] = {}
        for kind, targets in (("b", survivors), ("s", dropped)):
            for site in targets:
                if site in self.refused:
                    out[site] = ("withheld", self.refused[site])
                    continue
                if site not in self.held and kind == "b" and self.share_threshold is not None:
                    continue  # SecAgg+: a survivor outside this site's neighbourhood holds no share here
                index, b_share, s_share, path = self.held[site]
                share, other = ((b_share, share_hash("s", s_share)) if kind == "b"
                                else (s_share, share_hash("b", b_share)))
                out[site] = (kind, index, share, other, path)
        return out

    # --- helpers --------------------------------------------------------------------------------
    def _aead(self, peer: str) -> ChaCha20Poly1305:
        """The cipher of the shares between this site and ``peer`` (one key agreement per peer and round)."""
        c_pk = self.peers[peer]["c_pk"]
        known = self._ciphers.get(peer)
        if known is None or known[0] != c_pk:
            shared = self._c.exchange(x25519.X25519PublicKey.from_public_bytes(c_pk))
            known = self._ciphers[peer] = (c_pk, ChaCha20Poly1305(_kdf(shared, b"fedcontrast secagg shares")))
        return known[1]

    def _nonce(self, sender: str, receiver: str) -> bytes:
        return _kdf((sender + "\0" + receiver + "\0" + str(self.round_num)).encode(), b"nonce")[:12]

    def _aad(self, sender: str, receiver: str) -> bytes:
        return f"{sender}->{receiver}@{self.round_num}|".encode() + self.session + self.graph_seed

    @staticmethod
    def _pair_seed(private: x25519.X25519PrivateKey, peer_public: bytes) -> bytes:
        return _kdf(private.exchange(x25519.X25519PublicKey.from_public_bytes(peer_public)), b"fedcontrast secagg mask")
