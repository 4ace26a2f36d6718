"""The model registry: a trained policy as an MLflow LoggedModel (pyfunc, signature, requirements),
its registered versions, and the ``champion`` alias that moves only on a better pass@1.

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

CHAMPION = "champion"
PASS1_TAG = "miles.pass1"
FINGERPRINT_TAG = "miles.eval_fingerprint"
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


def promote_if_better(name: str, version: int | str) -> dict[str, Any]:
    """Move alias ``champion`` to ``version`` only if its pass@1 tag beats the champion's (strictly).

    A champion without a recorded pass@1 is replaced; a candidate without one is an error. Both
    eval-config fingerprints are reported so a caller can see whether the numbers are comparable.
    """
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
    if current is not None and current.version == cand.version:
        promoted, reason = False, "already champion"
    elif current is None:
        promoted, reason = True, "no champion yet"
    elif out["previous_pass1"] is None:
        promoted, reason = True, f"champion v{current.version} has no {PASS1_TAG} tag"
    elif cand_p1 > out["previous_pass1"]:
        promoted, reason = True, f"pass@1 {cand_p1:.4f} > {out['previous_pass1']:.4f}"
    else:
        promoted, reason = False, f"pass@1 {cand_p1:.4f} <= champion v{current.version} {out['previous_pass1']:.4f}"
    if promoted:
        client.set_registered_model_alias(name, CHAMPION, str(cand.version))
    champ = champion(name)
    out.update(promoted=promoted, reason=reason, champion_version=int(champ.version) if champ else None)
    return out


def register_model(run_id: str, name: str, base_dir: str | os.PathLike[str], adapter_dir: str | os.PathLike[str] | None,
                   recipe: Mapping[str, Any], pass1: float, eval_fingerprint: str = "",
                   tags: Mapping[str, Any] | None = None, step: int = 0) -> dict[str, Any]:
    """Log the policy as an MLflow LoggedModel of ``run_id`` (a pyfunc with its signature, listed under
    the experiment's "Logged models" with its pass@1), register it as a new version of ``name``
    (tags: pass@1, eval fingerprint, ``tags``) and apply :func:`promote_if_better`.

    Why the client's LoggedModel calls and not ``mlflow.pyfunc.log_model``: that one logs into the
    fluent active run, and our runs are addressed by id from worker threads (module docstring).
    """
    from tracking import pyfunc_model
    from mlflow.entities import LoggedModelOutput

    ev = dict(recipe.get("eval") or {})
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
    mv = client.create_model_version(name, f"models:/{model.model_id}", run_id=run_id, tags=all_tags,
                                     model_id=model.model_id)
    # what mlflow.register_model records: the UI's "Logged models" page lists the model's versions
    client.set_logged_model_tags(model.model_id, {MODEL_VERSIONS_TAG: json.dumps([{"name": name, "version": mv.version}])})
    decision = promote_if_better(name, mv.version)
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
