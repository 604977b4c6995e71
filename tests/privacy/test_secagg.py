"""Secure aggregation (fedcontrast.privacy.secagg) against plain sums: every site's mask cancels or is
removed, dropouts after masking still give the survivors' sum, and what the aggregator holds tells
it nothing of one site's vector."""

from __future__ import annotations

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from scipy import stats

from fedcontrast.privacy.secagg import Quantizer, SecAggSite, SecureAggregationError, _combine, prg
from fedcontrast.privacy.secagg_relay import unmask


def keys(names):
    makers = [lambda: ec.generate_private_key(ec.SECP384R1()), ed25519.Ed25519PrivateKey.generate,
              lambda: rsa.generate_private_key(public_exponent=65537, key_size=2048)]
    return {name: makers[i % len(makers)]() for i, name in enumerate(names)}


def federation(n, t, round_num=0):
    names = [f"site_{i}" for i in range(n)]
    private = keys(names)
    sites = {name: SecAggSite(name, names, t, round_num, private[name]) for name in names}
    adverts = {name: site.advertise() for name, site in sites.items()}
    public = {name: key.public_key() for name, key in private.items()}
    outboxes = {name: site.share(adverts, public) for name, site in sites.items()}
    deals = {name: site.deal for name, site in sites.items()}  # each dealer's signed root
    for name, site in sites.items():  # the aggregator routes each ciphertext to its receiver
        site.receive({sender: box[name] for sender, box in outboxes.items() if sender != name},
                     {s: d for s, d in deals.items() if s != name}, public)
    return names, sites, adverts


def run(vectors, t, *, drop=(), clip=4.0, bits=64):
    names, sites, adverts = federation(len(vectors), t)
    q = Quantizer.for_sites(clip, len(names), bits)
    masked = {name: sites[name].mask(vectors[i], q) for i, name in enumerate(names) if name not in drop}
    survivors = [n for n in names if n in masked]
    reveals = {s: sites[s].reveal(survivors, [n for n in names if n not in masked]) for s in survivors}
    return unmask(masked, reveals, adverts, names, t, q, roots=roots(sites)), q, masked


def roots(sites):
    return {name: site.deal[0] for name, site in sites.items()}


@pytest.mark.parametrize("bits,finest", [(32, 1e-7), (64, 1e-9)])
def test_the_sum_equals_the_plain_sum_within_the_quantisation_bound(bits, finest):
    rng = np.random.default_rng(0)
    vectors = [rng.normal(size=1000) * 2 for _ in range(3)]
    total, q, masked = run(vectors, t=2, bits=bits)
    expected = np.sum([np.clip(v, -4.0, 4.0) for v in vectors], axis=0)  # an explicit reference
    assert np.max(np.abs(total - expected)) <= q.error_bound(3) < finest
    assert masked["site_0"].itemsize * 8 == bits  # a 32-bit ring sends what float32 would


@pytest.mark.parametrize("n,t,drop", [(3, 2, ("site_1",)), (10, 6, ("site_3", "site_8"))])
def test_sites_that_drop_out_after_masking_leave_the_survivors_sum(n, t, drop):
    rng = np.random.default_rng(n)
    vectors = [rng.uniform(-1, 1, size=257) for _ in range(n)]
    total, q, _ = run(vectors, t=t, drop=drop)
    expected = sum(v for i, v in enumerate(vectors) if f"site_{i}" not in drop)
    assert np.max(np.abs(total - expected)) <= q.error_bound(n)


def test_the_aggregator_learns_nothing_from_one_masked_vector():
    """Masked vectors of an all-zero input and of a large constant input both look uniform on the
    ring (Kolmogorov–Smirnov against U[0, 1) of value / 2^64)."""
    n = 3
    _, _, masked_zero = run([np.zeros(4096)] * n, t=2)
    _, _, masked_big = run([np.full(4096, 3.5)] * n, t=2)
    for masked in (masked_zero, masked_big):
        u = masked["site_0"].astype(np.float64) / 2.0**64
        assert stats.kstest(u, "uniform").pvalue > 1e-3
    # and the unmasked encodings would differ completely: the masks are what hides them
    q = Quantizer.for_sites(4.0, n)
    assert stats.kstest(q.encode(np.zeros(4096)).astype(np.float64) / 2.0**64, "uniform").pvalue < 1e-3


