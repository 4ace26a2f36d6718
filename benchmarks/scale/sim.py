"""A discrete-event model of an asynchronous Miles run (SimPy), for scales this machine cannot reach.

What it models, and how each part maps to the code:

* **Samplers** (``asyncrl/sampler.py``): wait for the first adapter; per batch take a slot (its
  own stripe, one PUT with ``shared_budget``), then wait until the learner's version admits it,
  slot < (S + v + 1) B (``admits``; each poll one GET of ``adapters/LATEST`` and one HEAD of
  ``control/STOP``); GET the adapter when it moved; roll out (a lognormal time: rollout times vary
  with completion lengths and NSD); commit (PUT the data, the marker's existence check, PUT the
  marker) and PUT its status file.
* **The learner** (``asyncrl/learner.py``): D data-parallel ranks. Rank 0 LISTs the committed
  batches; with fewer than B waiting it samples a batch itself (``learner_samples``) or sleeps a
  poll interval (with back-off); else the ranks read their shares of the B oldest in parallel (a
  GET of the marker and of the data each), drop any older than ``max_staleness`` versions, update
  (the busiest rank's share of B x ``update_s``, times its persistent slowness, dealt evenly or by
  speed as ``learner/shares.py::cuts`` deals it, plus a ring all-reduce of the adapter's gradient), PUT a checkpoint every
  ``checkpoint_every`` updates, publish the adapter (PUT files, PUT ``LATEST``) and PUT status.json.
* **The store as a service** (:class:`Store`): every request waits for a rate slot of its prefix
  and class, then takes a latency plus its bytes over the per-connection bandwidth. Rate limits are
  S3's documented per-prefix rates (3,500 PUT/COPY/POST/DELETE and 5,500 GET/HEAD per second per
  partitioned prefix, "Best practices design patterns: optimizing Amazon S3 performance"); LIST
  is counted with GET. ``prefixes`` spreads keys over that many prefixes (1: Miles' layout).
* **Polling** every ``poll_s``, growing by ``poll_backoff`` per empty poll up to ``poll_max_s``
  (``async_rl.poll_backoff`` / ``poll_max_interval``).
* **In-flight refresh** (``refresh``, ``asyncrl/refresh.py``): a rollout's steps (:data:`STEP_POINTS`
  of them, evenly spaced in its time) each sample with the newest version published at least
  ``refresh_delay_s`` before (discovering it at the polls' cap and fetching it), never older than
  the one it started with; the fetches and the polls of ``adapters/LATEST`` during the rollout
  load the store beside it. The learner drops a batch only when its newest step is more than S
  versions old, and reports each consumed batch's mean step age and its share of steps older than
  S (rows the update does not draw; the update's time is charged for all of them).

The building blocks are checked against closed forms (benchmarks/tests/test_scale_model.py: an M/M/1 queue,
a pipeline without contention) before any prediction is read; benchmarks/scale/emulate.py's runs of the
real code validate the whole. benchmarks/scale/scale_model.py runs it.
"""

from __future__ import annotations

import bisect
import math
import random
import zlib
from dataclasses import dataclass, field
from typing import Any, Generator

import simpy

from benchmarks.update_pace import rank_slowness, shares, update_time

S3_PUT_PER_PREFIX = 3500.0   # requests/s (AWS S3 user guide, optimizing performance)
S3_GET_PER_PREFIX = 5500.0

