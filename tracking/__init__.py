"""Everything Miles keeps in MLflow. This module: runs, params, metrics, artifacts, the learning-curve
plot; ``tracking.registry``: the policy as a LoggedModel, its versions and ``champion``;
``tracking.pyfunc_model``: the served model. ARCHITECTURE.md, "Packages".

Why one package below tasks and flows (and above miles_core, which never imports MLflow): flows and
tasks stay small, and an MLflow upgrade lands in one place. Every call
takes an explicit run id and goes through ``MlflowClient``, never the fluent "active run", so a
task running in a worker thread cannot log into somebody else's run.

Defaults: ``MLFLOW_TRACKING_URI`` if set, else ``sqlite:///<cwd>/mlruns/mlflow.db`` with artifacts
in ``<cwd>/mlruns/artifacts`` (the embedded, one-machine mode; infra/README.md).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import mlflow
from mlflow import MlflowClient
from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException

log = logging.getLogger("miles.tracking")  # under the "miles" logger every Miles process configures

# MLflow 3's UI opens an experiment by its kind: "custom_model_development" ("Machine learning") is
# the runs table; without the tag it may infer GenAI and open an empty traces overview.
EXPERIMENT_KIND_TAG, EXPERIMENT_KIND = "mlflow.experimentKind", "custom_model_development"
_BATCH = 100  # MLflow accepts at most 100 params / 1000 metrics per log_batch call
_BAD_KEY = re.compile(r"[^A-Za-z0-9_\-. /:]")


def default_tracking_uri() -> str:
    """``MLFLOW_TRACKING_URI`` if set, else a SQLite file under ``./mlruns``."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path.cwd().resolve() / 'mlruns' / 'mlflow.db'}"


def _sqlite_file(uri: str) -> Path | None:
    return Path(uri[len("sqlite:///"):]) if uri.startswith("sqlite:///") else None


# MLflow's HTTP client retries a call 7 times with a backoff factor of 2 and a 120 s timeout: a server
# that went away mid-run hung a finished run in retries for ~8 minutes. Miles' budget per call: 4
# attempts, backoff 0 + 2 + 4 s (+ up to 1 s jitter each), a 60 s timeout per attempt: a server that
# refuses connections costs ~10 s per call, one that accepts and never answers at most ~250 s. A
# user's own MLFLOW_HTTP_* settings win.
HTTP_BUDGET = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "3", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
               "MLFLOW_HTTP_REQUEST_TIMEOUT": "60"}


def configure(tracking_uri: str | None = None) -> str:
    """Point MLflow (tracking and, unless ``MLFLOW_REGISTRY_URI`` says otherwise, registry) at a store."""
    uri = check_uri(tracking_uri)
    # per-file download bars of tiny artifacts (table appends, model downloads) only bury the logs
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    for key, value in HTTP_BUDGET.items():
        os.environ.setdefault(key, value)
    mlflow.set_tracking_uri(uri)
    if not os.environ.get("MLFLOW_REGISTRY_URI"):
        mlflow.set_registry_uri(uri)
    return uri


def check_uri(tracking_uri: str | None = None) -> str:
    """The tracking URI in effect, refused in seconds if unusable: a ``sqlite:///`` file whose folder's
    parent does not exist (a typo must not plant a folder tree; the database's own folder is created),
    a server that does not answer."""
    uri = tracking_uri or default_tracking_uri()
    db = _sqlite_file(uri)
    if db is not None:
        if not db.parent.parent.is_dir():
            raise ValueError(f"tracking URI {uri}: folder {db.parent.parent} does not exist (Miles creates at most "
                             f"the database's own folder, {db.parent.name}/)")
        db.parent.mkdir(exist_ok=True)
    elif uri.startswith(("http://", "https://")):
        check_server(uri)
    return uri