def test_fewer_than_t_shares_reveal_nothing():
    names, sites, adverts = federation(5, 3)
    q = Quantizer.for_sites(1.0, 5)
    masked = {n: sites[n].mask(np.ones(64), q) for n in names}
    reveals = {s: sites[s].reveal(names, []) for s in names[:2]}  # t - 1 = 2 sites answer
    with pytest.raises(SecureAggregationError, match="fewer than the threshold 3"):
        unmask(masked, reveals, adverts, names, 3, q, roots=roots(sites))
    # combining t - 1 shares by hand gives a wrong seed (or a value outside the secrets' range, refused):
    # the mask does not come off
    shares = [(idx, share) for r in reveals.values() for target, (_, idx, share, *_) in r.items()
              if target == "site_0"]
    right = _combine([(idx, share) for s in names[:3]
                      for target, (_, idx, share, *_) in sites[s].reveal(names, []).items() if target == "site_0"])
    try:
        wrong = _combine(shares)
    except ValueError:
        return
    assert wrong != right and np.any(prg(wrong, 8) != prg(right, 8))


def test_a_key_the_aggregator_swapped_is_refused_and_named():
    names = ["a", "b", "c"]
    private = keys(names)
    sites = {n: SecAggSite(n, names, 2, 0, private[n]) for n in names}
    adverts = {n: s.advertise() for n, s in sites.items()}
    forged = SecAggSite("b", names, 2, 0, ec.generate_private_key(ec.SECP384R1())).advertise()
    adverts["b"] = {**adverts["b"], "s_pk": forged["s_pk"]}  # the aggregator's own key in b's place
    public = {n: k.public_key() for n, k in private.items()}
    with pytest.raises(SecureAggregationError, match="site b's key-agreement keys for round 0 do not carry its "
                                                     "signature"):
        sites["a"].share(adverts, public)


def test_a_site_never_reveals_both_masks_of_one_site():
    names, sites, _ = federation(3, 2)
    with pytest.raises(SecureAggregationError, match="reveal both masks of site_1"):
        sites["site_0"].reveal(["site_0", "site_1"], ["site_1"])
    with pytest.raises(SecureAggregationError, match="fewer than the threshold"):
        sites["site_0"].reveal(["site_0"], ["site_1", "site_2"])


# --- in the simulator --------------------------------------------------------------------------------
def test_a_simulated_federation_with_secure_aggregation_equals_the_plain_one(tmp_path):
    """FedAvg, 3 sites, 2 rounds: the final global model within the quantisation error of the plain
    run's; the round's secure-aggregation cost is recorded (bytes per site vs a plain upload)."""
    import csv
    import json

    import torch

    from fedcontrast.cli import main

    common = ["simulate", "--algorithm", "fedavg", "--clients", "3", "--rounds", "2", "--local-epochs", "1",
              "--seed", "1", "--device", "cpu"]
    runs = ["--runs-dir", str(tmp_path)]
    assert main([*common, *runs, "--name", "plain"]) == 0
    assert main([*common, *runs, "--name", "secure", "--secure-aggregation", "--secagg", "bits=64"]) == 0
    plain = torch.load(tmp_path / "plain" / "checkpoint.pt", weights_only=False)["federation"]["downlink"]["global"]
    secure = torch.load(tmp_path / "secure" / "checkpoint.pt", weights_only=False)["federation"]["downlink"]["global"]
    assert set(plain) == set(secure)
    for name in plain:  # 64-bit ring: far below float32's own rounding of these weights
        assert torch.allclose(plain[name].double(), secure[name].double(), atol=1e-6), name
    with open(tmp_path / "secure" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r["task"] == "secure_aggregation"]
    assert [int(r["round"]) for r in rows] == [1, 2]
    cost = json.loads(rows[0]["extra"])
    assert cost["threshold"] == 3 and 1.0 < cost["bytes_per_site"] / cost["plain_bytes_per_site"] < 2.1