# S3 requests per protocol step, as SeaweedFS + s3fs answered them in the 64-process emulated run
# (python -m benchmarks.emulate, 2026-12-03: its "wire", counted on the wire by every process,
# storage/requests.py; a claim, which those runs did not make, is an exclusive create: 2). A step
# is several requests: s3fs asks a HEAD before each GET, an exclusive create looks first, an
# adapter is three files, its manifest, its marker and LATEST.
# A sampler's start: the spec and the base; a poll: control/STOP and adapters/LATEST; a learner
# poll: the inbox listing and control/STOP; a read: a batch's marker and data. Since those runs a
# commit also announces the batch (one PUT: commit 3 -> 4) and a checkpoint retires the inbox's
# taken batches (its listing and a bulk delete per 1,000: checkpoint 2 -> 4), as counted on
# SeaweedFS by tests/test_seaweed.py; the learner's poll lists the inbox, so it costs the same at
# any run age (it listed every commit marker before: benchmarks/scale/run_age.py).
WIRE = {"sampler_start": 12.54, "poll": 3.0, "claim": 2.0, "sync": 6.0, "commit": 4.0, "sampler_status": 1.0,
        "learner_start": 24.0, "rank_start": 12.0, "learner_poll": 2.6, "read": 3.98, "publish": 12.0,
        "checkpoint": 4.0, "learner_status": 1.0, "refresh_poll": 1.5}  # refresh: LATEST alone (HEAD + GET)
STEP_POINTS = 16  # steps of a rollout whose versions the refresh model tracks


@dataclass(frozen=True)
class Params:
    """One configuration; times in seconds, sizes in bytes."""

    samplers: int = 1
    learner_ranks: int = 1
    batches: int = 150                 # the run's budget (shared_budget: claimed by any sampler)
    completions_per_batch: int = 128
    rollout_s: float = 0.25            # one sampler's rollout + reward per batch (mean, tail included)
    rollout_cv: float = 0.1            # coefficient of variation of the rollout time (lognormal body)
    rollout_tail_p: float = 0.0        # heavy tail: this share of rollouts takes rollout_tail_x x the body's
    rollout_tail_x: float = 1.0
    update_s: float = 0.18             # one learner rank's update of a whole batch
    min_update_s: float = 0.0          # floor per update however many ranks share it (kernel launches, ...)
    deal_unit: int = 1                 # rows per unit ranks are dealt: 1, or a group (learner/shares.py)
    rank_cv: float = 0.0               # spread of one rank's optimizer-step time: the slowest of D sets the pace
    # each rank's own persistent slowness (a GPU slower all run long: Sinha et al., SC22), a
    # normal CV drawn once per rank; and how rows are dealt: "even" blocks (the slowest GPU sets
    # the pace) or "speed" (async_rl.deal: blocks in proportion to the measured speeds)
    rank_spread: float = 0.0
    deal: str = "even"
    rank_slowness: tuple[float, ...] = ()  # each rank's factor as given (an emulated run's), instead of drawn
    minibatches: int = 1               # optimizer steps per update, each all-reducing the gradient
    allreduce_bytes: float = 0.0       # gradient bytes all-reduced per optimizer step (the adapter's)
    base_bytes: float = 0.0            # what every process reads from the store at start (the base)
    link_bytes_s: float = 25e9         # all-reduce bus bandwidth per rank (NCCL busbw)
    link_latency_s: float = 10e-6      # per ring step
    batch_bytes: float = 200e3
    adapter_bytes: float = 9e3
    checkpoint_every: int = 10
    checkpoint_bytes: float = 0.0      # adapter + optimizer state per checkpoint
    store_latency_s: float = 0.001     # per request, first byte
    store_bytes_s: float = 1e9         # per connection
    put_rate: float = S3_PUT_PER_PREFIX
    get_rate: float = S3_GET_PER_PREFIX
    prefixes: int = 1
    poll_s: float = 0.05
    poll_backoff: float = 1.0
    poll_max_s: float = 1.0
    max_staleness: int = 5
    learner_samples: bool = True       # the learner samples a batch itself when fewer than B wait
    shared_budget: bool = True
    batches_per_update: int = 1        # B: sampler batches one update consumes (async_rl.global_batch)
    adapter_share: int = 1             # samplers per node sharing one adapter fetch (hierarchical fan-out; Miles: 1)
    seed: int = 0
    service: str = "deterministic"     # rate-slot service times: deterministic, or "exponential" (M/M/1 tests)
    wire: dict[str, float] = field(default_factory=lambda: dict(WIRE))  # requests per protocol step
    # host seconds beyond compute and the store's own time, as a run measured them: a sampler's per
    # batch (loading the new adapter, writing Parquet), the learner's per update (reading and
    # agreeing on its share, saving the adapter); ~0 next to LLaDA-8B's minutes, seconds when 64
    # emulated processes share 2 cores (benchmarks/scale/emulate.py)
    sampler_host_s: float = 0.0
    learner_host_s: float = 0.0
    learner_start_s: float = 0.0       # until the learner publishes version 0 (loading, rendezvous)
    startup_poll_s: float = 0.0        # how often samplers polled for version 0, if not the back-off's cap
    refresh: bool = False              # in-flight refresh between steps (async_rl.refresh_every = 1)
    refresh_delay_s: float = 0.0       # from a publish to a refreshing sampler's swap (discovery + fetch)


