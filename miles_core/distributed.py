"""Data-parallel ADPO learner on torch.distributed (gloo on CPU, NCCL on GPU), run under torchrun.

    torchrun --nproc-per-node N -m miles_core.distributed --recipe llama_tiny --base BASE_DIR \\
        --store s3://bucket/run/trajectories --out /tmp/learner [--registry s3://bucket/run/adapters]

How an update is split (``Learner.update(batch, world=World)``, the same update every learner
runs, collapse guard included; World itself lives in miles_core/parallel.py):

* Every rank reads the same stored batch and holds the same generator state (same seed), so the
  (trajectory, step) rows, their permutation into minibatches and the loss normaliser (total
  completion tokens of the whole batch) are identical everywhere. Each rank then scores a fixed,
  contiguous block of every minibatch (:meth:`World.shard`): rank-aware sampling of training
  rows that needs no communication and is reproducible.
* Gradients are summed, not averaged, over ranks: each rank's loss is already divided by the
  *global* normaliser, so the sum is exactly the single-process full-batch gradient (up to float
  summation order). Clipping and the AdamW step then run on identical gradients on every rank,
  so the replicas stay equal without broadcasting weights after the step.
* Why a manual all-reduce after accumulation instead of wrapping the model in DDP: the update
  backpropagates row chunk by row chunk; with DDP that needs ``no_sync()`` on all but the last
  chunk, and a rank whose shard of a minibatch is smaller (or empty) would run fewer backward
  passes than the others and hang DDP's collective. One flattened all-reduce of the trainable
  (LoRA) gradients per optimizer step is what DDP would do with a single bucket, works with any
  number of chunks per rank, and keeps the model a plain PeftModel (save_pretrained, disabling the
  adapter for the KL reference). LoRA gradients are small, so DDP's overlap of communication with
  backward would buy little. Like DDP at construction, the trainable parameters are broadcast
  from rank 0 once at start-up.
* Rank 0 alone logs at INFO, writes ``stats.jsonl`` and the adapter, and publishes to the registry.

FSDP (documented, not exercised here): when the frozen base does not fit one GPU, apply
``torch.distributed.fsdp.fully_shard`` (FSDP2) to each decoder layer and then the root *after*
``add_lora``, so frozen base weights and LoRA tensors are sharded together (FSDP1 would need
``use_orig_params=True`` for that mix of frozen and trainable parameters in one module). Drop
:meth:`World.sync_grads`: FSDP reduce-scatters gradients during backward, and since the loss is
already divided by the global normaliser, call ``set_gradient_divide_factor(1.0)`` so FSDP sums
instead of averaging. With chunked backward, call ``set_requires_gradient_sync(False)`` for all
but the last chunk of a minibatch, and give every rank the same number of chunks (pad a short
shard with a zero-weight row), or FSDP's collectives will not line up. Row sharding is unchanged.

Multiple sampler workers scale out as separate processes (``python -m miles_core.asyncrl sampler
... --worker wK``); they share nothing with the learner but the trajectory store.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from miles_core.config import load_recipe
from miles_core.learner.policy import Learner
from miles_core.parallel import World, close_world, init_world
from miles_core.storage import AdapterRegistry, TrajectoryStore

log = logging.getLogger("miles.distributed")


def local_base(base: str, cache_dir: str | Path, world: World) -> str:
    """A local folder holding the base checkpoint: ``base`` itself when it is local, else (e.g.
    ``s3://bucket/run/base``) a copy downloaded once per machine by local rank 0 while the
    other ranks wait at a barrier."""
    from miles_core.storage.uri import resolve

    if "://" not in base or base.startswith("file://"):
        return base[len("file://"):] if base.startswith("file://") else base
    dest = Path(cache_dir) / "base"
    if world.local_rank == 0 and not (dest / "config.json").exists():
        fs, root = resolve(base)
        if not fs.exists(f"{root}/config.json"):
            raise FileNotFoundError(f"--base {base}: no config.json there")
        part = Path(cache_dir) / f".base-{os.getpid()}"
        part.mkdir(parents=True, exist_ok=True)
        for path in fs.find(root):
            rel = path[len(root):].lstrip("/")
            (part / rel).parent.mkdir(parents=True, exist_ok=True)
            fs.get_file(path, str(part / rel))
        os.replace(part, dest)
    world.barrier()
    return str(dest)


def torchrun_command(nproc: int, recipe: str, base: str, store: str, out: str, *, overrides: list[str] | None = None,
                     registry: str | None = None, batches: list[str] | None = None, seed: int = 0,
                     threads: int = 1, python: str = "python") -> list[str]:
    """The command a learner job runs (single node, ``nproc`` ranks), e.g. from a Prefect task's
    subprocess inside an N-GPU pod. ``--standalone`` picks a free local rendezvous port."""
    cmd = [python, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node", str(nproc),
           "-m", "miles_core.distributed", "--recipe", recipe, "--base", base, "--store", store, "--out", out,
           "--seed", str(seed), "--threads", str(threads)]
    for b in batches or []:
        cmd += ["--batch", b]
    if registry:
        cmd += ["--registry", registry]
    if overrides:
        cmd += ["--set", *overrides]
    return cmd


def _setup_logging(world: World) -> None:
    """Rank 0 logs progress; the other ranks only warnings and errors."""
    logging.basicConfig(level=logging.INFO if world.is_main else logging.WARNING,
                        format=f"%(asctime)s [rank {world.rank}/{world.size}] %(name)s %(levelname)s %(message)s")


def run(args: argparse.Namespace) -> dict[str, Any] | None:
    """The torchrun entry: one ADPO update per stored batch; rank 0 writes and publishes."""
    world = init_world(args.backend)
    _setup_logging(world)
    try:
        if args.threads > 0:
            torch.set_num_threads(args.threads)
        cfg = load_recipe(args.recipe, [*(args.set or []), f"train.seed={args.seed}"])
        base = local_base(args.base, args.cache_dir or Path(args.out) / ".cache", world)
        learner = Learner(cfg, base, adapter_dir=args.adapter)
        if world.device.type != "cpu":
            learner.model.to(world.device)  # same Parameter objects: the optimizer keeps its references
        world.broadcast_(learner.params)
        store = TrajectoryStore(args.store)
        ids = args.batch or store.list_batches()
        if not ids:
            raise FileNotFoundError(f"no committed trajectory batches in {args.store}")
        out = Path(args.out)
        history = []
        for bid in ids:
            batch = store.read_batch(bid)
            world.barrier()  # time the update, not a neighbour still reading its batch
            t0, c0 = time.perf_counter(), time.process_time()
            stats = learner.update(batch, world=world)  # the collapse guard applies here too
            dt = world.max_over_ranks(time.perf_counter() - t0)
            cpu = world.sum_over_ranks(time.process_time() - c0)  # CPU seconds of all ranks together
            row = {"batch_id": bid, "update_s": dt, "update_cpu_s": cpu, "world_size": world.size, **stats}
            history.append(row)
            if world.is_main:
                log.info("batch %s: %d rows over %d ranks in %.3fs (loss %.4g)", bid, int(stats["rows"]),
                         world.size, dt, stats.get("loss", 0.0))
                out.mkdir(parents=True, exist_ok=True)
                with (out / "stats.jsonl").open("a") as f:
                    f.write(json.dumps(row) + "\n")
        summary = None
        if world.is_main:
            adapter_dir = learner.save_adapter(out / "adapter")
            summary = {"world_size": world.size, "backend": dist.get_backend() if dist.is_initialized() else "none",
                       "updates": len(history), "policy_version": learner.version, "adapter": str(adapter_dir)}
            if args.registry:
                reg = AdapterRegistry(args.registry)
                summary["published_version"] = reg.publish(adapter_dir, metadata={
                    "policy_version": learner.version, "batches": ids, "world_size": world.size})
            (out / "summary.json").write_text(json.dumps(summary, indent=1))
            log.info("done: %s", summary)
        return summary
    finally:
        close_world(world)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="torchrun --nproc-per-node N -m miles_core.distributed",
                                description="Data-parallel ADPO updates over stored trajectory batches.")
    p.add_argument("--recipe", required=True, help="recipe name or YAML path")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="recipe overrides")
    p.add_argument("--base", required=True, help="base checkpoint (tiny or Hugging Face Llama): a folder or s3:// URI")
    p.add_argument("--cache-dir", default=None, help="where a remote --base is downloaded (default: OUT/.cache)")
    p.add_argument("--adapter", default=None, help="start from this peft adapter folder (default: fresh LoRA)")
    p.add_argument("--store", required=True, help="trajectory store URI (local folder, file:// or s3://)")
    p.add_argument("--batch", action="append", default=None, help="batch id to train on (repeat; default: all)")
    p.add_argument("--out", required=True, help="rank 0 writes stats.jsonl, summary.json and adapter/ here")
    p.add_argument("--registry", default=None, help="adapter registry URI to publish the final adapter to")
    p.add_argument("--seed", type=int, default=0, help="same on every rank: rows and LoRA init derive from it")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (0: torch's default)")
    p.add_argument("--backend", choices=["gloo", "nccl"], default=None, help="default: nccl with CUDA, else gloo")
    run(p.parse_args(argv))


if __name__ == "__main__":
    main()
