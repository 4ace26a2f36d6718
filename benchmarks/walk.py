"""What a reader follows through one iteration of ``miles train arith``, traced from a real run:
the modules entered and the returns to a module already left, for collect + update; and where
the recipe goes (the modules it is handed to, its parses, its stored copies).

A reader of CleanRL's ``ppo.py`` reads the update top-down in one file. Here the reader's path is
measured on the code that runs, not guessed from imports: one synchronous iteration (the train
flow's ``collect`` and ``update`` tasks, in process, as ``flows/train.py`` calls them) runs under
``sys.setprofile``. Every call of a function of Miles' own (``flows``, ``tasks``, ``miles_core``;
a call from torch back into a Miles ``forward`` counts, torch itself is not followed) becomes a
node of the call tree. A reader reads each function once, where it is first called, so the tree
keeps each function's first call and drops repeats (a loop's second pass, a helper called again;
a new function called through a repeat is read, as if from the function the reader is in).
The reader's path is the depth-first walk of that tree, as modules: into a callee's module, back
to the caller's when it returns. **Modules entered**: how many modules that path touches.
**Returns**: how often it comes back to a module it had already left (consecutive stays count
once). Deterministic: the same code gives the same walk on any machine.

The iteration traced is the run's second (the first builds lazily what every later one reuses;
``--iteration 0`` traces the first). The recipe's path (formerly ``benchmarks.recipe_walk``) is
taken in the same run: every Miles call one of whose arguments is the recipe or one of its
sections, from the flow's load through ``init_learner`` and the traced iteration.

The traced update must learn from some rows (its batch's rewards differ within a group): an
update on none returns before the engine, and the run fails rather than count a path without it.

Run: python -m benchmarks.walk [--smoke] [--iteration N]   (about 2 minutes, most of it the SFT
base; ``--smoke``: a one-step SFT whose tied rewards' rows the update takes anyway, in seconds)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator

from benchmarks.harness import MeasuredNothing, add_smoke, finish

OWN = ("flows", "tasks", "miles_core")
# a small arith iteration on the recipe's code path, from an SFT base trained far enough that the
# batch's rewards differ within groups, so the traced update learns (an update on no rows returns
# before the engine: the walk would leave out the very path it exists to count)
OVERRIDES = ["sft.steps=600", "sft.eval_every=600", "train.prompts_per_iter=8", "train.group_size=8",
             "train.iterations=2", "task.num_test=4", "task.num_val=4", "torch_threads=1"]
# --smoke: a one-step SFT and a smaller batch, whose rewards all tie: its update takes every row
# anyway (advantage 0), so the smoke still goes through the engine and is checked like a full run
SMOKE = ["sft.steps=1", "sft.eval_every=1", "train.prompts_per_iter=2", "train.group_size=4",
         "update.skip_zero_variance=false"]


class ReaderTrace:
    """The call tree of Miles functions under ``sys.setprofile``, each function kept at its first
    call (module docstring), and the calls that receive a watched object (the recipe's sections)."""

    def __init__(self, watched: dict[int, str]) -> None:
        self.watched = watched
        self.seen: set[tuple[str, str, int]] = set()      # functions already read: (module, name, first line)
        self.stack: list[tuple[Any, bool]] = []            # open Miles frames: (frame, first call of its function)
        self.path: list[str] = []                          # the reader's modules, in order
        self.recipe_calls: list[tuple[str, str, list[str]]] = []
        self.phases: list[tuple[str, int]] = []            # (phase, where its path starts)

    def _move(self, module: str) -> None:
        if not self.path or self.path[-1] != module:
            self.path.append(module)

    def profile(self, frame: Any, event: str, _arg: Any) -> None:
        if event not in ("call", "return"):
            return
        module = frame.f_globals.get("__name__", "")
        if not module.startswith(OWN):
            return
        if event == "return":
            if self.stack and self.stack[-1][0] is frame:
                _, first = self.stack.pop()
                # back in the nearest open function the reader is reading (a repeat between is a call
                # the reader knows already: it reads through it)
                reading = next((f for f, fst in reversed(self.stack) if fst), None)
                if first and reading is not None:
                    self._move(reading.f_globals.get("__name__", ""))
            return
        code = frame.f_code
        key = (module, code.co_name, code.co_firstlineno)
        first = key not in self.seen
        self.seen.add(key)
        self.stack.append((frame, first))
        if first:
            self._move(module)
        names = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
        got = [self.watched[id(v)] for v in (frame.f_locals.get(n) for n in names)
               if v is not None and id(v) in self.watched]
        if got and not module.startswith("miles_core.config"):
            self.recipe_calls.append((module, code.co_name, got))

    def mark(self, phase: str) -> None:
        """Phase ``phase`` starts here (the reader's path is counted per phase and as a whole)."""
        self.phases.append((phase, len(self.path)))

    def summary(self) -> dict[str, Any]:
        returns = _returns(self.path)
        bounds = [*self.phases, ("", len(self.path))]
        per_phase = {name: {"modules": len(set(self.path[a:b])), "returns": _returns(self.path[a:b])}
                     for (name, a), (_, b) in zip(bounds, bounds[1:])}
        recipe_modules = sorted({c[0] for c in self.recipe_calls})
        return {"modules": sorted(set(self.path)), "module_count": len(set(self.path)), "path": self.path,
                "phases": per_phase,
                "returns_to_a_module_left": returns, "functions_read": len(self.seen),
                "recipe_modules": recipe_modules, "recipe_module_count": len(recipe_modules),
                "recipe_calls": [f"{m}.{f}({', '.join(got)})" for m, f, got in self.recipe_calls]}


def _returns(path: list[str]) -> int:
    """How often ``path`` comes back to a module it had left (consecutive stays are one)."""
    return sum(1 for i, m in enumerate(path) if m in path[:i])


def _sections(cfg: Any) -> dict[int, str]:
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


def walk(work: Path, smoke: bool = False, iteration: int = 1) -> dict[str, Any]:
    """Train the SFT base, start the run as the flow does, then trace iteration ``iteration``'s
    collect + update (the iterations before it run untraced). ``load_recipe`` is counted wherever
    a module bound it, and put back after."""
    import miles_core.config as config_package
    from miles_core.data.registry import build_task
    from miles_core.learner.baseline import train_baseline
    from tasks import training

    over = OVERRIDES + (SMOKE if smoke else [])
    real_load = config_package.load_recipe
    cfg = real_load("arith", over)
    train_baseline(cfg, build_task(cfg), work / "sft")
    parses, watched = [0], {}

    def counted(*a: Any, **k: Any) -> Any:  # every parse counted, and what it returns watched from then on
        parses[0] += 1
        out = real_load(*a, **k)
        watched.update(_sections(out))
        return out

    patched = [m for m in list(sys.modules.values())
               if getattr(m, "load_recipe", None) is real_load and getattr(m, "__name__", "").startswith(OWN + ("miles",))]
    for m in patched:
        m.load_recipe = counted
    trace, init = ReaderTrace(watched), ReaderTrace(watched)  # init: where init_learner hands the recipe
    try:
        flow_cfg = counted("arith", over)  # the flow's own load (flows/train.py)
        run_dir = work / "run"
        with training.learner(run_dir) as lr:
            with _profiled(init):
                training.init_learner.fn(lr, flow_cfg, str(work / "sft"), str(run_dir / "store"))
            for it in range(iteration):
                co = training.collect.fn(lr, it)
                training.update.fn(lr, co["batch_id"], local_copy=False)
            with _profiled(trace):
                trace.mark("collect")
                co = training.collect.fn(lr, iteration)
                trace.mark("update")
                up = training.update.fn(lr, co["batch_id"], local_copy=False)
    finally:
        for m in patched:
            m.load_recipe = real_load
    trace.recipe_calls[:0] = init.recipe_calls
    stored = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*.json")
                    if '"train"' in p.read_text(errors="ignore") and '"sampler"' in p.read_text(errors="ignore"))
    if not up["stats"].get("rows"):
        raise MeasuredNothing(f"benchmarks.walk: the traced update learned from no rows ({up['stats']}): "
                              "its batch carried no reward spread")
    return {**trace.summary(), "parses": parses[0], "stored_copies": stored, "iteration": iteration,
            "update_rows": up["stats"]["rows"]}


