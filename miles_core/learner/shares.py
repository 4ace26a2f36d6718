"""A global batch read in shares: each learner rank reads only its own sampler batches.

Why: an update consumes ``async_rl.global_batch`` completions (B sampler batches). With D ranks,
rank r reads batches j = r, r + D, ... of the B (``my_share``), never the whole global batch, so
what each rank reads from the store falls as D grows. The update must still be the one a single
process reading all B would make (to float summation order): the estimator draws its rows, the
minibatch permutation and the loss normaliser from the *whole* batch. So the ranks exchange what
those draws depend on (per row: prompt length, ``step_map``, group, version, reward, advantage,
NFE, the completion text the collapse guard reads; a few hundred KB per update at LLaDA-8B
shape, against the LoRA gradients' all-reduce) and each builds the same global batch, its own
batches real and the others' as skeletons (:func:`skeleton`: zero token ids and log-probs, never
scored). The update engine then scores only the rows of trajectories this rank holds
(``owned``) and sums the gradients over ranks (algo/update.py::policy_update).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from miles_core.parallel import World
from miles_core.types import TrajectoryBatch

Verdict = tuple[str, Any]  # ("fresh", behaviour version) | ("dropped", staleness) | ("quarantined", reason)


def my_share(bids: list[str], world: World) -> list[int]:
    """Positions in ``bids`` this rank reads: j with j % D == rank (round robin keeps the shares
    within one batch of each other)."""
    return [j for j in range(len(bids)) if j % world.size == world.rank]


def row_meta(batch: TrajectoryBatch) -> dict[str, Any]:
    """What every rank needs of a batch it does not hold: what the rows, the minibatches, the
    normaliser and the collapse guard are drawn from, without the token ids and log-probs."""
    return {"prompt_lens": [len(p) for p in batch.prompt_ids], "step_map": batch.step_map, "nfe": batch.nfe,
            "group_id": batch.group_id, "policy_version": batch.policy_version, "reward": batch.reward,
            "advantage": batch.advantage, "completions": list(batch.completions),
            "sampler_hash": batch.sampler_hash, "created_at": batch.created_at}


def skeleton(meta: dict[str, Any]) -> TrajectoryBatch:
    """A batch another rank holds, as this rank sees it: its rows' shapes, steps and advantages,
    zeros where the tokens and log-probs would be (this rank never scores its rows)."""
    step_map: Tensor = meta["step_map"]
    b = step_map.shape[0]
    return TrajectoryBatch(prompt_ids=[[0] * n for n in meta["prompt_lens"]], completion_ids=torch.zeros_like(step_map),
                           step_map=step_map, logp=torch.zeros(step_map.shape), nfe=meta["nfe"],
                           group_id=meta["group_id"], policy_version=meta["policy_version"], reward=meta["reward"],
                           advantage=meta["advantage"], prompts=[""] * b, completions=meta["completions"],
                           meta=[{} for _ in range(b)], sampler_hash=meta["sampler_hash"], created_at=meta["created_at"])


def agree(n: int, mine: dict[int, tuple[Verdict, TrajectoryBatch | None]],
          world: World) -> list[tuple[Verdict, TrajectoryBatch | None, bool]]:
    """Every rank's verdict on its share, gathered: for each of the ``n`` batches in order,
    (verdict, batch, held here). A fresh batch another rank holds comes back as its skeleton."""
    local = {j: (v, row_meta(b) if v[0] == "fresh" and b is not None else None) for j, (v, b) in mine.items()}
    gathered: list[Any] = [None] * world.size
    if world.size > 1:
        dist.all_gather_object(gathered, local)
    else:
        gathered = [local]
    out: list[tuple[Verdict, TrajectoryBatch | None, bool]] = []
    for j in range(n):
        held = j in mine
        part = next(g[j] for g in gathered if j in g)
        verdict, meta = part
        batch = mine[j][1] if held else (skeleton(meta) if meta is not None else None)
        out.append((verdict, batch, held))
    return out
