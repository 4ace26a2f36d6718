"""The model registry: a trained policy as an MLflow LoggedModel (pyfunc, signature, requirements),
its registered versions with their per-problem outcomes, and the ``champion`` alias that moves only
on a significant paired win on the same evaluation (:func:`promote_if_better`).

Split from tracking/__init__.py (runs, metrics, artifacts) so each stays one idea. Like it, every call
takes explicit ids through ``MlflowClient``, never the fluent active run.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
import warnings
from importlib.metadata import PackageNotFoundError, version as pkg_version
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import mlflow
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from miles_core.eval.passk import paired_sign_test

CHAMPION = "champion"
PASS1_TAG = "miles.pass1"
FINGERPRINT_TAG = "miles.eval_fingerprint"
OUTCOMES_TAG = "miles.outcomes_uri"  # runs:/ URI of the version's per-problem outcomes (JSON artifact)
COMPARISON_TAG = "miles.champion_comparison"  # JSON: the test against the champion and its decision
DEFAULT_ALPHA = 0.05
MODEL_ARTIFACT = "model"
MODEL_VERSIONS_TAG = "mlflow.modelVersions"
_REQUIREMENTS = ("torch", "peft", "transformers", "safetensors", "numpy", "pyyaml", "mlflow")


def _stage_core(dest: Path) -> str:
    """Copy ``miles_core`` (no caches) so the logged model needs no checkout of Miles."""
    import miles_core

    core = dest / "miles_core"
    shutil.copytree(Path(miles_core.__file__).parent, core, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return str(core)


# Serving machines install the model's requirements.txt: with PyTorch's CPU index beside PyPI, the
# exact torch pin resolves to its +cpu build (a local version sorts above the bare one), so a clean
# CPU machine does not pull the multi-GB CUDA wheel. A GPU server overrides it with its own index.
TORCH_CPU_INDEX = "--extra-index-url https://download.pytorch.org/whl/cpu"


def _requirements() -> list[str]:
    out = [TORCH_CPU_INDEX]
    for name in _REQUIREMENTS:
        try:
            out.append(f"{name}=={pkg_version(name).split('+')[0]}")
        except PackageNotFoundError:
            continue
    return out


def _ensure_registered_model(client: MlflowClient, name: str) -> None:
    try:
        client.get_registered_model(name)
    except MlflowException:
        try:
            client.create_registered_model(name, description="Miles LoRA policies (pyfunc: text prompt -> answer)")
        except MlflowException:  # created concurrently
            client.get_registered_model(name)


def _tag_float(mv: Any, key: str) -> float | None:
    raw = (mv.tags or {}).get(key)
    try:
        value = float(raw) if raw is not None else None
    except ValueError:
        return None
    return value if value is not None and math.isfinite(value) else None


def champion(name: str) -> Any | None:
    """The model version holding alias ``champion``, or None."""
    try:
        return MlflowClient().get_model_version_by_alias(name, CHAMPION)
    except MlflowException:
        return None


def outcomes_record(eval_record: str | os.PathLike[str], fingerprint: str, pass1: float) -> dict[str, Any]:
    """What the registry keeps of an evaluation (``eval_summary``'s JSON, a flow's ``ev["path"]``): its
    fingerprint, which problems, and each problem's per-sample outcomes as a bit string ("0110").

    Why refuse a mismatch: a record of another evaluation would make the paired test compare the
    wrong numbers, and nothing downstream could tell.
    """
    d = json.loads(Path(eval_record).read_text())
    rows = d.get("correct") or []
    if not rows or not all(rows):
        raise ValueError(f"{eval_record}: no per-problem outcomes ('correct') to register")
    if fingerprint and d.get("config_fingerprint") != fingerprint:
        raise ValueError(f"{eval_record}: eval fingerprint {d.get('config_fingerprint')!r} is not the registered "
                         f"version's {fingerprint!r}")
    recorded = float((d.get("pass_at") or {}).get("pass@1", float("nan")))
    if not math.isclose(recorded, float(pass1), abs_tol=1e-9):
        raise ValueError(f"{eval_record}: pass@1 {recorded} is not the registered version's {pass1}")
    return {"format": 1, "fingerprint": d.get("config_fingerprint", ""),
            "problems_digest": d.get("problems_digest", ""), "num_problems": len(rows), "pass1": recorded,
            "correct": ["".join("1" if x else "0" for x in row) for row in rows]}


def log_outcomes(run_id: str, key: str, outcomes: Mapping[str, Any]) -> str:
    """Log ``outcomes`` (:func:`outcomes_record`) as ``registry/<key>/outcomes.json`` of ``run_id``; its
    ``runs:/`` URI. Why an artifact and not a tag: tag values stop near 5000 characters, and an eval
    of thousands of problems, several samples each, is longer."""
    client = MlflowClient()
    with tempfile.TemporaryDirectory(prefix="miles-outcomes-") as tmp:
        path = Path(tmp) / "outcomes.json"
        path.write_text(json.dumps(dict(outcomes)))
        client.log_artifact(run_id, str(path), f"registry/{key}")
    return f"runs:/{run_id}/registry/{key}/outcomes.json"


def _load_outcomes(mv: Any) -> dict[str, Any] | None:
    """The version's outcomes record, or None if it has none (registered without one, or lost)."""
    uri = (mv.tags or {}).get(OUTCOMES_TAG)
    if not uri:
        return None
    try:
        rec = mlflow.artifacts.load_dict(uri)
        return rec if rec.get("correct") else None
    except (MlflowException, OSError, ValueError):
        return None