class Store:
    """Object store: a rate slot per (prefix, class), then latency + bytes / bandwidth."""

    def __init__(self, env: simpy.Environment, p: Params, rng: random.Random) -> None:
        self.env, self.p, self.rng = env, p, rng
        self.slots: dict[tuple[int, str], simpy.Resource] = {}
        self.counts: dict[str, float] = {"put": 0.0, "get": 0.0}
        self.busy: dict[tuple[int, str], float] = {}

    def request(self, kind: str, key: str, nbytes: float = 0.0, n: float = 1.0) -> Generator:
        """``n`` requests (a protocol step's, ``Params.wire``; a mean may be fractional) of class
        ``kind`` ("put" or "get") for ``key``, one after another: n rate slots and n latencies."""
        if n <= 0:
            return
        prefix = zlib.crc32(key.encode()) % self.p.prefixes if self.p.prefixes > 1 else 0
        slot = self.slots.setdefault((prefix, kind), simpy.Resource(self.env, capacity=1))
        rate = self.p.put_rate if kind == "put" else self.p.get_rate
        self.counts[kind] += n
        with slot.request() as r:
            yield r
            hold = (self.rng.expovariate(rate / n) if self.p.service == "exponential" else n / rate)
            self.busy[(prefix, kind)] = self.busy.get((prefix, kind), 0.0) + hold
            yield self.env.timeout(hold)
        yield self.env.timeout(n * self.p.store_latency_s + nbytes / self.p.store_bytes_s)

    def max_utilisation(self, wall: float) -> tuple[float, str]:
        """The busiest prefix's rate-slot utilisation and which class it is."""
        if not self.busy or wall <= 0:
            return 0.0, ""
        (prefix, kind), busy = max(self.busy.items(), key=lambda kv: kv[1])
        return busy / wall, f"store {kind.upper()} rate, prefix {prefix}"


@dataclass
class Run:
    """What happened: the counters scale_model.py reports."""

    consumed: int = 0
    dropped: int = 0
    committed: int = 0
    self_sampled: int = 0
    claimed: int = 0
    version: int = -1                  # none published yet: samplers wait for the learner's version 0
    learner_busy_s: float = 0.0
    learner_compute_s: float = 0.0     # updates and its own rollouts (busy_s adds store requests)
    sampler_compute_s: float = 0.0     # rollouts
    learner_idle_s: float = 0.0
    sampler_busy_s: float = 0.0
    sampler_wait_s: float = 0.0
    end_s: float = 0.0
    staleness: list[int] = field(default_factory=list)
    consumed_at: list[tuple[float, int]] = field(default_factory=list)  # (time, completions) per update
    waiting: list[tuple[int, int, tuple[int, ...] | None]] = field(default_factory=list)  # (seq, version, steps' versions)
    published: list[float] = field(default_factory=list)  # when each version was published
    step_age_sum: float = 0.0          # over consumed batches: each one's mean step age, and
    stale_step_sum: float = 0.0        # its share of steps older than S


def _rollout(p: Params, rng: random.Random) -> float:
    """Lognormal body (CV ``rollout_cv``) and a heavy tail (``rollout_tail_p`` of rollouts take
    ``rollout_tail_x`` times as long), scaled so the mean is ``rollout_s``."""
    body = p.rollout_s / (1 + p.rollout_tail_p * (p.rollout_tail_x - 1))
    if p.rollout_tail_p and rng.random() < p.rollout_tail_p:
        body *= p.rollout_tail_x
    if p.rollout_cv <= 0:
        return body
    s2 = math.log(1 + p.rollout_cv ** 2)
    return rng.lognormvariate(math.log(body) - s2 / 2, math.sqrt(s2))


