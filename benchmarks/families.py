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
Run: python -m benchmarks.families [--sft-steps N]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import tempfile
import time
import traceback
from pathlib import Path

from benchmarks.harness import table, write_result

FAMILIES = ("llada", "dream", "sdar", "bidir_qwen3", "modernbert", "bidir_llama")


def one_family(family: str, sft_steps: int, out: "mp.Queue") -> None:
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
                  "task.min_ops=1", "task.max_ops=1", "task.num_val=16", "train.prompts_per_iter=4",
                  "train.group_size=4"]
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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sft-steps", type=int, default=5)
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    args = ap.parse_args(argv)
    ctx = mp.get_context("spawn")
    rows = []
    for fam in args.families:
        q = ctx.Queue()
        p = ctx.Process(target=one_family, args=(fam, args.sft_steps, q))
        p.start()
        row = q.get()
        p.join()
        rows.append(row)
        print(f"  {fam}: " + (f"load {row['load_s']:.2f}s, SFT {row['sft_s_per_step']:.2f}s/step, rollout "
                              f"{row['rollout_tokens_per_s']:.0f} tok/s, update {row['update_s']:.2f}s, "
                              f"peak {row['peak_rss_mb']:.0f} MB" if row["ok"] else f"FAILED {row['error']}"),
              flush=True)
    print(table([[r["name"], r["ok"], r.get("vocab_size", "-"), r.get("load_s", "-"), r.get("sft_s_per_step", "-"),
                  r.get("rollout_tokens_per_s", "-"), r.get("update_s", "-"), r.get("peak_rss_mb", "-")] for r in rows],
                ["family", "ok", "vocab", "load s", "SFT s/step", "rollout tok/s", "update s", "peak MB"]))
    print(f"wrote {write_result('families', {'families': rows, 'sft_steps': args.sft_steps})}")


if __name__ == "__main__":
    main()
