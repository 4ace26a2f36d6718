"""Data-parallel primitives: this process's place in the group (:class:`World`), joining and
leaving the process group, and the few collectives the learner uses. The update engine
(algo/update.py) imports them for real, so a single process is ``World()`` (every method a no-op)
and the learner under torchrun (``python -m miles_core.asyncrl learner`` as D ranks) is the same
code with a bigger world.

How an update is split: every rank builds the same global batch (its share read, the others'
rows as skeletons: learner/shares.py) and holds the same generator state, so the rows, their
permutation into minibatches and the loss normaliser are identical everywhere; each rank scores
the rows of the trajectories it holds. Gradients are summed, not averaged: each rank's loss is
already divided by the *global* normaliser, so the sum is the single-process gradient (up to
float summation order), and clipping and the AdamW step then run on identical gradients, so the
replicas stay equal without broadcasting weights after a step.

Why a manual all-reduce instead of DDP: the update backpropagates row chunk by row chunk; with
DDP that needs ``no_sync()`` on all but the last chunk, and a rank holding fewer rows of a
minibatch runs fewer backward passes and would hang DDP's collective. One flattened all-reduce of
the trainable (LoRA) gradients per optimizer step is what DDP does with a single bucket, works
with any number of chunks per rank, and keeps the model a plain PeftModel. LoRA gradients are
small, so DDP's overlap of communication with backward would buy little.

FSDP2 when the frozen base does not fit one device (``async_rl.fsdp``, :func:`shard_model`): every
decoder layer and then the root is ``fully_shard``-ed after LoRA is added, so each rank holds
1/D of the base and of the adapter and all-gathers a layer for its forward and backward. FSDP
runs collectives on every pass, so the engine gives every rank the same number of row chunks (a
short share padded with one-row chunks whose loss is multiplied by zero), lets only the last
chunk of a minibatch reduce-scatter (``set_requires_gradient_sync``), and scales each rank's loss
by D so that FSDP's average is the sum :meth:`World.sync_grads` takes unsharded. The
checkpoint and the published adapter are gathered to full tensors on every rank
(:func:`full_tensors`), so a sharded learner writes exactly what a replicated one writes, and a
checkpoint resumes under either (:func:`shard_like`).
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass
class World:
    """This process's place in the data-parallel group. ``size == 1``: every method is a no-op,
    so a single process through this path computes bit for bit what ``world=None`` does."""

    rank: int = 0
    size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    local_rank: int = 0
    sharded: bool = False  # FSDP2 holds the model's parameters (shard_model): collectives on every pass
    # seconds this rank spent in its collectives: what it waited for the others, beside its own work
    # (learner/shares.py::RankSpeeds subtracts it to measure how fast this rank computes)
    waited_s: float = 0.0

    @contextmanager
    def _collective(self) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.waited_s += time.perf_counter() - t0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_reduce_(self, t: Tensor, op: str = "sum") -> Tensor:
        """In-place sum (or max) over ranks of a tensor on any device (moved for the backend)."""
        if self.size == 1:
            return t
        buf = t.detach().to(self.device, torch.float64 if t.dtype == torch.float64 else torch.float32)
        with self._collective():
            dist.all_reduce(buf, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
            t.copy_(buf.to(t.device, t.dtype))
        return t

    def sync_grads(self, params: list[torch.nn.Parameter]) -> None:
        """Sum the trainable gradients over ranks: one flattened all-reduce (float32).

        A rank that scored no rows of this minibatch has ``grad None``; it contributes zeros. A
        parameter no rank touched keeps ``grad None``, as in a single process (AdamW skips it).
        """
        if self.size == 1 or not params:
            return
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).to(self.device, torch.float32)
                          for p in params]
                         + [torch.tensor([float(p.grad is not None) for p in params], device=self.device)])
        with self._collective():
            dist.all_reduce(flat)
            touched = flat[-len(params):].tolist()  # one device->host copy, not one per parameter
        off = 0
        for p, hit in zip(params, touched):
            n = p.numel()
            p.grad = flat[off:off + n].view_as(p).to(p.device, p.dtype) if hit > 0 else None
            off += n

    def broadcast_(self, params: list[torch.nn.Parameter], src: int = 0) -> None:
        """Make every rank start from rank ``src``'s trainable parameters (as DDP does)."""
        if self.size == 1:
            return
        with torch.no_grad():
            for p in params:
                buf = p.data.to(self.device)
                dist.broadcast(buf, src=src)
                p.data.copy_(buf.to(p.device))

    def max_over_ranks(self, value: float) -> float:
        return float(self.all_reduce_(torch.tensor([value], dtype=torch.float64), op="max")[0])

    def sum_over_ranks(self, value: float) -> float:
        return float(self.all_reduce_(torch.tensor([value], dtype=torch.float64))[0])

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` (picklable) on every rank: what rank 0 decided."""
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order."""
        if self.size == 1:
            return [obj]
        gathered: list[Any] = [None] * self.size
        with self._collective():
            dist.all_gather_object(gathered, obj)
        return gathered

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()


def init_world(backend: str | None = None, timeout_s: float = 600.0) -> World:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR/PORT in the env).

    Without those variables this is a single process (``World()``). ``backend`` None: NCCL when
    CUDA is available, else gloo. With NCCL each rank uses ``cuda:LOCAL_RANK``.
    """
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return World()
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend {backend!r} is not supported; use 'gloo' (CPU) or 'nccl' (GPU)")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cpu")
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise RuntimeError("backend 'nccl' needs CUDA, and torch.cuda.is_available() is False; use --backend gloo")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        timeout = timedelta(seconds=timeout_s)
        store = _attempt_store(timeout)
        if store is None:
            dist.init_process_group(backend, timeout=timeout)
        else:
            dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                                    world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
    return World(dist.get_rank(), dist.get_world_size(), device, local_rank)


def _attempt_store(timeout: timedelta) -> dist.Store | None:
    """Under torchrun, a client of the agent's store with keys scoped to this restart of the group.

    torchrun's agent hosts one TCPStore for every restart of the worker group, and the default
    process group's keys in it are not scoped per restart, so a restarted rank can read the address
    its dead predecessor published and connect to a closed port: gloo fails with "connection
    refused" or waits forever, NCCL reads a stale unique id (pytorch/pytorch#135712). The prefix is
    the agent's restart count, which every rank of a single-node group shares. Across nodes each
    agent counts its own restarts (one restarting for a new member does not count it), so the
    count cannot key a multi-node group: None there, as outside torchrun's agent store (torch's
    own env:// rendezvous)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or os.environ.get("GROUP_WORLD_SIZE", "1") != "1":
        return None
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                           int(os.environ["WORLD_SIZE"]), is_master=False, timeout=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"miles/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/attempt{attempt}", client)


def close_world(world: World) -> None:
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def shard_model(root: torch.nn.Module, world: World, forwards: tuple[str, ...] = ()) -> None:
    """FSDP2 over ``world``: ``fully_shard`` each layer of the denoiser's layer lists, then the
    denoiser itself (``root``: the module under a peft wrapper, where peft injected LoRA in
    place), in place. FSDP averages gradients over ranks; the engine scales a sharded rank's loss
    by D so that the result is the sum (gloo has no pre-multiplied sum for
    ``set_gradient_divide_factor``). ``forwards``: the root's methods that count as a forward, so
    FSDP gathers its parameters for them too (a window denoiser's ``window``, models/window.py:
    the pass that scores rows and samples). Call after LoRA is added and before the optimizer is
    built: the parameters become DTensors."""
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    if world.size == 1:
        return
    units = [layer for mods in root.modules() if isinstance(mods, torch.nn.ModuleList)
             for layer in mods if any(True for _ in layer.parameters())]
    for layer in units:
        fully_shard(layer)
    fully_shard(root)
    for name in forwards:
        register_fsdp_forward_method(root, name)
    world.sharded = True


def full_tensors(obj: Any) -> Any:
    """``obj`` (nested dicts, lists, tuples) with every DTensor gathered to a full tensor. A
    collective: every rank calls it, in the same order."""
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        return obj.full_tensor()
    if isinstance(obj, dict):
        return {k: full_tensors(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(full_tensors(v) for v in obj)
    return obj


def shard_like(full: Tensor, like: Tensor) -> Tensor:
    """``full`` laid out as the DTensor ``like`` is (its mesh and placements); every rank holds the
    same ``full`` (all read the same checkpoint), so each keeps its own shard without communication.
    A plain ``like``: ``full`` as is."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(like, DTensor):
        return full
    return distribute_tensor(full.to(like.dtype), like.device_mesh, like.placements, src_data_rank=None)