def _wait(env: simpy.Environment, p: Params, cond, poll, cap: float = 0.0) -> Generator:
    """Poll ``cond`` (each poll costs the requests ``poll`` makes) with back-off until it holds;
    ``cap``: the longest interval, when not ``p.poll_max_s``."""
    interval = p.poll_s
    while True:
        yield from poll()
        if cond():
            return
        yield env.timeout(interval)
        interval = min(interval * p.poll_backoff, max(cap or p.poll_max_s, p.poll_s))


def refresh_steps(p: Params, run: Run, start: int, t0: float, t1: float) -> tuple[int, ...]:
    """The version each of :data:`STEP_POINTS` evenly spaced steps of a rollout over [t0, t1) took,
    started on version ``start``: the newest published ``refresh_delay_s`` before the step."""
    out = []
    for j in range(STEP_POINTS):
        t = t0 + (j + 0.5) / STEP_POINTS * (t1 - t0)
        out.append(max(start, bisect.bisect_right(run.published, t - p.refresh_delay_s) - 1))
    return tuple(out)


def refresh_delay(p: Params) -> float:
    """Seconds from a publish to a refreshing sampler's swap: discovery at the polls' cap (half of
    it on average) plus fetching the adapter (its requests' latency and its bytes)."""
    return p.poll_max_s / 2 + p.wire["sync"] * p.store_latency_s + p.adapter_bytes / p.store_bytes_s


def admits(slot: int, run: Run, p: Params) -> bool:
    """learner/channels.py::admits: slot < (S + v + 1) B + the batches dropped (each frees its slot)."""
    return slot < (p.max_staleness + run.version + 1) * p.batches_per_update + run.dropped


def sampler(env: simpy.Environment, p: Params, store: Store, run: Run, i: int, rng: random.Random) -> Generator:
    version, w = -1, p.wire

    def poll() -> Generator:  # control/STOP and adapters/LATEST
        yield from store.request("get", "adapters/LATEST", n=w["poll"])
    yield from store.request("get", "base", p.base_bytes, n=w["sampler_start"])  # the spec, the base's files
    yield from _wait(env, p, lambda: run.version >= 0, poll, p.startup_poll_s)
    seq = 0
    while True:
        if p.shared_budget:
            if run.claimed >= p.batches:
                return
            slot = run.claimed
            run.claimed += 1
            yield from store.request("put", f"claims/{i}-{seq}", n=w["claim"])
        elif seq >= p.batches // p.samplers:
            return
        else:
            slot = seq * p.samplers + i
        t0 = env.now
        yield from _wait(env, p, lambda: admits(slot, run, p), poll)
        t1 = env.now
        if run.version != version:
            version = run.version
            if i % p.adapter_share == 0:  # the node's fetcher; the others read its local copy
                yield from store.request("get", f"adapters/v{version}", p.adapter_bytes, n=w["sync"])
        t2 = env.now
        yield env.timeout(_rollout(p, rng))
        run.sampler_compute_s += env.now - t2
        steps = None
        if p.refresh:  # its polls and fetches ran beside the rollout: their load, not their time
            steps = refresh_steps(p, run, version, t2, env.now)
            polls = w.get("refresh_poll", WIRE["refresh_poll"]) * max(1.0, (env.now - t2) / p.poll_max_s)
            fetches = len(set(steps)) - 1
            env.process(store.request("get", "adapters/LATEST", n=polls))
            if fetches and i % p.adapter_share == 0:
                env.process(store.request("get", f"adapters/v{steps[-1]}", p.adapter_bytes * fetches, n=w["sync"] * fetches))
            version = steps[-1]
        yield env.timeout(p.sampler_host_s)
        yield from store.request("put", f"trajectories/{i}-{seq}", p.batch_bytes, n=w["commit"])  # data + marker
        yield from store.request("put", f"samplers/{i}.json", n=w["sampler_status"])
        run.waiting.append((seq, steps[0] if steps else version, steps))
        run.committed += 1
        run.sampler_wait_s += t1 - t0
        run.sampler_busy_s += env.now - t1
        seq += 1


