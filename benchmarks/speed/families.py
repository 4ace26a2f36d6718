"""Each model family's tiny checkpoint through the whole training path: load, SFT, rollout, update.

For every family, in a fresh process of its own (so peak memory is that family's): write its tiny
random-init checkpoint in the published layout (``python -m miles_core.models init``; bidir_llama:
models/llama.py's toy Llama), then time

* ``load_s``: ``load_checkpoint`` of the published folder (tensor mapping, tokenizer);
* ``sft_s_per_step``: SFT steps on the tiny recipe's arithmetic demonstrations;
* ``rollout_tokens_per_s``: completion positions sampled per second by the learner's rollout;
* ``update_s``: one ADPO update with LoRA on that batch;
* ``peak_rss_mb``: the process's peak resident memory.

These are tiny models with their families' full vocabularies (126k-152k rows), so the figures
measure the code path and the vocabulary's cost, not a real checkpoint's speed.
``--smoke`` (CI): every family through the same steps, with one SFT step and a first batch of 2
prompts x 2 completions, all in one fresh process (imports paid once: six would cost ~30 s of
importing torch and transformers alone, and smoke peak memory is no figure); a family that fails
then fails the run.
Run: python -m benchmarks.families [--sft-steps N] [--smoke]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import tempfile
import time
import traceback
from pathlib import Path

from benchmarks.harness import add_smoke, table, write_result

FAMILIES = ("llada", "dream", "sdar", "bidir_qwen3", "modernbert", "bidir_llama")
BATCH = {"prompts": 4, "group": 4}          # the first RL batch: prompts x completions each
SMOKE = {"sft_steps": 1, "prompts": 2, "group": 2}


def one_family(family: str, sft_steps: int, out: "mp.Queue", prompts: int = BATCH["prompts"],
               group: int = BATCH["group"]) -> None:
    try:
        import torch

        torch.set_num_threads(1)
        from miles_core.config import load_recipe
        from miles_core.models.base import load_checkpoint, save_checkpoint
        from miles_core.data.registry import build_task
        from miles_core.learner.baseline import train_baseline
        from miles_core.learner.policy import Learner

        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / "published"
            if family == "bidir_llama":
                from miles_core.models.llama import init_checkpoint

                init_checkpoint(src)
            else:
                from miles_core.models.hf import init_tiny

                init_tiny(family, src)
            t0 = time.perf_counter()
            load_checkpoint(src)
            load_s = time.perf_counter() - t0
            ov = ["model.backend=hf" if family != "bidir_llama" else "model.backend=llama", f"model.path={src}",
                  f"model.family={family}", f"sft.steps={sft_steps}", "sft.batch_size=8", "task.completion_len=8",
                  "task.min_ops=1", "task.max_ops=1", "task.num_val=16", f"train.prompts_per_iter={prompts}",
                  f"train.group_size={group}"]
            cfg = load_recipe("tiny", ov)
            data = build_task(cfg)
            t0 = time.perf_counter()
            model, tok = train_baseline(cfg, data, Path(tmp) / "sft")
            sft_s = (time.perf_counter() - t0) / sft_steps
            save_checkpoint(model, tok, Path(tmp) / "sft")
            learner = Learner(cfg, Path(tmp) / "sft")
            t0 = time.perf_counter()
            batch = learner.sample(data, 0)  # sampled, scored, advantages: what a run's first batch costs
            roll_s = time.perf_counter() - t0
            batch.advantage = torch.randn(len(batch))  # a signal in every row, so the update has work
            t0 = time.perf_counter()
            stats = learner.update(batch)
            upd_s = time.perf_counter() - t0
        out.put({"name": family, "ok": True, "load_s": load_s, "sft_s_per_step": sft_s,
                 "rollout_tokens_per_s": len(batch) * cfg.task.completion_len / roll_s, "update_s": upd_s,
                 "update_rows": stats.get("rows"), "vocab_size": tok.vocab_size,
                 "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024})
    except Exception as e:  # noqa: BLE001 - a failing family is a row with ok=false and the reason
        out.put({"name": family, "ok": False, "error": f"{type(e).__name__}: {e}",
                 "traceback": traceback.format_exc()[-2000:]})


def run_families(families: list[str], sft_steps: int, out: "mp.Queue", prompts: int, group: int) -> None:
    """:func:`one_family` for each of ``families`` in turn, in this (fresh) process."""
    for family in families:
        one_family(family, sft_steps, out, prompts, group)


def rows_from(p: "mp.process.BaseProcess", q: "mp.Queue", n: int) -> list[dict]:
    """``n`` rows from ``p``'s queue; a process that died without sending them (killed, crashed in C)
    raises instead of waiting forever."""
    import queue

    rows: list[dict] = []
    while len(rows) < n:
        try:
            rows.append(q.get(timeout=5))
        except queue.Empty:
            if not p.is_alive():
                raise RuntimeError(f"benchmarks.families: the process exited ({p.exitcode}) after {len(rows)} of {n} "
                                   "families") from None
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = add_smoke(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    ap.add_argument("--sft-steps", type=int, default=5)
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    ap.add_argument("--out", default=None, metavar="FILE", help="the result JSON (default: benchmarks/results/families.json)")
    args = ap.parse_args(argv)
    batch = dict(BATCH)
    if args.smoke:
        args.sft_steps, batch = SMOKE["sft_steps"], {k: SMOKE[k] for k in BATCH}
    ctx = mp.get_context("spawn")
    rows: list[dict] = []
    for fams in [args.families] if args.smoke else [[f] for f in args.families]:  # full size: a process each
        q = ctx.Queue()
        p = ctx.Process(target=run_families, args=(fams, args.sft_steps, q, batch["prompts"], batch["group"]))
        p.start()
        got = rows_from(p, q, len(fams))
        p.join()
        rows += got
        for row in got:
            print(f"  {row['name']}: " + (f"load {row['load_s']:.2f}s, SFT {row['sft_s_per_step']:.2f}s/step, rollout "
                                          f"{row['rollout_tokens_per_s']:.0f} tok/s, update {row['update_s']:.2f}s, "
                                          f"peak {row['peak_rss_mb']:.0f} MB" if row["ok"] else f"FAILED {row['error']}"),
                  flush=True)
    print(table([[r["name"], r["ok"], r.get("vocab_size", "-"), r.get("load_s", "-"), r.get("sft_s_per_step", "-"),
                  r.get("rollout_tokens_per_s", "-"), r.get("update_s", "-"), r.get("peak_rss_mb", "-")] for r in rows],
                ["family", "ok", "vocab", "load s", "SFT s/step", "rollout tok/s", "update s", "peak MB"]))
    # the figures of each family that ran: no family measured fails the run, and so, in --smoke, does any
    # requested family that failed (full size records a failing family as its row, ok=false)
    measured = {r["name"]: {k: r[k] for k in ("load_s", "sft_s_per_step", "rollout_tokens_per_s", "update_s",
                                              "peak_rss_mb")} for r in rows if r["ok"]}
    payload = {"families": rows, "sft_steps": args.sft_steps, "batch": batch, "measured": measured,
               "families_measured": len(measured), "smoke": args.smoke}
    every = [f"measured.{f}" for f in args.families] if args.smoke else []
    path = write_result("families", payload, args.out, present=every,
                        positive=["families_measured", "measured.*.load_s", "measured.*.sft_s_per_step",
                                  "measured.*.rollout_tokens_per_s", "measured.*.update_s", "measured.*.peak_rss_mb"])
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