def check_server(uri: str, timeout_s: float = 10.0) -> None:
    """Fail in seconds, naming ``uri``, when the tracking server does not answer: MLflow's own client
    retries a refused connection for minutes before it says anything."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=timeout_s):
            return
    except urllib.error.HTTPError:
        return  # it answered (a proxy or an auth layer may refuse /health); the real calls will tell
    except OSError as e:
        raise ConnectionError(f"MLflow tracking server {uri} does not answer ({getattr(e, 'reason', e)}); start it "
                              "(infra/start-mlflow-server.sh) or pass --tracking-uri sqlite:///PATH/mlflow.db") from None


def metric_key(name: str) -> str:
    """MLflow-safe metric name (``pass@1`` -> ``pass_at_1``; other odd characters -> ``_``)."""
    return _BAD_KEY.sub("_", name.replace("@", "_at_"))


def _experiment_id(client: MlflowClient, name: str) -> str:
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        if EXPERIMENT_KIND_TAG not in exp.tags:
            client.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
        return exp.experiment_id
    db = _sqlite_file(mlflow.get_tracking_uri())
    location = (db.resolve().parent / "artifacts").as_uri() if db is not None else None
    try:
        return client.create_experiment(name, artifact_location=location, tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})
    except MlflowException:  # created concurrently by another run
        exp = client.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


def _prefect_tags() -> dict[str, str]:
    """Link the MLflow run to the Prefect flow run it belongs to (empty outside a flow run)."""
    try:
        from prefect.runtime import flow_run
    except ImportError:
        return {}
    run_id = flow_run.id
    if not run_id:
        return {}
    return {"prefect.flow_run_id": str(run_id), "prefect.flow_run_name": str(flow_run.name or ""),
            "prefect.flow_name": str(flow_run.flow_name or "")}


def start_run(experiment: str, run_name: str, params: Mapping[str, Any] | None = None,
              tags: Mapping[str, Any] | None = None) -> str:
    """Create a run in ``experiment`` (created if missing), tagged with the Prefect flow run id and,
    for a task that executes completions, with the sandbox isolation it ran under."""
    client = MlflowClient()
    all_tags = {**_prefect_tags(), **_sandbox_tags(params or {}), **{k: str(v) for k, v in (tags or {}).items()}}
    run = client.create_run(_experiment_id(client, experiment), tags=all_tags, run_name=run_name)
    if params:
        log_params(run.info.run_id, params)
    return run.info.run_id


def _sandbox_tags(params: Mapping[str, Any]) -> dict[str, str]:
    """``miles.sandbox.isolation`` for the code task; ``sandbox.isolation=none`` is also tagged
    ``miles.sandbox.unisolated=true`` and logged as a warning, so an unisolated run is never silent."""
    if params.get("task.name") != "code":
        return {}
    mode = str(params.get("sandbox.isolation", "bwrap"))
    if mode != "none":
        return {"miles.sandbox.isolation": mode}
    log.warning("this run executes model-written code WITHOUT a kernel sandbox (sandbox.isolation=none)")
    return {"miles.sandbox.isolation": mode, "miles.sandbox.unisolated": "true"}


def end_run(run_id: str, status: str = "FINISHED") -> None:
    MlflowClient().set_terminated(run_id, status=status)


def run_exists(run_id: str) -> bool:
    try:
        MlflowClient().get_run(run_id)
        return True
    except MlflowException:
        return False


def end_if_running(run_id: str, status: str = "KILLED") -> bool:
    """End ``run_id`` with ``status`` if it is still RUNNING (its process died) -> whether it was.
    A run this store does not have is not running; a store that does not answer raises."""
    client = MlflowClient()
    try:
        if client.get_run(run_id).info.status != "RUNNING":
            return False
    except MlflowException as e:
        if e.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            return False
        raise
    client.set_terminated(run_id, status=status)
    return True


def reopen_run(run_id: str, params: Mapping[str, Any] | None = None, tags: Mapping[str, Any] | None = None) -> None:
    """Continue ``run_id`` (a resume): RUNNING again, its params completed (:func:`log_params`), the
    resumes counted in ``miles.resumes``."""
    client = MlflowClient()
    run = client.get_run(run_id)
    client.update_run(run_id, status="RUNNING")
    log_params(run_id, params or {})
    resumes = int(run.data.tags.get("miles.resumes", "0")) + 1
    set_tags(run_id, {**{k: v for k, v in (tags or {}).items() if k not in run.data.tags}, "miles.resumes": resumes})


@contextlib.contextmanager
def run(experiment: str, run_name: str, params: Mapping[str, Any] | None = None,
        tags: Mapping[str, Any] | None = None, resume_run_id: str | None = None,
        unended: Callable[[str, str], None] | None = None) -> Iterator[str]:
    """``with run(...) as run_id``: the run ends FINISHED, FAILED if the body raises, KILLED if it is
    interrupted (Ctrl-C, SIGTERM). ``resume_run_id``: continue that run instead of creating one.
    When the final status cannot be written (the tracking server went away), ``unended(run_id,
    status)`` is told, so the status can be applied later (flows/session.py), and the block's own
    error, if any, is the one raised."""
    before = None
    if resume_run_id:
        before = MlflowClient().get_run(resume_run_id).info.status
        reopen_run(resume_run_id, params, tags)
        run_id = resume_run_id
    else:
        run_id = start_run(experiment, run_name, params, tags)
    def end(status: str, note: str | None = None) -> None:
        try:
            if note is not None:
                set_tags(run_id, {"miles.last_resume": note})
            end_run(run_id, status)
        except Exception as e:  # noqa: BLE001 - the store is unreachable: say so, leave it to the caller
            log.error("MLflow run %s could not be marked %s (%s: %s)", run_id, status, type(e).__name__, str(e)[:200])
            if unended is None:
                raise
            unended(run_id, status)
    try:
        yield run_id
    except BaseException as e:
        status = "KILLED" if stopped(e) else "FAILED"
        if before == "FINISHED":  # a finished run (it may back a registered version) keeps its status
            end(before, f"{status}: {type(e).__name__}: {str(e)[:300]}")
        else:
            end(status)
        raise
    end("FINISHED")


def stopped(e: BaseException) -> bool:
    """Whether ``e`` is a stop from outside (the run ends KILLED), not a failure: Ctrl-C, SystemExit
    (the CLI's own SIGTERM handler) and Prefect's ``TerminationSignal``, which the flow engine raises
    for a SIGTERM while a flow runs (its handler replaces the CLI's; Kubernetes and schedulers stop
    jobs so). Matched by name so this package does not import Prefect."""
    return isinstance(e, (KeyboardInterrupt, SystemExit)) or any(
        c.__name__ == "TerminationSignal" and c.__module__.startswith("prefect") for c in type(e).__mro__)


def log_params(run_id: str, params: Mapping[str, Any]) -> None:
    """Log params (values stringified; lists/dicts as JSON) in chunks MLflow accepts.

    MLflow params are write-once: in a resumed run, a param already logged with the same value is
    skipped, and one whose value changed (a resumable setting such as ``train.iterations``) keeps its
    first value with the change recorded in the tag ``miles.changed_params`` (JSON: key -> [old, new])."""
    client = MlflowClient()
    have = client.get_run(run_id).data.params
    as_str = {k: (json.dumps(v) if isinstance(v, (list, dict, tuple)) else str(v))[:6000] for k, v in params.items()}
    items = [Param(k, v) for k, v in as_str.items() if k not in have]
    changed = {k: [have[k], v] for k, v in as_str.items() if k in have and have[k] != v}
    for i in range(0, len(items), _BATCH):
        client.log_batch(run_id, params=items[i:i + _BATCH])
    if changed:
        old = json.loads(client.get_run(run_id).data.tags.get("miles.changed_params", "{}"))
        set_tags(run_id, {"miles.changed_params": json.dumps({**old, **changed})[:5000]})


def set_tags(run_id: str, tags: Mapping[str, Any]) -> None:
    MlflowClient().log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])


def log_metrics(run_id: str, metrics: Mapping[str, float | int | None], step: int = 0) -> None:
    """Log numeric metrics at ``step``; ``None`` values are skipped, names made MLflow-safe."""
    ts = int(time.time() * 1000)
    items = [Metric(metric_key(k), float(v), ts, int(step)) for k, v in metrics.items() if v is not None]
    if items:
        MlflowClient().log_batch(run_id, metrics=items)


def log_eval(run_id: str, ev: Mapping[str, Any], step: int, prefix: str = "eval") -> None:
    """Metrics of an evaluation summary: ``{prefix}/pass1``, other pass@k, NFE, tokens/s, seconds."""
    metrics = {f"{prefix}/pass1": ev["pass1"]}
    metrics.update({f"{prefix}/{k}": v for k, v in ev["pass_at"].items() if k != "pass@1"})
    metrics.update({f"{prefix}/{k}": v for k, v in ev["metrics"].items()})
    log_metrics(run_id, metrics, step)


def log_artifact(run_id: str, local_file: str | os.PathLike[str], artifact_path: str | None = None) -> None:
    MlflowClient().log_artifact(run_id, os.fspath(local_file), artifact_path)


def log_artifacts(run_id: str, local_dir: str | os.PathLike[str], artifact_path: str | None = None) -> None:
    MlflowClient().log_artifacts(run_id, os.fspath(local_dir), artifact_path)


def log_table(run_id: str, rows: Sequence[Mapping[str, Any]], artifact_file: str) -> None:
    """Append rows to a table artifact (shown in the MLflow UI's evaluation/table view)."""
    if not rows:
        return
    import pandas as pd

    MlflowClient().log_table(run_id, pd.DataFrame([dict(r) for r in rows]), artifact_file)


def metric_history(run_id: str, key: str) -> list[tuple[int, float]]:
    """``(step, value)`` pairs of one metric, sorted by step."""
    hist = MlflowClient().get_metric_history(run_id, metric_key(key))
    return sorted((int(m.step), float(m.value)) for m in hist)


def log_curves(run_id: str, panels: Sequence[tuple[str, Sequence[str]]], artifact_file: str,
               xlabel: str = "iteration") -> bool:
    """Plot logged metric histories (one subplot per panel) to a PNG artifact; False if no data.

    Plotting from MLflow's own history means the figure shows exactly what was logged."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = [(title, [(k, metric_history(run_id, k)) for k in keys]) for title, keys in panels]
    if not any(h for _, lines in series for _, h in lines):
        return False
    fig, axes = plt.subplots(1, len(series), figsize=(5 * len(series), 3.6), squeeze=False)
    for ax, (title, lines) in zip(axes[0], series):
        for key, hist in lines:
            if hist:
                ax.plot([s for s, _ in hist], [v for _, v in hist], marker="o", markersize=3, label=key)
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        if any(h for _, h in lines):
            ax.legend(fontsize=8)
    fig.tight_layout()
    try:
        MlflowClient().log_figure(run_id, fig, artifact_file)
    finally:
        plt.close(fig)
    return True


def log_histogram(run_id: str, counts: Mapping[str, int], artifact_file: str, xlabel: str, title: str) -> None:
    """A bar chart of ``counts`` (e.g. batches per staleness value) as a PNG artifact, plus the table."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted(counts, key=lambda k: float(k))
    fig, ax = plt.subplots(figsize=(5, 3.4))
    ax.bar([str(k) for k in keys], [counts[k] for k in keys])
    ax.set_xlabel(xlabel)
    ax.set_ylabel("count")
    ax.set_title(title)
    fig.tight_layout()
    try:
        MlflowClient().log_figure(run_id, fig, artifact_file)
    finally:
        plt.close(fig)
    log_table(run_id, [{xlabel: k, "count": counts[k]} for k in keys], artifact_file.rsplit(".", 1)[0] + ".json")
