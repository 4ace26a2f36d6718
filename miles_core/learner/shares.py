"""A global batch read in shares: each learner rank reads only its own sampler batches.

Why: an update consumes ``async_rl.global_batch`` completions (B sampler batches of n rows). With
D ranks, rank r owns the r-th of D equal blocks of the B x n rows (:func:`owned_rows`) and reads
the sampler batches its block touches (:func:`my_share`): about B / D + 1 of them, never the whole
global batch when B > 2, so what each rank reads falls as D grows and the compute splits evenly
even when B < D. The update must still be the one a single
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


def owned_rows(j: int, n: int, batches: int, world: World) -> Tensor:
    """[n] bool: the rows of sampler batch ``j`` this rank owns: row i of batch j is global row
    j n + i, and rank r owns rows [r B n / D, (r + 1) B n / D)."""
    g = torch.arange(j * n, (j + 1) * n)
    return g * world.size // (batches * n) == world.rank


def my_share(batches: int, n: int, world: World) -> list[int]:
    """The sampler batches (positions 0..batches-1) this rank reads: those holding a row it owns."""
    return [j for j in range(batches) if bool(owned_rows(j, n, batches, world).any())]


def first_reader(j: int, n: int, batches: int, world: World) -> bool:
    """Whether this rank is the lowest one reading batch ``j`` (it alone quarantines a corrupt one)."""
    return all(not owned_rows(j, n, batches, World(r, world.size)).any() for r in range(world.rank))


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
    if world.size == 1:  # one process holds every batch: nothing to exchange
        return [(v, b, True) for _, (v, b) in sorted(mine.items())]
    local = {j: (v, row_meta(b) if v[0] == "fresh" and b is not None else None) for j, (v, b) in mine.items()}
    gathered: list[Any] = [None] * world.size
    dist.all_gather_object(gathered, local)
    out: list[tuple[Verdict, TrajectoryBatch | None, bool]] = []
    for j in range(n):
        held = j in mine
        part = next(g[j] for g in gathered if j in g)
        verdict, meta = part
        batch = mine[j][1] if held else (skeleton(meta) if meta is not None else None)
        out.append((verdict, batch, held))
    return out
