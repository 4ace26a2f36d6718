"""The champion rule (tracking/registry.py::promote_if_better) on a real MLflow SQLite store: the
alias moves only on the same evaluation (fingerprint and problems) and a paired sign test won at
p < alpha, and every decision is recorded on the candidate as a tag a registry user can read."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from mlflow import MlflowClient

import tracking
from miles_core.eval.passk import EvalConfig, EvalResult, problems_digest
from tracking import registry

pytestmark = pytest.mark.e2e  # a real MLflow store, like every registry test

NAME = "miles-test-champion"


@pytest.fixture
def store(tmp_project: Path) -> Path:
    tracking.configure(f"sqlite:///{tmp_project / 'mlruns' / 'mlflow.db'}")
    return tmp_project


def _eval_file(path: Path, correct: list[bool], num_problems: int | None = None, seed: int = 0,
               prompts: list[str] | None = None) -> tuple[str, float, str]:
    """An eval record as eval_summary writes it; its path, pass@1 and fingerprint."""
    n = len(correct)
    ec = EvalConfig(num_problems=num_problems or n, seed=seed)
    prompts = prompts or [f"{i}+1" for i in range(n)]
    res = EvalResult(pass_at={"pass@1": sum(correct) / n}, num_problems=n, config=ec,
                     correct=[[c] for c in correct], problems_digest=problems_digest(prompts, [str(i + 1) for i in range(n)]))
    d = res.to_dict()
    path.write_text(json.dumps(d))
    return str(path), d["pass_at"]["pass@1"], d["config_fingerprint"]


def _register(run_id: str, tmp: Path, correct: list[bool] | None, alpha: float = 0.05, **kw: Any) -> dict[str, Any]:
    """A version as register_model registers one (tags, outcomes artifact), without building a pyfunc:
    the rule only reads tags and the outcomes record. ``correct=None``: a version with no record."""
    client = MlflowClient()
    registry._ensure_registered_model(client, NAME)
    n = len(client.search_model_versions(f"name='{NAME}'"))
    path, p1, fp = _eval_file(tmp / f"eval{n}.json", correct or [True, False], **kw)
    tags = {registry.PASS1_TAG: repr(p1), registry.FINGERPRINT_TAG: fp}
    if correct is not None:
        tags[registry.OUTCOMES_TAG] = registry.log_outcomes(run_id, f"v{n + 1}",
                                                            registry.outcomes_record(path, fp, p1))
    mv = client.create_model_version(NAME, f"runs:/{run_id}/model", run_id=run_id, tags=tags)
    return registry.promote_if_better(NAME, mv.version, alpha)


def _pair(gained: int, lost: int, both: int = 20, neither: int = 20) -> tuple[list[bool], list[bool]]:
    """Champion and candidate outcomes on the same problems: ``gained`` only the candidate solves."""
    champ = [False] * gained + [True] * lost + [True] * both + [False] * neither
    cand = [True] * gained + [False] * lost + [True] * both + [False] * neither
    return champ, cand


def _comparison(version: int) -> dict[str, Any]:
    return json.loads(MlflowClient().get_model_version(NAME, str(version)).tags[registry.COMPARISON_TAG])


def test_a_higher_pass1_on_another_evaluation_does_not_move_the_champion(store: Path) -> None:
    """The issue's case: v2's pass@1 on 500 problems is higher than v1's on 1000, and v2 used to win."""
    with tracking.run("champion", "fingerprints") as run_id:
        first = _register(run_id, store, [True] * 53 + [False] * 947)
        res = _register(run_id, store, [True] * 29 + [False] * 471)
    assert first["promoted"] is True and first["reason"] == "no champion yet"
    assert _comparison(1)["decision"] == "promoted" and _comparison(1)["champion_version"] is None
    assert res["candidate_pass1"] > res["previous_pass1"]
    assert res["promoted"] is False and res["champion_version"] == 1 and res["comparable"] is False
    fp1, fp2 = (MlflowClient().get_model_version(NAME, v).tags[registry.FINGERPRINT_TAG] for v in ("1", "2"))
    assert res["reason"].startswith("not comparable") and fp1 in res["reason"] and fp2 in res["reason"]
    assert "re-evaluate the champion" in res["reason"]
    comp = _comparison(2)
    assert comp == res["comparison"]
    assert comp["fingerprints_equal"] is False and comp["decision"] == "refused" and comp["champion_version"] == 1


