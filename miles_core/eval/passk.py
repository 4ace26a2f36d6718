"""pass@k and the record of what produced an eval number.

Reported and re-measured scores of diffusion LMs often disagree because sampling settings differ
(steps, block size, temperature, remasking, thresholds). Every number Miles reports therefore
travels with an :class:`EvalConfig` that pins all of them.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Iterable, Sequence

SAMPLERS = ("static", "nsd")


def _check_int(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"pass_at_k: {name} must be an int, got {type(v).__name__} ({v!r})")
    return v


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` are correct: 1 - C(n-c, k) / C(n, k).

    Uses the product form 1 - prod_{i=n-c+1}^{n} (1 - k/i) (Chen et al. 2021), which avoids the
    huge binomials of the direct formula.
    """
    n, c, k = _check_int("n", n), _check_int("c", c), _check_int("k", k)
    if n < 1:
        raise ValueError(f"pass_at_k: need n >= 1 samples, got n={n}")
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n, got c={c}, n={n}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 1 <= k <= n, got k={k}, n={n} (draw at least k samples per problem)")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def aggregate_pass_at_k(correct: Sequence[Sequence[bool]], ks: Iterable[int]) -> dict[str, float]:
    """Mean pass@k over problems; ``correct[i]`` holds the per-sample outcomes of problem i."""
    ks = list(ks)
    if not ks:
        raise ValueError("aggregate_pass_at_k: ks is empty")
    if not correct:
        raise ValueError("aggregate_pass_at_k: no problems")
    out: dict[str, float] = {}
    for k in ks:
        total = 0.0
        for i, row in enumerate(correct):
            n = len(row)
            if k > n:
                raise ValueError(f"aggregate_pass_at_k: problem {i} has {n} samples, fewer than k={k}")
            total += pass_at_k(n, sum(bool(x) for x in row), k)
        out[f"pass@{k}"] = total / len(correct)
    return out


def sign_test_p(wins: int, losses: int) -> float:
    """Two-sided exact binomial sign test on discordant pairs (ties dropped): 2 P[X <= min] for X ~ Bin(n, 1/2)."""
    n = wins + losses
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(wins, losses) + 1)) / 2**n
    return min(1.0, 2 * tail)


def problems_digest(prompts: Sequence[str], answers: Sequence[str]) -> str:
    """Short stable hash of the problems, in order. Why beside the config fingerprint: that pins the
    sampling settings and how many problems, not which ones (a task's data seed or file is not in it),
    and a paired test of two evaluations is only meaningful on the very same problems."""
    return hashlib.sha256(json.dumps([list(map(str, pa)) for pa in zip(prompts, answers)]).encode()).hexdigest()[:12]


@dataclass(frozen=True)
class SignTest:
    """``after`` against ``before`` on the same problems: problems only ``after`` solves (wins), only
    ``before`` solves (losses), and the exact two-sided p-value of that split."""

    wins: int
    losses: int
    p: float


def paired_sign_test(after: Sequence[bool], before: Sequence[bool]) -> SignTest:
    """Why paired: both policies answer the same problems, so only the problems they disagree on
    carry information, and a pass@1 gain is noise unless those split unevenly (McNemar / sign test)."""
    if len(after) != len(before):
        raise ValueError(f"paired_sign_test: {len(after)} outcomes against {len(before)}; the problems must be the same")
    wins = sum(bool(a) and not bool(b) for a, b in zip(after, before))
    losses = sum(bool(b) and not bool(a) for a, b in zip(after, before))
    return SignTest(wins, losses, sign_test_p(wins, losses))


@dataclass(frozen=True)
class EvalConfig:
    """Everything that determines an eval number. Log ``to_dict()`` next to every pass@k."""

    num_problems: int = 200
    completion_len: int = 64
    steps: int = 64
    block_size: int = 64
    temperature: float = 0.0
    remasking: str = "low_confidence"
    sampler: str = "static"
    threshold: float | None = None
    n_samples: int = 1
    ks: tuple[int, ...] = (1,)
    seed: int = 0
    split: str = "test"
    task: str = "arith"
    prompt_template: str = "plain"  # task.prompt_template: plain, or the model's chat template
    prompt_prefill: str = ""        # chat: what follows the generation prompt (d1 math: "<reasoning>")
    preset: str = ""                # eval.preset these sampling values came from (eval/presets.py), if any

    def __post_init__(self) -> None:
        object.__setattr__(self, "ks", tuple(int(k) for k in self.ks))
        if self.sampler not in SAMPLERS:
            raise ValueError(f"EvalConfig: sampler must be one of {SAMPLERS}, got {self.sampler!r}")
        if self.sampler == "nsd" and self.threshold is None:
            raise ValueError("EvalConfig: sampler='nsd' needs a confidence threshold")
        if self.threshold is not None and not 0.0 < self.threshold <= 1.0:
            raise ValueError(f"EvalConfig: threshold must be in (0, 1], got {self.threshold}")
        for name in ("num_problems", "completion_len", "steps", "block_size", "n_samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"EvalConfig: {name} must be >= 1, got {getattr(self, name)}")
        if self.temperature < 0:
            raise ValueError(f"EvalConfig: temperature must be >= 0, got {self.temperature}")
        if not self.ks or min(self.ks) < 1 or max(self.ks) > self.n_samples:
            raise ValueError(f"EvalConfig: ks {self.ks} must be within 1..n_samples={self.n_samples}")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ks"] = list(self.ks)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "EvalConfig":
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"EvalConfig.from_dict: unknown keys {sorted(unknown)}")
        return cls(**d)

    def fingerprint(self) -> str:
        """Short stable hash of the config: equal fingerprints mean comparable numbers."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:12]


@dataclass
class EvalResult:
    """pass@k values with the config that produced them, a few samples and extra metrics (e.g. NFE)."""

    pass_at: dict[str, float]
    num_problems: int
    config: EvalConfig
    samples: list[dict[str, Any]] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    correct: list[list[bool]] = field(default_factory=list)  # per problem, per sample (paired tests)
    problems_digest: str = ""  # problems_digest(prompts, answers): which problems ``correct`` is about
    # per problem, per sample: the completion text, for scoring it another way (kept in memory only;
    # the stored record keeps ``samples``)
    completions: list[list[str]] = field(default_factory=list, repr=False)
    # how it ran, beside the number: batch size, dtype, device (not in the fingerprint: a row's
    # greedy output does not depend on its batch, tests/test_engine.py; dtype and device are named
    # here so two numbers from different hardware are never mistaken for one setting)
    runtime: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "pass_at": dict(self.pass_at),
            "num_problems": self.num_problems,
            "config": self.config.to_dict(),
            "config_fingerprint": self.config.fingerprint(),
            "samples": [dict(s) for s in self.samples],
            "metrics": {k: float(v) for k, v in self.metrics.items()},
            "correct": [[bool(x) for x in row] for row in self.correct],
            "problems_digest": self.problems_digest,
            "runtime": dict(self.runtime),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "EvalResult":
        return cls(
            pass_at=dict(d["pass_at"]),
            num_problems=int(d["num_problems"]),
            config=EvalConfig.from_dict(d["config"]),
            samples=list(d.get("samples", [])),
            metrics=dict(d.get("metrics", {})),
            correct=[list(row) for row in d.get("correct", [])],
            problems_digest=str(d.get("problems_digest", "")),
            runtime=dict(d.get("runtime", {})),
        )
