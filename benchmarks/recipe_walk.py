"""Where one recipe goes: the modules a synchronous run's recipe is handed through, from the flow's
load to the update engine, the times it is parsed and the copies of it stored.

One synchronous iteration of the ``tiny`` recipe (init_learner, collect, update, as the train flow
calls its tasks) runs under a profiler that records every call of a Miles function one of whose
arguments is the recipe or one of its sections (the engine's ``update``, an estimator's own
settings). The calls, in order, give the modules visited and how often the walk returns to a
module it had left; ``load_recipe`` calls count the parses; the run's files holding a whole recipe
count the stored copies. Deterministic: the same code gives the same walk on any machine.
``--smoke``: the same walk after an SFT of one step (the walk itself is already one tiny iteration).
Run: python -m benchmarks.recipe_walk [--smoke]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path

from benchmarks.harness import add_smoke, finish

OWN = ("flows", "tasks", "miles_core")
# one synchronous iteration of the tiny recipe; --smoke trains its SFT checkpoint for one step only
OVERRIDES = ["sft.steps=2", "sft.eval_every=2", "train.prompts_per_iter=2", "train.group_size=4", "sampler.steps=4",
             "task.completion_len=16", "train.iterations=1", "task.num_test=4", "task.num_val=4"]
SMOKE = ["sft.steps=1", "sft.eval_every=1"]


def _sections(cfg) -> dict[int, str]:
    """id -> name of the recipe and of every section object it holds (each estimator's settings too)."""
    ids = {id(cfg): "recipe"}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            ids[id(v)] = f.name
        elif isinstance(v, dict):  # the estimators' settings, each a section of its own
            ids[id(v)] = f.name
            ids.update({id(x): f"{f.name}.{k}" for k, x in v.items() if dataclasses.is_dataclass(x)})
    return ids


def walk(work: Path, smoke: bool = False) -> dict:
    """The walk (module docstring); every ``load_recipe`` binding and the profiler put back after."""
    import torch

    from miles_core.config import load_recipe
    import miles_core.config as config_package
    from miles_core.data.registry import build_task
    from miles_core.learner.baseline import train_baseline
    from tasks import training

    torch.set_num_threads(1)
    over = OVERRIDES + (SMOKE if smoke else [])
    cfg = load_recipe("tiny", over)
    train_baseline(cfg, build_task(cfg), work / "sft")
    parses = [0]
    real_load = config_package.load_recipe
    calls: list[tuple[str, str, list[str]]] = []
    watched: dict[int, str] = {}

    def counted(*a, **k):  # every parse counted, and what it returns watched from then on
        parses[0] += 1
        out = real_load(*a, **k)
        watched.update(_sections(out))
        return out

    def prof(frame, event, _arg):
        if event != "call":
            return
        mod = frame.f_globals.get("__name__", "")
        if not mod.startswith(OWN) or mod.startswith("miles_core.config"):
            return
        code = frame.f_code
        args = [frame.f_locals.get(n) for n in code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]]
        got = [watched[id(a)] for a in args if a is not None and id(a) in watched]
        if got:
            calls.append((mod, code.co_name, got))

    patched = [m for m in list(sys.modules.values())  # every module that bound load_recipe by name counts its calls
               if getattr(m, "load_recipe", None) is real_load and getattr(m, "__name__", "").startswith(OWN + ("miles",))]
    for m in patched:
        m.load_recipe = counted
    try:
        flow_cfg = counted("tiny", over)   # the flow's own load (flows/train.py)
        run_dir, store = work / "run", str(work / "run" / "store")
        sys.setprofile(prof)
        try:
            with training.learner(run_dir) as lr:
                training.init_learner.fn(lr, flow_cfg, str(work / "sft"), store)
                co = training.collect.fn(lr, 0)
                training.update.fn(lr, co["batch_id"])
        finally:
            sys.setprofile(None)
    finally:  # the real load_recipe back everywhere: a later walk (or test) in this process sees no wrapper
        for m in patched:
            m.load_recipe = real_load
    seq = [c[0] for i, c in enumerate(calls) if i == 0 or calls[i - 1][0] != c[0]]
    returns = sum(1 for i, m in enumerate(seq) if m in seq[:i])
    stored = sorted(str(p.relative_to(work / "run")) for p in (work / "run").rglob("*.json")
                    if '"train"' in p.read_text(errors="ignore") and '"sampler"' in p.read_text(errors="ignore"))
    return {"modules": sorted(set(seq)), "module_visits": seq, "returns_to_a_module_left": returns,
            "calls": [f"{m}.{f}({', '.join(got)})" for m, f, got in calls], "parses": parses[0], "stored_copies": stored,
            "module_count": len(set(seq)), "call_count": len(calls)}


def main(argv: list[str] | None = None) -> None:
    ap = add_smoke(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    ap.add_argument("--out", default=None, metavar="FILE", help="the result JSON (default: benchmarks/results/NAME.json)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        r = {**walk(Path(tmp), args.smoke), "smoke": args.smoke}
    rows = [["modules the recipe is handed through", len(r["modules"])],
            ["returns to a module already left", r["returns_to_a_module_left"]],
            ["recipe parses (load_recipe), flow's own included", r["parses"]],
            ["stored copies of the whole recipe", f"{len(r['stored_copies'])} ({', '.join(r['stored_copies'])})"]]
    for c in r["calls"]:
        print(" ->", c)
    # the walk must have seen the recipe handed on (calls, modules) and parsed (the flow's own load at least)
    finish("recipe_walk", r, rows, ["measure", "value"], args.out,
           positive=["module_count", "call_count", "parses"],
           present=["returns_to_a_module_left", "stored_copies", "module_visits"])


if __name__ == "__main__":
    main()
