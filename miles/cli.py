"""``miles``: run the Prefect flows from a shell.

Why a CLI on top of the flows: a user should get from a fresh clone to "SFT vs RL pass@1" with one
command, and a bad recipe or override must fail in a second with a message naming the field, not
after a Prefect flow run and a model build. So every subcommand validates its recipe with
:func:`miles_core.config.load_recipe` first and only then imports and calls the flow. Heavy
imports (torch, prefect, mlflow) happen inside the subcommand so ``--help`` stays fast.

Exit codes: 0 success, 1 the run failed, 2 bad usage or configuration.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import re
import signal
import sys
import textwrap
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from miles import __version__

EXIT_RUN_FAILED = 1
EXIT_USAGE = 2

# The demo: the `arith` recipe shrunk so SFT -> ADPO -> evaluation finishes in about ten minutes on
# two idle CPU cores (benchmarks/learning.py runs the full-size comparison).
DEMO_RECIPE = "arith"
DEMO_OVERRIDES: dict[str, list[str]] = {
    "arith": ["sft.steps=2500", "sft.eval_every=500", "train.iterations=40", "train.eval_every=20",
              "eval.num_problems=200"],
}
DEMO_EXPERIMENT = "miles-demo"


class UsageError(Exception):
    """A command line that cannot run as given; printed as one line, exit code 2."""


def _recipes_dir() -> Path:
    import miles_core.config as config

    return Path(config.__file__).parent / "recipes"


def validate_recipe(recipe: str | None, overrides: Sequence[str]) -> Any:
    """Load the recipe with its overrides, so a bad field fails before any flow starts."""
    from miles_core.config import ConfigError, load_recipe

    cfg = load_recipe(recipe or DEMO_RECIPE, list(overrides))
    if cfg.model.device.startswith("cuda"):  # a GPU that is not there: say so now, not after flow start-up
        from miles_core.models.base import resolve_device

        try:
            resolve_device(cfg.model.device)
        except RuntimeError as e:
            raise ConfigError(f"model.device: {e}") from None
    return cfg


def _prefect_defaults() -> None:
    """Sensible defaults for the embedded (serverless) Prefect mode on a small machine."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")


def call_flow(module: str, name: str, params: dict[str, Any]) -> Any:
    """Import ``flows.<module>.<name>`` and call it with the parameters its signature accepts.

    ``None`` values mean "flow default" and are dropped. A parameter the user asked for that the
    flow does not take is a usage error rather than being silently ignored.
    """
    _prefect_defaults()
    flow = getattr(importlib.import_module(f"flows.{module}"), name)
    accepted = inspect.signature(getattr(flow, "fn", flow)).parameters
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    kwargs: dict[str, Any] = {}
    for key, value in params.items():
        if value is None:
            continue
        if key not in accepted and not takes_kwargs:
            if key == "progress":
                continue  # progress bars are a nicety, not a request
            raise UsageError(f"flows.{module}.{name} does not accept option {key!r}")
        kwargs[key] = value
    return flow(**kwargs)


def _print_result(result: Any) -> None:
    import json

    if isinstance(result, dict):
        print(json.dumps(result, indent=2, default=str, sort_keys=True))
    elif result is not None:
        print(result)


# ----------------------------------------------------------------------------- subcommands

def cmd_recipes(args: argparse.Namespace) -> int:
    """List built-in recipes with the first comment line of each file."""
    for path in sorted(_recipes_dir().glob("*.yaml")):
        lines = textwrap.wrap(recipe_summary(path.read_text()), 86) or [""]
        print(f"{path.stem:<12} {lines[0]}")
        for more in lines[1:]:
            print(f"{'':<12} {more}")
    return 0


def recipe_summary(text: str) -> str:
    """The first sentence of a recipe's leading comment, however many lines it spans."""
    words: list[str] = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        words.append(line.lstrip("#").strip())
        joined = " ".join(w for w in words if w)
        m = re.search(r"^(.*?(?<!e\.g)(?<!i\.e)\.)(\s|$)", joined)  # "e.g." ends no sentence
        if m:
            return m.group(1)
    return " ".join(w for w in words if w)