def test_plans_that_need_individual_uploads_are_refused_in_one_sentence():
    from fedcontrast.config import RunConfig, SecureAggregationConfig
    from fedcontrast.construction import build_algorithm
    from fedcontrast.errors import ConfigError

    with pytest.raises(ConfigError, match="fedsiam_da combines individual uploads"):
        build_algorithm(RunConfig(algorithm="fedsiam_da", secure_aggregation=SecureAggregationConfig()))
    with pytest.raises(ConfigError, match="cannot apply robustness rule 'median'"):
        RunConfig(algorithm="fedavg", robustness={"rule": "median"}, secure_aggregation={})
    with pytest.raises(ConfigError, match="threshold 11 exceeds the 10 sites"):
        RunConfig(algorithm="fedavg", secure_aggregation={"threshold": 11})
    assert "secure_aggregation" not in RunConfig().to_dict()  # off: plans and config.yaml as before


def test_the_audit_says_who_sees_what_and_a_site_policy_can_require_secure_aggregation():
    from fedcontrast.audit.format import format_report
    from fedcontrast.audit.report import audit_plan
    from fedcontrast.config import RunConfig
    from fedcontrast.privacy.policy import SitePolicy, check_policy

    def audited(config):
        plan = {"task_runner": {"settings": {"run_config": config.to_dict()}}, "network": {"settings": {}},
                "aggregator": {"settings": {"rounds_to_train": config.rounds}}}
        return audit_plan(plan, source="plan", sites=[], site_samples={})

    plain = audited(RunConfig(algorithm="fedavg", clients=3))
    secure = audited(RunConfig(algorithm="fedavg", clients=3, secure_aggregation={}))
    assert plain.secure_sum_sites is None and secure.secure_sum_sites == 3  # ⌊2·3/3⌋ + 1
    assert "aggregator sees each site's uploads above one by one" in format_report(plain)
    assert "only inside sums of at least 3 sites" in format_report(secure)
    pins = {f"site_{i}": "SHA256:" + f"{i}" * 64 for i in range(3)}
    require = SitePolicy(require_secure_aggregation=True, peers=pins)
    assert any("no secure aggregation" in v for v in check_policy(plain, require))
    assert not any("secure aggregation" in v for v in check_policy(secure, require))
    unpinned = SitePolicy(require_secure_aggregation=True, peers={"site_0": pins["site_0"]})
    assert any("requires secure aggregation but pins no key for site_1, site_2" in v
               for v in check_policy(secure, unpinned))
    stricter = SitePolicy(require_secure_aggregation=True, min_secure_sites=4, peers=pins)
    assert any("sums of 3 sites, fewer than the policy's min_secure_sites 4" in v
               for v in check_policy(secure, stricter))


def _solve_mod(rows: list[list[int]], rhs: list[int], p: int) -> list[int]:
    """The solution of ``rows · a = rhs`` mod the prime ``p`` by Gauss–Jordan elimination: an
    independent reference for Lagrange's formula."""
    m = [row[:] + [b] for row, b in zip(rows, rhs)]
    size = len(m)
    for col in range(size):
        pivot = next(r for r in range(col, size) if m[r][col] % p)
        m[col], m[pivot] = m[pivot], m[col]
        inverse = pow(m[col][col], -1, p)
        m[col] = [v * inverse % p for v in m[col]]
        for r in range(size):
            if r != col and m[r][col]:
                factor = m[r][col]
                m[r] = [(a - factor * b) % p for a, b in zip(m[r], m[col])]
    return [row[-1] for row in m]