def test_same_fingerprint_other_problems_are_not_comparable(store: Path) -> None:
    champ, cand = _pair(30, 2)
    with tracking.run("champion", "problems") as run_id:
        _register(run_id, store, champ)
        res = _register(run_id, store, cand, prompts=[f"{i}*2" for i in range(len(cand))])
    assert res["comparable"] is True  # the fingerprint does not pin which problems
    assert res["promoted"] is False and "different problems" in res["reason"]


def test_a_small_win_on_the_same_problems_is_not_significant(store: Path) -> None:
    champ, cand = _pair(3, 1)
    with tracking.run("champion", "noise") as run_id:
        _register(run_id, store, champ)
        res = _register(run_id, store, cand)
    assert res["candidate_pass1"] > res["previous_pass1"] and res["comparable"] is True
    assert res["promoted"] is False and res["champion_version"] == 1
    assert res["reason"].startswith("not significant: +3/-1 discordant") and "p=0.625 >= 0.05" in res["reason"]
    comp = _comparison(2)
    assert (comp["wins"], comp["losses"], comp["alpha"], comp["decision"]) == (3, 1, 0.05, "refused")
    assert comp["p"] == pytest.approx(0.625) and comp["fingerprints_equal"] is comp["problems_equal"] is True


def test_a_significant_paired_win_moves_the_champion_and_is_recorded(store: Path) -> None:
    champ, cand = _pair(30, 2)
    with tracking.run("champion", "win") as run_id:
        _register(run_id, store, champ)
        res = _register(run_id, store, cand)
        worse = _register(run_id, store, champ)  # the old champion's outcomes again: now it loses
    assert res["promoted"] is True and res["champion_version"] == 2 and res["reason"].startswith("significant")
    comp = _comparison(2)
    assert (comp["wins"], comp["losses"], comp["decision"], comp["champion_version"]) == (30, 2, "promoted", 1)
    assert comp["p"] < 1e-6 and comp["reason"] == res["reason"]
    assert int(MlflowClient().get_model_version_by_alias(NAME, "champion").version) == 2
    assert worse["promoted"] is False and worse["reason"].startswith("not better than champion v2: +2/-30")


def test_alpha_is_the_callers(store: Path) -> None:
    champ, cand = _pair(8, 1)  # p = 0.039
    with tracking.run("champion", "alpha") as run_id:
        _register(run_id, store, champ)
        strict = _register(run_id, store, cand, alpha=0.01)
        loose = _register(run_id, store, cand, alpha=0.05)
    assert strict["promoted"] is False and ">= 0.01" in strict["reason"]
    assert loose["promoted"] is True and loose["comparison"]["alpha"] == 0.05
    with pytest.raises(ValueError, match="alpha"):
        registry.promote_if_better(NAME, 3, alpha=0.0)


def test_missing_records(store: Path) -> None:
    """A champion registered without outcomes (before this rule) is replaced, saying so; a candidate
    without them cannot be tested and stays out."""
    champ, cand = _pair(30, 2)
    with tracking.run("champion", "records") as run_id:
        _register(run_id, store, None)
        res = _register(run_id, store, champ)
        bare = _register(run_id, store, None)
    assert res["promoted"] is True and "champion v1 has no per-problem outcomes" in res["reason"]
    assert bare["promoted"] is False and "candidate v3 has no per-problem outcomes" in bare["reason"]
    assert registry.promote_if_better(NAME, 2)["reason"] == "already champion"
    assert _comparison(2)["decision"] == "promoted"  # re-asking keeps how it became champion


def test_an_eval_record_of_another_evaluation_is_refused(tmp_path: Path) -> None:
    path, p1, fp = _eval_file(tmp_path / "e.json", [True, False, True])
    rec = registry.outcomes_record(path, fp, p1)
    assert rec["correct"] == ["1", "0", "1"] and rec["num_problems"] == 3 and rec["problems_digest"]
    with pytest.raises(ValueError, match="fingerprint"):
        registry.outcomes_record(path, "0" * 12, p1)
    with pytest.raises(ValueError, match="pass@1"):
        registry.outcomes_record(path, fp, 0.9)