@contextlib.contextmanager
def _profiled(trace: ReaderTrace) -> Iterator[None]:
    sys.setprofile(trace.profile)
    try:
        yield
    finally:
        sys.setprofile(None)


# The counting rule on three modules, by hand: top (a) calls g (b), which calls k (c); then k and g
# again (read already: nothing new), then a helper of a's own. The reader goes a -> b -> c, back to
# b, back to a: 3 modules, 2 returns (b and a were left before).
_CHECK = {"a": "def top():\n    b.g(); c.k(); b.g(); helper()\ndef helper():\n    pass\n",
          "b": "def g():\n    c.k()\n", "c": "def k():\n    pass\n"}


def check_counting_rule() -> None:
    """Trace :data:`_CHECK` and compare with the path worked out by hand (a failed check fails the run)."""
    import types

    mods = {k: types.ModuleType(f"miles_core._walk_check_{k}") for k in _CHECK}
    for k, src in _CHECK.items():
        mods[k].__dict__.update(a=mods["a"], b=mods["b"], c=mods["c"])
        exec(compile(src, f"<walk check {k}>", "exec"), mods[k].__dict__)
    trace = ReaderTrace({})
    with _profiled(trace):
        mods["a"].top()
    got = [m.rsplit("_", 1)[-1] for m in trace.path]
    if got != ["a", "b", "c", "b", "a"] or _returns(trace.path) != 2 or len(trace.seen) != 4:
        raise AssertionError(f"benchmarks.walk: the counting rule gives {got}, {_returns(trace.path)} returns, "
                             f"{len(trace.seen)} functions; by hand a b c b a, 2 returns, 4 functions")