def learner(env: simpy.Environment, p: Params, store: Store, run: Run, rng: random.Random) -> Generator:
    w = p.wire
    # loading and rendezvous; then each rank reads the spec and the base (in parallel), rank 0 also
    # checks for a checkpoint and adapter and publishes version 0
    yield env.timeout(p.learner_start_s)
    others = [env.process(store.request("get", "base", p.base_bytes, n=w["rank_start"]))
              for _ in range(p.learner_ranks - 1)]
    yield from store.request("get", "base", p.base_bytes + p.adapter_bytes, n=w["learner_start"])
    yield simpy.AllOf(env, others)
    slowness = rank_slowness(p, rng)
    run.version = 0
    run.published.append(env.now)
    interval = p.poll_s
    while run.consumed + run.dropped < p.batches:
        t0 = env.now
        yield from store.request("get", "trajectories/", n=w["learner_poll"])  # list + control/STOP
        need = min(p.batches_per_update, p.batches - run.consumed - run.dropped)
        if len(run.waiting) < need:
            if p.learner_samples and run.claimed < p.batches and admits(run.claimed, run, p):
                run.claimed += 1
                run.self_sampled += 1
                t1 = env.now
                yield env.timeout(_rollout(p, rng))
                run.learner_compute_s += env.now - t1
                run.waiting.append((-1, run.version, None))
                run.learner_busy_s += env.now - t0
                continue
            yield env.timeout(interval)
            interval = min(interval * p.poll_backoff, max(p.poll_max_s, p.poll_s))
            run.learner_idle_s += env.now - t0
            continue
        interval = p.poll_s
        run.waiting.sort(key=lambda b: b[0])  # batch ids sort by sequence number: the oldest slots first
        taken = [run.waiting.pop(0) for _ in range(need)]
        fresh = []

        def ingest(share: int) -> Generator:  # one rank reads its share: marker and data of each batch
            for _ in range(share):
                yield from store.request("get", "trajectories/batch", p.batch_bytes, n=w["read"])
        reads = (shares(len(taken), p.completions_per_batch, p.learner_ranks, p.deal_unit) if p.learner_ranks > 1
                 else [len(taken)])
        yield simpy.AllOf(env, [env.process(ingest(k)) for k in reads if k])
        yield env.timeout(p.learner_host_s)
        for _, version, steps in taken:  # dropped when even its newest step is too old (BatchChannel.verdict)
            ages = [run.version - v for v in (steps or (version,))]
            if min(ages) > p.max_staleness:
                run.dropped += 1
            else:
                fresh.append(run.version - version)
                run.step_age_sum += sum(ages) / len(ages)
                run.stale_step_sum += sum(a > p.max_staleness for a in ages) / len(ages)
        if not fresh:
            run.learner_busy_s += env.now - t0
            continue
        run.staleness.extend(fresh)
        t1 = env.now
        yield env.timeout(update_time(p, len(fresh), rng, slowness))
        run.learner_compute_s += env.now - t1
        run.version += 1
        before = run.version - 1
        run.consumed += len(fresh)
        run.consumed_at.append((env.now, len(fresh) * p.completions_per_batch))
        if p.checkpoint_every and run.version // p.checkpoint_every > before // p.checkpoint_every:
            yield from store.request("put", "learner/checkpoint", p.checkpoint_bytes, n=w["checkpoint"])
        yield from store.request("put", f"adapters/v{run.version}", p.adapter_bytes, n=w["publish"])  # + LATEST
        run.published.append(env.now)
        yield from store.request("put", "learner/status.json", n=w["learner_status"])
        run.learner_busy_s += env.now - t0
    run.end_s = env.now