def _comparison(cand: Any, current: Any | None, alpha: float) -> dict[str, Any]:
    """The ``miles.champion_comparison`` record before the test: one schema whatever the outcome."""
    c_fp = (cand.tags or {}).get(FINGERPRINT_TAG, "")
    h_fp = (current.tags or {}).get(FINGERPRINT_TAG, "") if current is not None else None
    return {"champion_version": int(current.version) if current is not None else None, "fingerprint": c_fp,
            "champion_fingerprint": h_fp, "fingerprints_equal": c_fp == h_fp if current is not None else None,
            "problems_equal": None, "wins": None, "losses": None, "p": None, "alpha": alpha}


def _compare(cand: Any, current: Any, alpha: float) -> tuple[bool, str, dict[str, Any]]:
    """The champion rule: promote with no champion (or one registered without the records to test
    against), else only on the same evaluation (fingerprint and problems) and a paired two-sided sign
    test won at ``p < alpha``. Why not "higher pass@1": numbers from different problems or sampler
    settings do not compare, and on one set a few discordant problems are noise."""
    comp = _comparison(cand, current, alpha)
    c_fp, h_fp = comp["fingerprint"], comp["champion_fingerprint"]
    ours, theirs = _load_outcomes(cand), _load_outcomes(current)
    champ = f"champion v{current.version}"
    if ours is None:
        return False, (f"candidate v{cand.version} has no per-problem outcomes recorded (register it with its "
                       f"eval record); it cannot be tested against {champ}"), comp
    if theirs is None or _tag_float(current, PASS1_TAG) is None:
        return True, f"{champ} has no per-problem outcomes or {PASS1_TAG} recorded to test against", comp
    if c_fp != h_fp:
        return False, (f"not comparable: eval fingerprint {c_fp or '(none)'} != {champ}'s {h_fp or '(none)'}; "
                       "re-evaluate the champion on the candidate's set"), comp
    digests = ours.get("problems_digest", ""), theirs.get("problems_digest", "")
    comp["problems_equal"] = len(ours["correct"]) == len(theirs["correct"]) and (
        not all(digests) or digests[0] == digests[1])
    if not comp["problems_equal"]:
        return False, (f"not comparable: same eval fingerprint {c_fp} but different problems ({len(ours['correct'])} "
                       f"digest {digests[0] or '?'} vs {champ}'s {len(theirs['correct'])} digest "
                       f"{digests[1] or '?'}); re-evaluate the champion on the candidate's set"), comp
    # one outcome per problem, its first sample: what `miles demo` and the benchmarks test
    st = paired_sign_test([row[0] == "1" for row in ours["correct"]], [row[0] == "1" for row in theirs["correct"]])
    comp.update(wins=st.wins, losses=st.losses, p=st.p)
    split = f"+{st.wins}/-{st.losses} discordant on {len(ours['correct'])} problems, p={st.p:.3g}"
    if st.wins <= st.losses:
        return False, f"not better than {champ}: {split}", comp
    if st.p >= alpha:
        return False, f"not significant: {split} >= {alpha:g}", comp
    return True, f"significant paired win over {champ}: {split} < {alpha:g}", comp