def main(argv: list[str] | None = None) -> None:
    ap = add_smoke(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    ap.add_argument("--iteration", type=int, default=1, help="which iteration to trace (0: the first)")
    ap.add_argument("--out", default=None, metavar="FILE", help="the result JSON (default: benchmarks/results/NAME.json)")
    args = ap.parse_args(argv)
    check_counting_rule()
    with tempfile.TemporaryDirectory() as tmp:
        r = {**walk(Path(tmp), args.smoke, args.iteration), "smoke": args.smoke}
    print("the reader's path:", " -> ".join(m.split(".", 1)[-1] for m in r["path"]))
    ph = r["phases"]
    rows = [["modules entered: collect + update (collect / update alone)",
             f"{r['module_count']} ({ph['collect']['modules']} / {ph['update']['modules']})"],
            ["returns to a module already left (collect / update)",
             f"{r['returns_to_a_module_left']} ({ph['collect']['returns']} / {ph['update']['returns']})"],
            ["functions read", r["functions_read"]],
            ["rows the traced update learned from", f"{r['update_rows']:.0f}"],
            ["modules the recipe or a section is handed to", r["recipe_module_count"]],
            ["recipe parses (load_recipe), the flow's own included", r["parses"]],
            ["stored copies of the whole recipe", f"{len(r['stored_copies'])} ({', '.join(r['stored_copies'])})"]]
    finish("walk", r, rows, ["one iteration of miles train arith", "count"], args.out,
           positive=["module_count", "functions_read", "parses"], present=["returns_to_a_module_left", "path"])


if __name__ == "__main__":
    main()
