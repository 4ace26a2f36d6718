"""One ADPO update as the number of denoising steps K and the step merge s vary, against backprop
through the chain, side by side in one run: tokens/s and peak memory.

The model is the rollout benchmark's bidirectional Qwen3 (~41M parameters, vocab 151,936) with a
LoRA adapter (r 16); ``--batch`` trajectories of ``--completion`` tokens, each committed over K
steps (K/L tokens per step, a random order, as a static schedule records them). Trajectories are
synthetic because an update's cost depends only on their shapes: step_map, behaviour log-probs and
advantages are drawn, then one update runs through the production engine (algo/update.py).

* ``adpo`` (Miles): every (trajectory, step) row scored and backpropagated in chunks of
  ``--chunk-tokens`` positions (``update.chunk_tokens``), logits at committed positions only;
  ``s`` > 1 scores s consecutive steps as one state (``estimators.adpo.step_merge``, TraceRL).
* ``chain``: the same rows in one chunk, so every step's graph is alive at the one backward, the
  memory profile of backpropagating through the denoising chain.
* ``adpo+ckpt``: ``adpo`` with ``update.grad_checkpointing`` (models/activations.py): each layer is
  recomputed in backward, so a chunk keeps only the layers' inputs; memory for compute.

Each configuration runs in a fresh process. Peak memory is measured twice: the peak bytes autograd
holds for backward (miles_core/memory.py's SavedTensorMeter: deterministic, the activation memory
the methods differ in), and the growth of the peak resident set over the resident set just before
the update (Linux: the peak is reset through /proc/self/clear_refs after the model is loaded and
one small update has warmed up; allocator caching makes it noisier).
``--smoke``: adpo at s = 1 and adpo+ckpt, K = 4 (not chain, adpo's code with one chunk, nor s > 1:
a fresh process costs seconds of imports), on a 2-layer model of hidden 32, one trajectory of 16
tokens: still one fresh process per configuration.
Run: python -m benchmarks.update [--ks 8 32 128 256] [--merges 1 4 16] [--ckpt-ks 8 32] [--batch 2] [--completion 256]
[--smoke]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

from benchmarks.harness import SPEED_SIZE, add_smoke, synthetic_batch, table, write_result

# --smoke: adpo (s = 1) and adpo+ckpt at one K, a tiny model and one short trajectory
SMOKE = {"ks": [4], "merges": [1], "chain_ks": [], "ckpt_ks": [4], "batch": 1, "prompt_len": 8, "completion": 16,
         "chunk_tokens": 64}
SMOKE_SIZE = {**SPEED_SIZE, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "head_dim": 8}


def run_one(job: tuple) -> dict:
    """One update in this (fresh) process: seconds and peak-memory growth."""
    folder, arm, k, s, args = job
    torch.set_num_threads(args["threads"])
    from miles_core.memory import SavedTensorMeter
    from miles_core.algo.update import update_policy
    from miles_core.config import AdpoSettings, UpdateConfig
    from miles_core.models.activations import checkpoint_layers
    from miles_core.models.base import load_checkpoint
    from miles_core.models.lora import add_lora

    base, tok = load_checkpoint(folder)
    for p in base.parameters():
        p.requires_grad_(False)
    torch.manual_seed(0)
    model = add_lora(base, r=16, alpha=32)
    if arm == "adpo+ckpt":
        checkpoint_layers(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    batch = synthetic_batch(tok, args["batch"], args["prompt_len"], args["completion"], k, seed=k)
    rows = args["batch"] * -(-k // s)
    chunk = 10**12 if arm == "chain" else args["chunk_tokens"]       # chain: every row in one backward
    cfg = UpdateConfig(estimator="adpo", chunk_tokens=chunk, num_minibatches=1, epochs=1, skip_zero_variance=False)
    own = AdpoSettings(step_fraction=1.0, step_merge=s)
    warm = synthetic_batch(tok, 1, args["prompt_len"], args["completion"], 2, seed=99)
    warm.advantage = torch.ones(1)
    update_policy(model, opt, warm, cfg, tok, 1.0, torch.Generator().manual_seed(0), own=own)   # allocator and kernels warm
    meter = SavedTensorMeter(list(model.parameters()))
    out: dict = {}
    before = reset_peak_rss()
    t0 = time.perf_counter()
    saved = meter.measure(lambda: out.update(update_policy(model, opt, batch, cfg, tok, 1.0,
                                                           torch.Generator().manual_seed(0), own=own)))
    sec = time.perf_counter() - t0
    peak = status_kb("VmHWM")
    tokens = args["batch"] * args["completion"]
    return {"arm": arm, "K": k, "s": s, "rows": rows, "seconds": sec, "tokens_per_s": tokens / sec,
            "saved_mb": saved / 2**20, "peak_rss_mb": (peak - before) / 1024, "loss": out.get("loss", 0.0)}


def status_kb(field: str) -> int:
    """A ``/proc/self/status`` memory field in KiB (VmRSS: resident now, VmHWM: its peak)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak_rss() -> int:
    """Reset the peak resident set to the current one (Linux: ``5 > /proc/self/clear_refs``) and
    return it, so the peak read after the update is the update's own."""
    Path("/proc/self/clear_refs").write_text("5")
    return status_kb("VmRSS")