def cmd_sft(args: argparse.Namespace) -> int:
    validate_recipe(args.recipe, args.overrides)
    result = call_flow("sft", "sft_flow", {
        "recipe": args.recipe, "overrides": list(args.overrides), "run_dir": args.run_dir,
        "experiment": args.experiment, "tracking_uri": args.tracking_uri, "register_as": args.register_as,
        "progress": args.progress})
    _print_result(result)
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    if args.resume and not args.run_dir:
        raise UsageError("--resume needs --run-dir (the folder holding the learner checkpoint to continue)")
    overrides = list(args.overrides)
    check = overrides + ([f"train.iterations={args.iterations}"] if args.iterations is not None else [])
    validate_recipe(args.recipe, check)
    result = call_flow("train", "train_flow", {
        "recipe": args.recipe, "overrides": overrides, "run_dir": args.run_dir, "store_uri": args.store,
        "base_checkpoint": args.base_checkpoint, "iterations": args.iterations, "experiment": args.experiment,
        "tracking_uri": args.tracking_uri, "register_as": args.register_as,
        "resume": True if args.resume else None, "progress": args.progress})
    _print_result(result)
    return 0


def cmd_async_train(args: argparse.Namespace) -> int:
    overrides = list(args.overrides)
    check = overrides + [f"async_rl.{k}={v}" for k, v in (("num_samplers", args.samplers),
                                                           ("batches_per_sampler", args.batches)) if v is not None]
    validate_recipe(args.recipe, check)
    result = call_flow("async_train", "async_train_flow", {
        "recipe": args.recipe, "overrides": overrides, "run_dir": args.run_dir, "store_uri": args.store,
        "base_checkpoint": args.base_checkpoint, "num_samplers": args.samplers, "batches_per_sampler": args.batches,
        "launcher": args.launcher, "experiment": args.experiment, "tracking_uri": args.tracking_uri,
        "register_as": args.register_as, "timeout_s": args.timeout, "progress": args.progress})
    _print_result(result)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    if args.adapter and not args.base:
        raise UsageError("--adapter needs --base (the SFT checkpoint the adapter was trained on)")
    if not (args.model or args.base):
        raise UsageError("give --model URI, or --adapter DIR --base DIR, or --base DIR alone (the SFT baseline)")
    if args.model and args.base:
        raise UsageError("--base goes with --adapter (or alone), not with --model")
    validate_recipe(args.recipe, args.overrides)
    result = call_flow("evaluate", "evaluate_flow", {
        "model_uri": args.model, "adapter": args.adapter, "base_checkpoint": args.base,
        "recipe": args.recipe, "overrides": list(args.overrides), "num_problems": args.num_problems,
        "experiment": args.experiment, "tracking_uri": args.tracking_uri, "progress": args.progress})
    _print_result(result)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    """Load a registered model with ``mlflow.pyfunc`` and print one completion per prompt."""
    import mlflow.pyfunc
    import pandas as pd

    uri = tracking_uri(args.tracking_uri)  # the store training registered into, not MLflow's own default
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    model = mlflow.pyfunc.load_model(args.model)
    out = model.predict(pd.DataFrame({"prompt": list(args.prompts)}))
    if isinstance(out, pd.DataFrame):
        col = "completion" if "completion" in out.columns else out.columns[0]
        completions = [str(v) for v in out[col].tolist()]
    else:
        completions = [str(v) for v in list(out)]
    for prompt, completion in zip(args.prompts, completions):
        print(f"{prompt}\t{completion}" if args.with_prompt else completion)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """``mlflow models serve`` for a registered model, with this interpreter's scripts on PATH (MLflow
    starts ``uvicorn`` by name, which fails when the venv is not activated) and the project's store."""
    uri = tracking_uri(args.tracking_uri)
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "MLFLOW_REGISTRY_URI": uri,
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    cmd = [sys.executable, "-m", "mlflow", "models", "serve", "-m", args.model, "--env-manager", "local",
           "--host", args.host, "--port", str(args.port)]
    print(f"[miles serve] {args.model} on http://{args.host}:{args.port}/invocations "
          f"(POST {{\"inputs\": [\"12+7*3\"]}})", flush=True)
    os.execvpe(cmd[0], cmd, env)
    return 0  # not reached


