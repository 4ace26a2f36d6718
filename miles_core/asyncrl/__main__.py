"""``python -m miles_core.asyncrl sampler RUN_URI --worker w0`` / ``... learner RUN_URI``.

The process entry points of an asynchronous run: what a Prefect deployment, a Kubernetes job or
a local launcher starts. Everything else (recipe, base weights, staleness bound) comes from the
run's ``run.json`` in the store, so a worker needs only the URI. The learner runs as D
data-parallel ranks under torchrun (gloo on CPU, NCCL on GPU):

    torchrun --nnodes N --nproc-per-node G --max-restarts 3 -m miles_core.asyncrl learner RUN_URI

A rank that dies makes torchrun restart the group, which resumes from the last checkpoint
(the ledger inside it): nothing is lost or consumed twice.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m miles_core.asyncrl", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("role", choices=["sampler", "learner"])
    ap.add_argument("run_uri", help="the run's store URI (local folder, file:// or s3://)")
    ap.add_argument("--worker", default="w0", help="sampler name (unique per sampler; batch ids carry it)")
    ap.add_argument("--index", type=int, default=0, help="sampler index in [0, num_samplers)")
    ap.add_argument("--cache-dir", default=None, help="local folder for the base and adapter downloads")
    ap.add_argument("--max-updates", type=int, default=None, help="learner: stop after this many updates")
    ap.add_argument("--backend", choices=["gloo", "nccl"], default=None,
                    help="learner under torchrun: the collective backend (default: nccl with CUDA, else gloo)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    import miles_core.asyncrl.warm  # noqa: F401  (imports paid before the loop, not in its first batch)
    if args.role == "sampler":
        from miles_core.asyncrl.sampler import SamplerWorker

        out = SamplerWorker(args.run_uri, args.worker, args.index, args.cache_dir).run()
    else:
        from miles_core.asyncrl.learner import AsyncLearner
        from miles_core.parallel import close_world, init_world

        world = init_world(args.backend)  # one process without torchrun's variables
        out = AsyncLearner(args.run_uri, args.cache_dir, max_updates=args.max_updates, world=world).run()
        close_world(world)
        if not world.is_main:
            return 0
    print(json.dumps({k: v for k, v in out.items() if k != "sync_lag_seconds"}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