def main(argv: list[str] | None = None) -> None:
    ap = add_smoke(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    ap.add_argument("--ks", type=int, nargs="+", default=[8, 32, 128, 256])
    ap.add_argument("--merges", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--chain-ks", type=int, nargs="+", default=[8, 32, 128],
                    help="K values for backprop through the chain (its memory grows with K)")
    ap.add_argument("--ckpt-ks", type=int, nargs="+", default=[8, 32],
                    help="K values of the adpo arm with gradient checkpointing (s = 1)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--completion", type=int, default=256)
    ap.add_argument("--chunk-tokens", type=int, default=4096, help="update.chunk_tokens of the Miles arm")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, metavar="FILE", help="the result JSON (default: benchmarks/results/NAME.json)")
    args = ap.parse_args(argv)
    if args.smoke:
        vars(args).update(SMOKE)
    from miles_core.models.hf import init_tiny

    t_all = time.perf_counter()
    results = []
    # glibc maps every allocation of 64 KiB or more on its own and unmaps it when freed, so the
    # resident set follows the live tensors instead of what the allocator keeps cached; the workers
    # inherit it (a value already set wins), put back after so a run inside a test leaves no trace
    malloc = {"MALLOC_MMAP_THRESHOLD_": os.environ.get("MALLOC_MMAP_THRESHOLD_", "65536")}
    with tempfile.TemporaryDirectory(prefix="miles-update-") as d, mock.patch.dict(os.environ, malloc):
        folder = str(init_tiny("bidir_qwen3", Path(d) / "m", seed=0, size=SMOKE_SIZE if args.smoke else SPEED_SIZE))
        jobs = [(folder, "adpo", k, s, vars(args)) for s in args.merges for k in args.ks if s <= k]
        jobs += [(folder, "adpo+ckpt", k, 1, vars(args)) for k in args.ckpt_ks]
        jobs += [(folder, "chain", k, 1, vars(args)) for k in args.chain_ks]
        ctx = mp.get_context("spawn")
        for job in jobs:  # one at a time: each owns the CPUs and its own peak memory
            with ctx.Pool(1) as pool:
                r = pool.apply(run_one, (job,))
            results.append(r)
            print(f"  {r['arm']:9s} K={r['K']:3d} s={r['s']:2d}: {r['tokens_per_s']:.1f} tokens/s, "
                  f"saved for backward {r['saved_mb']:.0f} MB, peak RSS +{r['peak_rss_mb']:.0f} MB, {r['rows']} rows in {r['seconds']:.1f}s", flush=True)
    print(table([[r["arm"], r["K"], r["s"], r["rows"], r["tokens_per_s"], r["saved_mb"], r["peak_rss_mb"]]
                 for r in results], ["arm", "K", "s", "rows", "tokens/s", "saved MB", "peak RSS MB"]))
    adpo1 = [r for r in results if r["arm"] == "adpo" and r["s"] == 1]
    flat = max(r["saved_mb"] for r in adpo1) / max(min(r["saved_mb"] for r in adpo1), 1e-9) if adpo1 else float("nan")
    payload = {"results": results, "settings": vars(args), "adpo_s1_peak_ratio_max_over_min": flat,
               "seconds": time.perf_counter() - t_all, "smoke": args.smoke}
    print(f"ADPO (s=1) peak saved-for-backward memory, largest over smallest across K: {flat:.2f}x")
    for r in results:
        plain = next((a for a in adpo1 if a["K"] == r["K"]), None)
        if r["arm"] == "adpo+ckpt" and plain:
            r["vs_adpo"] = {"saved": r["saved_mb"] / plain["saved_mb"], "tokens_per_s": r["tokens_per_s"] / plain["tokens_per_s"]}
            print(f"gradient checkpointing at K={r['K']}: saved-for-backward {r['vs_adpo']['saved']:.2f}x, "
                  f"tokens/s {r['vs_adpo']['tokens_per_s']:.2f}x of plain ADPO")
    # every configuration must have updated: its rows, time and memory saved for backward (a list: checked keyed)
    path = write_result("update", payload, args.out, positive=["adpo_s1_peak_ratio_max_over_min", "seconds", "results.*.rows",
                                                            "results.*.seconds", "results.*.tokens_per_s", "results.*.saved_mb"],
                        present=["results", "settings"])
    print(f"wrote {path} in {payload['seconds']:.0f}s")


if __name__ == "__main__":
    main()