def cmd_models(args: argparse.Namespace) -> int:
    from miles_core.models.__main__ import main as models_main

    return models_main([args.action, args.dir, "--family", args.family])


def demo_overrides(recipe: str, extra: Sequence[str]) -> list[str]:
    """The demo's sizing for ``recipe`` (only ``arith`` is shrunk) followed by the user's overrides."""
    return [*DEMO_OVERRIDES.get(recipe, []), *extra]


def cmd_demo(args: argparse.Namespace) -> int:
    """SFT baseline -> ADPO training -> evaluation of the registered model, then where to look."""
    run_dir = Path(args.run_dir or f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    overrides = demo_overrides(args.recipe, args.overrides)
    validate_recipe(args.recipe, overrides)
    common = {"recipe": args.recipe, "overrides": overrides, "experiment": args.experiment,
              "tracking_uri": args.tracking_uri, "progress": args.progress}
    print(f"[miles demo] 1/3 SFT baseline ({args.recipe}) -> {run_dir / 'sft'}", flush=True)
    sft = call_flow("sft", "sft_flow", {**common, "run_dir": str(run_dir / "sft")})
    print(f"[miles demo] 2/3 ADPO training on top of {sft['base_checkpoint']}", flush=True)
    train = call_flow("train", "train_flow", {**common, "run_dir": str(run_dir / "train"),
                                              "base_checkpoint": sft["base_checkpoint"],
                                              "register_as": args.register_as})
    print("[miles demo] 3/3 evaluation of the trained policy", flush=True)
    source = ({"model_uri": train["model_uri"]} if train.get("model_uri")
              else {"adapter": train["adapter_dir"], "base_checkpoint": train["base_checkpoint"]})
    ev = call_flow("evaluate", "evaluate_flow", {**common, "run_dir": str(run_dir / "eval"), **source})
    print(demo_report(sft, train, ev))
    _print_where_to_look(run_dir, train.get("model_uri"), args.tracking_uri)
    return 0


def demo_report(sft: dict[str, Any], train: dict[str, Any], ev: dict[str, Any]) -> str:
    """SFT vs RL pass@1 on the same held-out problems, and whether the eval settings matched."""
    lines = ["", "=" * 64,
             f"  SFT baseline pass@1 : {sft['sft_pass1']:.3f}",
             f"  ADPO (RL)    pass@1 : {ev['pass1']:.3f}   ({train['iterations']} iterations, "
             f"{ev['num_problems']} held-out problems)",
             f"  change              : {ev['pass1'] - sft['sft_pass1']:+.3f}"]
    if sft.get("eval_fingerprint") != ev.get("eval_fingerprint"):
        lines.append("  note: the two evaluations used different settings "
                     f"({sft.get('eval_fingerprint')} vs {ev.get('eval_fingerprint')}); compare with care")
    if train.get("model_uri"):
        status = "now champion" if train.get("promoted") else f"champion stays v{train.get('champion_version')}"
        lines.append(f"  registered          : {train['model_uri']} ({status})")
    lines.append("=" * 64)
    return "\n".join(lines)


def tracking_uri(explicit: str | None = None) -> str:
    """The MLflow store the flows write to: ``--tracking-uri``, the env var, else the default."""
    uri = explicit or os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    try:
        tracking = importlib.import_module("tasks.tracking")
        default = getattr(tracking, "default_tracking_uri", None)
        if callable(default):
            return str(default())
    except ImportError:
        pass
    return f"sqlite:///{Path.cwd() / 'mlruns' / 'mlflow.db'}"


def _print_where_to_look(run_dir: Path, model_uri: str | None = None, store: str | None = None) -> None:
    uri = tracking_uri(store)
    print("\nWhere to look:")
    print(f"  run folder : {run_dir}")
    if uri.startswith(("http://", "https://")):
        print(f"  MLflow UI  : {uri}")
    else:
        print(f"  MLflow UI  : mlflow ui --backend-store-uri {uri} --host 127.0.0.1 --port 5000")
    print("  Prefect UI : prefect server start --host 127.0.0.1   (then http://127.0.0.1:4200: the demo's")
    print("               flow runs are in the same PREFECT_HOME database the temporary server used)")
    if model_uri:
        name = model_uri.split("/")[1] if model_uri.startswith("models:/") else model_uri
        print(f'  try it     : miles generate --model "models:/{name}@champion" "12+7*3" "45-6*7"')
        print(f'  serve it   : miles serve --model "models:/{name}@champion" --port 5001')


# ----------------------------------------------------------------------------- parser

def _common(p: argparse.ArgumentParser, experiment_default: str | None = None) -> None:
    p.add_argument("--experiment", default=experiment_default,
                   help=f"MLflow experiment name (default: {experiment_default or 'miles'})")
    p.add_argument("--tracking-uri", help="MLflow tracking URI (default: MLFLOW_TRACKING_URI, else ./mlruns/mlflow.db)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="hide progress bars")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="miles", description="Reinforcement-learning post-training (ADPO) for diffusion language models.",
        epilog="Overrides are key.sub=value pairs, e.g. adpo.lr=5e-4 train.iterations=20. "
               "Run 'miles recipes' for the built-in recipes.")
    parser.add_argument("--version", action="version", version=f"miles {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    ov_help = "recipe overrides, key.sub=value"

    p = sub.add_parser("train", help="ADPO training on top of an SFT checkpoint (Prefect flow)",
                       description="Synchronous ADPO: rollout -> reward -> update -> eval, per iteration.")
    p.add_argument("recipe", help="built-in recipe name or a YAML file")
    p.add_argument("overrides", nargs="*", metavar="key=value", help=ov_help)
    p.add_argument("--run-dir", help="folder for checkpoints, adapters and logs")
    p.add_argument("--store", help="trajectory/adapter storage URI (local folder or s3://bucket/prefix)")
    p.add_argument("--iterations", type=int, help="number of RL iterations (overrides train.iterations)")
    p.add_argument("--base-checkpoint", help="SFT checkpoint folder (default: train one first)")
    p.add_argument("--register-as", help="MLflow registered model for the final adapter (default: miles-arith; '' = none)")
    p.add_argument("--resume", action="store_true", help="continue from the run folder's last checkpoint")
    _common(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("async-train", help="asynchronous ADPO: sampler workers + learner through the store",
                       description="Decoupled samplers and one learner that share only the store URI; bounded "
                                   "staleness (adpo.max_staleness), back-pressure (async_rl.max_pending). "
                                   "Workers that crash are restarted and resume; see README 'Asynchronous training'.")
    p.add_argument("recipe", help="built-in recipe name or a YAML file")
    p.add_argument("overrides", nargs="*", metavar="key=value", help=ov_help)
    p.add_argument("--run-dir", help="local folder for logs, the final adapter and evaluation")
    p.add_argument("--store", help="the run's store URI shared by all workers (local folder or s3://bucket/prefix)")
    p.add_argument("--base-checkpoint", help="SFT checkpoint folder (default: train one first)")
    p.add_argument("--samplers", type=int, help="sampler workers (overrides async_rl.num_samplers)")
    p.add_argument("--batches", type=int, help="batches per sampler (overrides async_rl.batches_per_sampler)")
    p.add_argument("--launcher", choices=["processes", "deployments"],
                   help="processes (default): local subprocesses; deployments: miles-async-* deployments on work pools")
    p.add_argument("--timeout", type=float, help="seconds before the run is failed (default 3600)")
    p.add_argument("--register-as", help="MLflow registered model for the final adapter (default: miles-arith; '' = none)")
    _common(p)
    p.set_defaults(func=cmd_async_train)

    p = sub.add_parser("sft", help="supervised (SFT) baseline (Prefect flow)",
                       description="Masked-diffusion SFT on the recipe's labelled demonstrations.")
    p.add_argument("recipe", help="built-in recipe name or a YAML file")
    p.add_argument("overrides", nargs="*", metavar="key=value", help=ov_help)
    p.add_argument("--run-dir", help="folder for the checkpoint and logs")
    p.add_argument("--register-as", help="MLflow registered model name for the checkpoint")
    _common(p)
    p.set_defaults(func=cmd_sft)

    p = sub.add_parser("eval", help="pass@k of a registered model or an adapter folder (Prefect flow)",
                       description="Evaluate on the recipe's held-out problems with pinned sampling settings.")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="MLflow model URI, e.g. models:/miles-arith@champion")
    src.add_argument("--adapter", help="LoRA adapter folder or <store>/adapters/vNNNNNN (needs --base)")
    p.add_argument("--base", help="SFT checkpoint folder (with --adapter, or alone to evaluate the baseline)")
    p.add_argument("--num-problems", type=int, help="held-out problems (overrides eval.num_problems)")
    p.add_argument("--recipe", default=None, help="recipe for task and eval settings (default: the model's own, else arith)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help=ov_help)
    _common(p)
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("generate", help="print completions from a registered model (mlflow.pyfunc)",
                       description="Load a registered model with mlflow.pyfunc and complete each prompt.")
    p.add_argument("--model", required=True, help="MLflow model URI, e.g. models:/miles-arith@champion")
    p.add_argument("prompts", nargs="+", metavar="PROMPT", help="one or more prompts")
    p.add_argument("--with-prompt", action="store_true", help="print 'prompt<TAB>completion' lines")
    p.add_argument("--tracking-uri", default=None,
                   help="MLflow tracking/registry URI (default: $MLFLOW_TRACKING_URI, else ./mlruns/mlflow.db, "
                        "where training registers models)")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("serve", help="serve a registered model over HTTP (mlflow models serve, venv-independent)",
                       description="Serve a registered model's predict over HTTP on the project's MLflow store.")
    p.add_argument("--model", required=True, help="MLflow model URI, e.g. models:/miles-arith@champion")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=5001)
    p.add_argument("--tracking-uri", default=None, help="MLflow tracking/registry URI (default as for generate)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("demo", help="SFT -> ADPO -> evaluation on the embedded defaults (~10 min on CPU)",
                       description="Runs the whole loop on one machine (Prefect without a server, MLflow "
                                   "on a local SQLite file) and prints SFT vs RL pass@1.")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="extra overrides for every stage")
    p.add_argument("--recipe", default=DEMO_RECIPE, help=f"recipe (default {DEMO_RECIPE}, shrunk to fit ~10 min)")
    p.add_argument("--run-dir", help="output folder (default: runs/demo-<time>)")
    p.add_argument("--register-as", help="registered model name for the adapter (default: miles-arith)")
    _common(p, experiment_default=DEMO_EXPERIMENT)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("recipes", help="list built-in recipes", description="List built-in recipes.")
    p.set_defaults(func=cmd_recipes)

    p = sub.add_parser("models", help="check a model folder (family, size, ids, attention, smoke forward)",
                       description="miles models check DIR: load a checkpoint folder the way training does.")
    p.add_argument("action", choices=["check"])
    p.add_argument("dir", help="a local checkpoint folder (config.json, *.safetensors, tokenizer)")
    p.add_argument("--family", default="auto", help="auto (from config.json) or llada, dream, sdar, bidir_qwen3")
    p.set_defaults(func=cmd_models)
    return parser


def _one_line(err: Any) -> str:
    """A pydantic ValidationError as ``field: message; ...``."""
    try:
        parts = [f"{'.'.join(map(str, d['loc'])) or 'parameters'}: {d['msg']}" for d in err.errors()]
    except Exception:
        return str(err).splitlines()[0]
    return "; ".join(parts)


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``miles`` console script; returns the process exit code."""
    from miles_core.config import ConfigError

    parser = build_parser()
    args = parser.parse_args(argv)
    # SIGTERM (a scheduler, `kill`) exits through Python so atexit handlers run: Prefect stops its
    # temporary server there, which a bare SIGTERM would leave orphaned.
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        return int(args.func(args) or 0)
    except (ConfigError, UsageError) as e:
        print(f"miles: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("miles: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # the flow already logged the traceback; keep the last line readable
        if type(e).__name__ == "ValidationError":  # pydantic: a flow rejected its parameters
            print(f"miles: error: {_one_line(e)}", file=sys.stderr)
            return EXIT_USAGE
        if os.environ.get("MILES_DEBUG"):
            raise
        print(f"miles: error: {args.command} failed: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_RUN_FAILED


if __name__ == "__main__":
    sys.exit(main())