@pytest.mark.parametrize("n,t", [(3, 2), (10, 7), (41, 28), (50, 34)])
def test_shamir_shares_lie_on_one_polynomial_of_degree_below_t_whose_value_at_zero_is_the_secret(n, t):
    """Each 16-byte piece's shares are values of one polynomial of degree < t over GF(2^130 − 5):
    solving the Vandermonde system of t shares (Gauss–Jordan, not Lagrange) gives coefficients whose
    constant term is the piece and on which every other share lies; any t shares rebuild the secret
    (Lagrange, cached weights); a wrong share changes or refuses the result."""
    import os

    from fedcontrast.privacy.shamir import FIELD, PIECE, SHARE_PIECE
    from fedcontrast.privacy.shamir import split as _split

    rng = np.random.default_rng(n)
    secret = os.urandom(32)
    shares = _split(secret, t, n)
    assert [i for i, _ in shares] == list(range(1, n + 1))
    assert all(len(share) == 2 * SHARE_PIECE for _, share in shares)
    for piece in range(2):
        ys = [int.from_bytes(share[piece * SHARE_PIECE:(piece + 1) * SHARE_PIECE], "big") for _, share in shares]
        chosen = sorted(rng.choice(n, size=t, replace=False))
        coefficients = _solve_mod([[pow(int(i) + 1, d, FIELD) for d in range(t)] for i in chosen],
                                  [ys[i] for i in chosen], FIELD)
        assert coefficients[0] == int.from_bytes(secret[piece * PIECE:(piece + 1) * PIECE], "big")
        for x, y in enumerate(ys, 1):  # every share, chosen or not, on that polynomial
            assert sum(c * pow(x, d, FIELD) for d, c in enumerate(coefficients)) % FIELD == y
    for _ in range(3):
        subset = [shares[i] for i in sorted(rng.choice(n, size=t, replace=False))]
        assert _combine(subset) == secret
    wrong = [(i, bytes(2 * SHARE_PIECE)) if k == 0 else (i, s) for k, (i, s) in enumerate(shares[:t])]
    try:
        assert _combine(wrong) != secret  # one bad share changes the result
    except ValueError:
        pass  # or rebuilds no 16-byte value at all
    with pytest.raises(ValueError):
        _combine([(1, b"\xff" * 2 * SHARE_PIECE)] + shares[1:t])  # a value outside the field
    with pytest.raises(ValueError):
        _combine([shares[0], shares[0]])  # one index twice