def promote_if_better(name: str, version: int | str, alpha: float = DEFAULT_ALPHA) -> dict[str, Any]:
    """Move alias ``champion`` to ``version`` only by the rule of :func:`_compare`, and record the
    comparison as the candidate's ``miles.champion_comparison`` tag (JSON), so a registry user sees
    why the alias moved or stayed. A candidate without a pass@1 tag is an error."""
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"promote_if_better: alpha must be in (0, 1), got {alpha}")
    client = MlflowClient()
    cand = client.get_model_version(name, str(version))
    cand_p1 = _tag_float(cand, PASS1_TAG)
    if cand_p1 is None:
        raise ValueError(f"model {name!r} version {version} has no numeric {PASS1_TAG!r} tag to compare")
    current = champion(name)
    out: dict[str, Any] = {"candidate_version": int(cand.version), "candidate_pass1": cand_p1,
                           "previous_champion": int(current.version) if current else None,
                           "previous_pass1": _tag_float(current, PASS1_TAG) if current else None}
    if current is not None:
        out["comparable"] = (current.tags or {}).get(FINGERPRINT_TAG) == (cand.tags or {}).get(FINGERPRINT_TAG)
    comp: dict[str, Any] | None = None
    if current is not None and current.version == cand.version:
        promoted, reason = False, "already champion"
    elif current is None:
        promoted, reason = True, "no champion yet"
        comp = _comparison(cand, None, alpha)
    else:
        promoted, reason, comp = _compare(cand, current, alpha)
    if comp is not None:  # "already champion" keeps the record of how it became one
        comp.update(decision="promoted" if promoted else "refused", reason=reason)
        client.set_model_version_tag(name, str(cand.version), COMPARISON_TAG, json.dumps(comp))
    if promoted:
        client.set_registered_model_alias(name, CHAMPION, str(cand.version))
    champ = champion(name)
    out.update(promoted=promoted, reason=reason, champion_version=int(champ.version) if champ else None,
               comparison=comp)
    return out


def register_model(run_id: str, name: str, base_dir: str | os.PathLike[str], adapter_dir: str | os.PathLike[str] | None,
                   recipe: Mapping[str, Any], pass1: float, eval_fingerprint: str = "",
                   tags: Mapping[str, Any] | None = None, step: int = 0,
                   eval_record: str | os.PathLike[str] | None = None, alpha: float | None = None) -> dict[str, Any]:
    """Log the policy as an MLflow LoggedModel of ``run_id`` (a pyfunc with its signature, listed under
    the experiment's "Logged models" with its pass@1), register it as a new version of ``name``
    (tags: pass@1, eval fingerprint, ``tags``) and apply :func:`promote_if_better` at ``alpha``
    (default: the recipe's ``eval.champion_alpha`` if it has one, else 0.05).

    ``eval_record`` is the evaluation's JSON (``eval_summary``'s file, a flow's ``ev["path"]``): its
    per-problem outcomes are kept as a run artifact named by the version's ``miles.outcomes_uri`` tag,
    so a later candidate can be paired against this version. Without one the version can become
    champion only where there is none yet.

    Why the client's LoggedModel calls and not ``mlflow.pyfunc.log_model``: that one logs into the
    fluent active run, and our runs are addressed by id from worker threads (module docstring).
    """
    from tracking import pyfunc_model
    from mlflow.entities import LoggedModelOutput

    ev = dict(recipe.get("eval") or {})
    alpha = float(ev.get("champion_alpha", DEFAULT_ALPHA)) if alpha is None else float(alpha)
    outcomes = outcomes_record(eval_record, eval_fingerprint, pass1) if eval_record is not None else None
    artifacts = {"base": os.fspath(base_dir)}
    if adapter_dir is not None:
        artifacts["adapter"] = os.fspath(adapter_dir)
    client = MlflowClient()
    run = client.get_run(run_id)
    model = client.create_logged_model(run.info.experiment_id, name=MODEL_ARTIFACT, source_run_id=run_id,
                                       model_type="miles-diffusion-lm",
                                       tags={"miles.registered_as": name, **{k: str(v) for k, v in (tags or {}).items()}})
    try:
        with tempfile.TemporaryDirectory(prefix="miles-model-") as tmp:
            local = Path(tmp) / MODEL_ARTIFACT
            with warnings.catch_warnings():  # the signature is explicit; an input example adds nothing
                warnings.filterwarnings("ignore", message=".*input example was not provided.*")
                mlflow.pyfunc.save_model(
                    str(local), python_model=pyfunc_model.__file__, artifacts=artifacts,
                    code_paths=[_stage_core(Path(tmp) / "code")], pip_requirements=_requirements(),
                    model_config={"recipe": json.loads(json.dumps(dict(recipe)))},
                    signature=pyfunc_model.model_signature(float(ev.get("temperature", 0.0)), int(ev.get("seed", 0))))
            client.log_model_artifacts(model.model_id, str(local))
    except BaseException:
        client.finalize_logged_model(model.model_id, "FAILED")
        raise
    client.finalize_logged_model(model.model_id, "READY")
    client.log_outputs(run_id, [LoggedModelOutput(model.model_id, step)])
    client.log_metric(run_id, "pass1", float(pass1), step=step, model_id=model.model_id)
    _ensure_registered_model(client, name)
    all_tags = {PASS1_TAG: repr(float(pass1)), FINGERPRINT_TAG: eval_fingerprint,
                **{k: str(v) for k, v in (tags or {}).items()}}
    if outcomes is not None:
        all_tags[OUTCOMES_TAG] = log_outcomes(run_id, model.model_id, outcomes)
    mv = client.create_model_version(name, f"models:/{model.model_id}", run_id=run_id, tags=all_tags,
                                     model_id=model.model_id)
    # what mlflow.register_model records: the UI's "Logged models" page lists the model's versions
    client.set_logged_model_tags(model.model_id, {MODEL_VERSIONS_TAG: json.dumps([{"name": name, "version": mv.version}])})
    decision = promote_if_better(name, mv.version, alpha)
    return {"name": name, "version": int(mv.version), "model_uri": f"models:/{name}/{mv.version}",
            "model_id": model.model_id, **decision}


