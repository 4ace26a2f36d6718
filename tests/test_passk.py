"""pass@k against brute force over k-subsets, and the eval config record."""

from __future__ import annotations

import itertools
import json
import math

import pytest

from miles_core.eval import EvalConfig, EvalResult, aggregate_pass_at_k, pass_at_k


def _brute(n: int, c: int, k: int) -> float:
    """Fraction of k-subsets of n samples (first c correct) containing at least one correct one."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 5, 6])
def test_pass_at_k_matches_brute_force(n: int) -> None:
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(_brute(n, c, k), abs=1e-12)
            assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)
        assert pass_at_k(n, c, 1) == pytest.approx(c / n)


def test_pass_at_k_large_n_is_stable() -> None:
    v = pass_at_k(1000, 3, 100)
    assert v == pytest.approx(1 - math.comb(997, 100) / math.comb(1000, 100), rel=1e-9)
    assert 0.0 <= pass_at_k(10_000, 1, 5000) <= 1.0


@pytest.mark.parametrize(
    "args,exc",
    [((0, 0, 1), ValueError), ((5, 6, 1), ValueError), ((5, -1, 1), ValueError), ((5, 2, 0), ValueError),
     ((5, 2, 6), ValueError), ((5.0, 2, 1), TypeError), ((5, True, 1), TypeError)],
)
def test_pass_at_k_validates(args: tuple, exc: type) -> None:
    with pytest.raises(exc):
        pass_at_k(*args)


def test_aggregate() -> None:
    correct = [[True, False, False, False], [False] * 4, [True] * 4]
    out = aggregate_pass_at_k(correct, ks=[1, 2, 4])
    assert set(out) == {"pass@1", "pass@2", "pass@4"}
    assert out["pass@1"] == pytest.approx((0.25 + 0 + 1) / 3)
    assert out["pass@2"] == pytest.approx((0.5 + 0 + 1) / 3)
    assert out["pass@4"] == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="fewer than k"):
        aggregate_pass_at_k([[True], [True, False]], ks=[2])
    with pytest.raises(ValueError):
        aggregate_pass_at_k([], ks=[1])


def test_eval_config_and_result_roundtrip() -> None:
    cfg = EvalConfig(num_problems=50, completion_len=32, steps=16, block_size=8, temperature=0.7,
                     sampler="nsd", threshold=0.9, n_samples=4, ks=[1, 4], seed=3, split="test")
    assert cfg.ks == (1, 4)
    hash(cfg)  # frozen and hashable: usable as a cache key
    d = cfg.to_dict()
    assert d["ks"] == [1, 4] and d["sampler"] == "nsd" and d["threshold"] == 0.9
    assert EvalConfig.from_dict(json.loads(json.dumps(d))) == cfg
    assert cfg.fingerprint() == EvalConfig.from_dict(d).fingerprint() != EvalConfig().fingerprint()
    res = EvalResult(pass_at={"pass@1": 0.5}, num_problems=50, config=cfg,
                     samples=[{"prompt": "1+2", "completion": "1+2=3", "answer": "3", "correct": True}],
                     metrics={"nfe_mean": 7.5}, runtime={"batch_size": 8, "dtype": "bfloat16", "device": "cuda:0"})
    rd = json.loads(json.dumps(res.to_dict()))
    assert rd["runtime"] == {"batch_size": 8, "dtype": "bfloat16", "device": "cuda:0"}
    assert rd["config"]["steps"] == 16 and rd["config_fingerprint"] == cfg.fingerprint()
    assert EvalResult.from_dict(rd) == res


@pytest.mark.parametrize(
    "kwargs",
    [{"sampler": "greedy"}, {"sampler": "nsd"}, {"threshold": 1.5}, {"ks": (2,)}, {"steps": 0},
     {"temperature": -1.0}],
)
def test_eval_config_validates(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        EvalConfig(**kwargs)


def test_paired_sign_test_against_hand_computed_binomials() -> None:
    from miles_core.eval.passk import paired_sign_test, sign_test_p

    # 9 wins, 1 loss: 2 * (C(10,0) + C(10,1)) / 2^10 = 22 / 1024
    assert sign_test_p(9, 1) == 22 / 1024
    assert sign_test_p(1, 9) == 22 / 1024 and sign_test_p(0, 0) == 1.0 and sign_test_p(2, 2) == 1.0
    assert sign_test_p(3, 0) == 0.25  # 2 * 1/8
    after = [True, True, False, True, False, True]
    before = [False, True, True, False, False, False]  # wins at 0, 3, 5; a loss at 2; ties elsewhere
    st = paired_sign_test(after, before)
    assert (st.wins, st.losses) == (3, 1) and st.p == 2 * (1 + 4) / 16
    import pytest

    with pytest.raises(ValueError, match="the problems must be the same"):
        paired_sign_test(after, before[:-1])