def simulate(p: Params, horizon_s: float = 1e7, warmup_s: float = 0.0) -> dict[str, Any]:
    """Run one configuration to the end of its budget or ``horizon_s`` of simulated time (then the
    rates are those of the horizon: a steady-state estimate); the summary scale_model.py prints.
    ``steady_completions_per_s`` is the rate between the updates that finished after ``warmup_s``
    (the pipeline's fill): :func:`steady_rate`."""
    rng = random.Random(p.seed)
    env = simpy.Environment()
    store, run = Store(env, p, rng), Run()
    done = env.process(learner(env, p, store, run, random.Random(rng.random())))
    for i in range(p.samplers):
        env.process(sampler(env, p, store, run, i, random.Random(rng.random())))
    env.run(until=simpy.AnyOf(env, [done, env.timeout(horizon_s)]))
    wall = run.end_s or env.now
    util, where = store.max_utilisation(wall)
    learner_util = run.learner_busy_s / wall if wall else 0.0
    sampler_util = run.sampler_busy_s / (wall * p.samplers) if wall and p.samplers else 0.0
    learner_compute = run.learner_compute_s / wall if wall else 0.0
    sampler_compute = run.sampler_compute_s / (wall * p.samplers) if wall and p.samplers else 0.0
    hist: dict[int, int] = {}
    for s in run.staleness:
        hist[s] = hist.get(s, 0) + 1
    drop_share = run.dropped / max(run.dropped + run.consumed, 1)
    bottleneck = first_saturated([(util, where), (drop_share / 0.2 * 0.9, "staleness bound (batches dropped)"),
                                  (learner_util, "learner ingest (updates + reads)"),
                                  (sampler_compute, "sampler rollouts")])
    steady = steady_rate(run.consumed_at, warmup_s, wall)
    # what benchmarks/scale/emulate.py measures: the rate from the second update on, whatever its time
    after_two = steady_rate(run.consumed_at[1:], float("-inf"), wall)
    return {"seconds": wall, "completions_per_s": run.consumed * p.completions_per_batch / wall if wall else 0.0,
            "steady_completions_per_s": steady, "after_two_updates_completions_per_s": after_two,
            "consumed": run.consumed, "dropped": run.dropped, "self_sampled": run.self_sampled,
            "step_age_mean": run.step_age_sum / max(run.consumed, 1),
            "stale_step_frac": run.stale_step_sum / max(run.consumed, 1),
            "learner_idle_fraction": 1 - learner_util, "sampler_idle_fraction": 1 - sampler_util,
            "staleness_hist": hist, "store_requests_per_s": {k: v / wall for k, v in store.counts.items()},
            "requests_per_batch": sum(store.counts.values()) / max(run.committed + run.self_sampled, 1),
            "store_max_utilisation": util, "learner_compute_fraction": learner_compute,
            "sampler_compute_fraction": sampler_compute, "bottleneck": bottleneck, "update_s": update_time(p),
            "last_update_s": run.consumed_at[-1][0] if run.consumed_at else wall, "finished": bool(run.end_s)}


def steady_rate(consumed_at: list[tuple[float, int]], warmup_s: float, wall: float) -> float:
    """Completions/s between the updates that finished after ``warmup_s``: what the updates after
    the first of them consumed, over the time from it to the last. Counting the whole updates that
    fall in the window (warmup_s, wall] instead moves by up to one update's completions with where
    the window's end falls in the update cycle: up to 1/40 of a 40-update window."""
    late = [(t, n) for t, n in consumed_at if t > warmup_s]
    if len(late) < 2:
        return sum(n for _, n in late) / max(wall - warmup_s, 1e-9)
    return sum(n for _, n in late[1:]) / (late[-1][0] - late[0][0])


def first_saturated(loads: list[tuple[float, str]], at: float = 0.9) -> str:
    """The first resource (in the order given: store, staleness drops, learner, samplers) busy at
    least ``at`` of the time (drops: a fifth of all batches counts as saturated); else the busiest.
    A saturated store slows everything behind it, so it is named first."""
    return next((name for u, name in loads if u >= at), max(loads)[1])