def _point_adapter_at(adapter_dir: Path, base_dir: Path) -> None:
    """The downloaded adapter names the downloaded base (unless it names a hub id), so peft's
    ``AutoPeftModel…from_pretrained(adapter_dir)`` loads it from there."""
    cfg_file = adapter_dir / "adapter_config.json"
    cfg = json.loads(cfg_file.read_text())
    ident = adapter_dir / "miles_base.json"
    hub = json.loads(ident.read_text()).get("hub_id") if ident.exists() else None
    if not hub:
        cfg_file.write_text(json.dumps({**cfg, "base_model_name_or_path": str(base_dir.resolve())}, indent=2))


def resolve_model(model_uri: str, dst_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Download a Miles pyfunc (``models:/NAME@alias``, ``models:/NAME/3``, ``runs:/...``) and return
    its ``base_dir``, ``adapter_dir`` (None for a base-only model), ``recipe`` and registry info."""
    from mlflow.models import Model

    local = Path(mlflow.artifacts.download_artifacts(artifact_uri=model_uri, dst_path=os.fspath(dst_dir)))
    if not (local / "MLmodel").exists():
        raise ValueError(f"{model_uri} is not an MLflow model (no MLmodel file in {local})")
    conf = Model.load(str(local)).flavors.get("python_function", {})
    arts = conf.get("artifacts") or {}
    recipe = (conf.get("config") or conf.get("model_config") or {}).get("recipe")
    if "base" not in arts or not isinstance(recipe, dict):
        raise ValueError(f"{model_uri} was not logged by Miles (needs a 'base' artifact and a recipe model_config)")
    out: dict[str, Any] = {"local_dir": str(local), "base_dir": str(local / arts["base"]["path"]),
                           "adapter_dir": str(local / arts["adapter"]["path"]) if "adapter" in arts else None,
                           "recipe": recipe, "name": None, "version": None, "registered_pass1": None}
    if out["adapter_dir"]:
        _point_adapter_at(Path(out["adapter_dir"]), Path(out["base_dir"]))
    m = re.match(r"^models:/([^/@]+)(?:@(.+)|/(\d+))$", model_uri)
    if m:
        client = MlflowClient()
        name, alias, ver = m.groups()
        mv = client.get_model_version_by_alias(name, alias) if alias else client.get_model_version(name, ver)
        out.update(name=name, version=int(mv.version), registered_pass1=_tag_float(mv, PASS1_TAG),
                   eval_fingerprint=(mv.tags or {}).get(FINGERPRINT_TAG))
    return out