@pytest.mark.parametrize("n,t,bad", [(10, 7, 1), (41, 28, 6), (13, 5, 4)])
def test_reed_solomon_decoding_finds_the_polynomial_through_every_good_share(n, t, bad):
    """Berlekamp–Welch (``shamir.decode``) against the polynomial solved independently from good
    shares (Gauss–Jordan on a Vandermonde system): with up to ⌊(n − t)/2⌋ shares replaced by random
    field values it returns that polynomial and exactly the good shares' indices; ``on_polynomial``
    agrees share by share; with one bad share more than it can correct it claims no polynomial."""
    import os

    from fedcontrast.privacy.shamir import FIELD, SHARE_PIECE, decode, on_polynomial
    from fedcontrast.privacy.shamir import split as _split

    rng = np.random.default_rng(n)
    shares = _split(os.urandom(16), t, n)
    ys = [int.from_bytes(share, "big") for _, share in shares]
    coefficients = _solve_mod([[pow(x, d, FIELD) for d in range(t)] for x in range(1, t + 1)], ys[:t], FIELD)
    corrupt = set(int(i) for i in rng.choice(n, size=bad, replace=False))
    points = [(x, int(rng.integers(1, 2**62)) if x - 1 in corrupt else y) for x, y in enumerate(ys, 1)]
    found = decode(points, t)
    assert found is not None
    assert found[0] == coefficients and found[1] == {x for x in range(1, n + 1) if x - 1 not in corrupt}
    basis = [shares[i] for i in range(n) if i not in corrupt][:t]
    others = [i for i, share in enumerate(shares) if share not in basis]
    given = [shares[i] if i not in corrupt else (shares[i][0], points[i][1].to_bytes(SHARE_PIECE, "big"))
             for i in others]
    assert on_polynomial(basis, given) == [i not in corrupt for i in others]
    more = sorted(set(range(n)) - corrupt)[: (n - t) // 2 + 1 - bad]  # one bad share beyond what it corrects
    points = [(x, (y + 1) % FIELD if x - 1 in corrupt or x - 1 in more else y) for x, y in enumerate(ys, 1)]
    assert decode(points, t) is None


def test_shamir_sharing_is_fresh_each_time_and_fewer_than_t_shares_fit_any_secret():
    """Two sharings of one secret differ (fresh random coefficients); and t − 1 shares say nothing:
    with them, every candidate secret has exactly one polynomial of degree < t through the shares
    and that candidate at 0 (checked for a few candidates by solving the system)."""
    import os

    from fedcontrast.privacy.shamir import FIELD, SHARE_PIECE
    from fedcontrast.privacy.shamir import split as _split

    secret = os.urandom(16)
    first, second = _split(secret, 3, 5), _split(secret, 3, 5)
    assert all(a != b for (_, a), (_, b) in zip(first, second))
    known = first[:2]  # t − 1 = 2 shares
    for candidate in (0, 1, int.from_bytes(os.urandom(16), "big")):
        rows = [[1, 0, 0]] + [[1, i, i * i] for i, _ in known]
        rhs = [candidate] + [int.from_bytes(share[:SHARE_PIECE], "big") for _, share in known]
        a = _solve_mod(rows, rhs, FIELD)
        assert a[0] == candidate
        assert all((a[0] + a[1] * i + a[2] * i * i) % FIELD == int.from_bytes(share, "big") for i, share in known)
    with pytest.raises(ValueError):
        _split(secret, 6, 5)  # threshold above the shares


def test_a_remembered_verification_answers_only_for_the_exact_key_signature_and_data():
    """verify remembers checks that passed (the simulator's parties check each advert up to k + 1
    times): a hit needs the same key, signature and data; a changed byte anywhere is checked afresh
    and refused, before and after the good one was remembered."""
    from fedcontrast.privacy.secagg import sign, verify

    key, other = ed25519.Ed25519PrivateKey.generate(), ed25519.Ed25519PrivateKey.generate()
    data = b"advert bytes"
    signature = sign(key, data)
    forged = bytes([signature[0] ^ 1]) + signature[1:]
    assert not verify(key.public_key(), forged, data)
    assert verify(key.public_key(), signature, data) and verify(key.public_key(), signature, data)
    assert not verify(key.public_key(), signature, data + b"!")
    assert not verify(other.public_key(), signature, data)
    assert not verify(key.public_key(), forged, data)
    assert not verify(object(), signature, data)  # not a public key at all


def test_the_consistency_bytes_a_site_signs_are_bound_over_the_sorted_survivor_set():
    """A site encodes the survivor set it signed once for all the signatures it checks: the bytes
    equal :func:`bound` of the sorted set for every signer (names with quotes and non-ASCII included)."""
    from fedcontrast.privacy.secagg import bound

    names = ["site_b", 'quo"te', "ünï", "site_a"]
    for survivors in (names, names[:3], list(reversed(names))):
        site = SecAggSite(names[0], names, 3, 7, ed25519.Ed25519PrivateKey.generate(), session=b"plan")
        site.sign_survivors(survivors)
        for signer in names:
            assert site._consistency_bytes(signer) == bound("consistency", b"plan", 7, 3, signer, site.graph_seed,
                                                            sorted(survivors))


@pytest.mark.parametrize("dtype", [np.uint32, np.uint64])
def test_the_prg_written_in_place_is_the_same_keystream(dtype):
    """Masking writes each keystream into one reused array: the same words as a fresh one, for both
    rings; an array of the wrong size or type is refused, not half-written."""
    seed = bytes(range(32))
    out = np.full(1001, 7, dtype=dtype)
    assert prg(seed, 1001, dtype, out=out) is out and np.array_equal(out, prg(seed, 1001, dtype))
    assert not np.array_equal(prg(seed, 1001, dtype), prg(bytes(32), 1001, dtype))
    with pytest.raises(ValueError):
        prg(seed, 1000, dtype, out=out)
