"""The scale model's building blocks against closed forms, before any of its predictions is read:
the store's rate slot is an M/M/1 queue when service is exponential, a run without contention is
a pipeline whose time is fill + n x the slowest stage, and the ring all-reduce is NCCL's formula."""

from __future__ import annotations

import random
from dataclasses import replace
import statistics

import pytest
import simpy

from benchmarks.sim import Params, Store, simulate
from benchmarks.update_pace import allreduce_s, paced_rows, rank_slowness, update_time

FAST_STORE = dict(store_latency_s=0.0, store_bytes_s=1e18, put_rate=1e12, get_rate=1e12, poll_s=1e-5)


def test_store_rate_slot_is_an_m_m_1_queue() -> None:
    mu, lam, n = 100.0, 70.0, 40_000
    p = Params(get_rate=mu, store_latency_s=0.0, store_bytes_s=1e18, service="exponential")
    env, rng = simpy.Environment(), random.Random(1)
    store, times = Store(env, p, rng), []

    def one() -> object:
        t0 = env.now
        yield from store.request("get", "k")
        times.append(env.now - t0)

    def arrivals() -> object:
        for _ in range(n):
            env.process(one())
            yield env.timeout(rng.expovariate(lam))
    env.process(arrivals())
    env.run()
    w = sum(times) / len(times)
    assert w == pytest.approx(1 / (mu - lam), rel=0.06)          # mean time in system of M/M/1
    assert store.max_utilisation(env.now)[0] == pytest.approx(lam / mu, rel=0.03)


@pytest.mark.parametrize("rollout,update", [(0.2, 0.05), (0.05, 0.2)])
def test_one_sampler_without_contention_is_a_pipeline(rollout: float, update: float) -> None:
    b = 40
    p = Params(samplers=1, batches=b, rollout_s=rollout, rollout_cv=0.0, update_s=update,
               learner_samples=False, shared_budget=False, checkpoint_every=0, max_staleness=10_000, **FAST_STORE)
    r = simulate(p)
    expected = rollout + update + (b - 1) * max(rollout, update)  # fill, then the slowest stage per batch
    assert r["seconds"] == pytest.approx(expected, rel=1e-3)
    assert r["consumed"] == b and r["dropped"] == 0
    assert r["bottleneck"] == ("sampler rollouts" if rollout > update else "learner ingest (updates + reads)")


def test_ring_allreduce_and_rank_split() -> None:
    p = Params(learner_ranks=8, allreduce_bytes=8e6, link_bytes_s=1e9, link_latency_s=1e-5, update_s=1.6,
               min_update_s=0.1)
    assert allreduce_s(p) == pytest.approx(2 * 7 * (1e-5 + 1e6 / 1e9))
    assert update_time(p) == pytest.approx(0.2 + allreduce_s(p))
    assert update_time(Params(learner_ranks=64, update_s=1.6, min_update_s=0.1)) == pytest.approx(0.1)


def test_admission_keeps_staleness_bounded_without_drops_and_back_off_cuts_polls() -> None:
    """16 fast samplers, a slow learner: admission (slot < (S + v + 1) B) holds the samplers back,
    so nothing is dropped and no batch is staler than S; with back-off the waiting samplers' polls
    cost a fraction of the requests."""
    base = Params(samplers=16, batches=192, rollout_s=0.2, update_s=0.05, max_staleness=2, rollout_cv=0.0,
                  learner_samples=False, shared_budget=False, batches_per_update=4, **{**FAST_STORE, "poll_s": 0.01})
    r = simulate(base)
    assert r["dropped"] == 0 and max(r["staleness_hist"]) <= 2 and r["consumed"] == 192
    slow = Params(**{**base.__dict__, "update_s": 0.5})
    plain, backed = simulate(slow), simulate(Params(**{**slow.__dict__, "poll_backoff": 2.0, "poll_max_s": 0.5}))
    assert backed["store_requests_per_s"]["get"] < plain["store_requests_per_s"]["get"] / 3
    assert plain["dropped"] == backed["dropped"] == 0


def test_placement_balances_the_sides_for_the_recipes_global_batch() -> None:
    from miles_core.asyncrl.placement import admitted_samplers, admitting_batch, even_batch, even_ranks, place, predict

    pl = place(10, rollout_s=3.0, update_s=2.0, max_staleness=6, batches_per_update=3)  # 3 : 2 balances 6 : 4
    assert (pl.samplers, pl.learner_ranks) == (6, 4) and pl.sampler_idle == pytest.approx(0.0, abs=1e-12)
    assert pl.learner_idle == pytest.approx(0.0, abs=1e-12) and pl.batches_per_update == 3  # never changed
    off = predict(8, 2, 3.0, 2.0, 6, 4)  # too many samplers: they wait for the learner
    assert off.learner_idle == 0.0 and off.sampler_idle == pytest.approx(1 - (2 / 2.0) / (8 / 3.0))
    assert admitted_samplers(3, 6) == 6 and admitting_batch(100, 4) == 100 and admitting_batch(100, 8) == 25
    # a global batch small for the fleet: 2 batches admit 4 samplers, so the devices go to learner
    # ranks (which shorten versions) and the samplers beyond the window are predicted idle
    small = place(20, rollout_s=3.0, update_s=2.0, max_staleness=6, batches_per_update=2)
    assert small.admitted == 4 and small.learner_ranks >= 3 and small.sampler_idle > 0.5
    assert "admits 4 samplers" in small.describe()
    # ranks share whole units and the busiest sets the pace: 4 ranks over 6 units work as 3
    assert even_ranks(4, 6) == 3 and even_ranks(3, 6) == 3 and even_ranks(5, 7) == 3.5
    assert place(10, 3.0, 2.0, 6, 3, units_per_batch=2).learner_ranks == 3  # 4 is worth no more than 3
    assert place(40, 3.0, 2.0, 6, 1, units_per_batch=2).learner_ranks == 2  # never more ranks than groups
    # rounding the batch down (never up) so the ranks of the balanced split hold equal shares
    assert even_batch(1365, 16, 1760, 0.1) == 1320 and even_batch(1365, 16, 1755, 0.1) == 1365
    assert even_batch(10, 3, 4, 0.0) == 10 and even_batch(12, 3, 4, 0.0) == 12
    fixed = place(7, 3.0, 2.0, 6, 5, units_per_batch=1)          # 5 groups: 3 ranks work as 2.5
    rounded = place(7, 3.0, 2.0, 6, 5, units_per_batch=1, round_down=0.2)
    assert fixed.batches_per_update == 5 and rounded.batches_per_update <= 5
    assert (rounded.batches_per_update, rounded.learner_ranks) == (4, 2) or rounded.learner_idle <= fixed.learner_idle
    with pytest.raises(ValueError, match="at least 2 devices"):
        place(1, 1.0, 1.0, 4)


def test_poll_back_off_in_the_async_workers() -> None:
    """What the scale model's back-off change runs: each empty poll waits longer, up to the cap;
    1.0 keeps a fixed interval."""
    import itertools

    from miles_core.learner.channels import poll_intervals
    from miles_core.config import ConfigError, load_recipe

    assert list(itertools.islice(poll_intervals(0.05, 2.0, 0.3), 5)) == [0.05, 0.1, 0.2, 0.3, 0.3]
    assert list(itertools.islice(poll_intervals(0.05, 1.0, 1.0), 3)) == [0.05, 0.05, 0.05]
    assert list(itertools.islice(poll_intervals(0.5, 3.0, 0.1), 2)) == [0.5, 0.5]  # a cap below the first poll
    assert load_recipe("arith", ["async_rl.poll_backoff=2", "async_rl.poll_max_interval=1"]).async_rl.poll_backoff == 2
    with pytest.raises(ConfigError, match="async_rl.poll_backoff"):
        load_recipe("arith", ["async_rl.poll_backoff=0.5"])


@pytest.mark.parametrize("batches,n,d,group", [(19, 8, 27, 4), (5, 8, 7, 2), (1, 8, 2, 4), (3, 4, 2, 1),
                                               (2, 8, 5, 2), (7, 3, 4, 3), (13, 6, 9, 6)])
def test_shares_match_the_learner_ranks_reads(batches: int, n: int, d: int, group: int) -> None:
    # the model's closed form against learner/shares.py::my_share and owned_rows, rank by rank
    from benchmarks.update_pace import largest_share, shares
    from miles_core.learner.shares import my_share, owned_rows
    from miles_core.parallel import World

    assert shares(batches, n, d, group) == [len(my_share(batches, n, group, World(r, d))) for r in range(d)]
    rows = [sum(int(owned_rows(j, n, batches, group, World(r, d)).sum()) for j in range(batches)) for r in range(d)]
    assert largest_share(batches, n, d, group) == max(rows)


def test_the_slowest_rank_sets_the_pace_as_the_expected_maximum_of_normals() -> None:
    """placement's straggler factor (Blom's E[max of D normals]) against Monte Carlo, and the
    model's per-step draw of the slowest rank against the same expectation."""
    from benchmarks.update_pace import update_time
    from miles_core.asyncrl.placement import straggler

    rng = random.Random(0)
    for d in (2, 27, 1755):
        mc = sum(max(rng.gauss(0, 1) for _ in range(d)) for _ in range(300 if d < 1000 else 40)) / (300 if d < 1000 else 40)
        assert straggler(d, 1.0) - 1 == pytest.approx(mc, rel=0.08)
    assert straggler(1, 0.5) == 1.0 and straggler(64, 0.0) == 1.0
    p = Params(learner_ranks=64, completions_per_batch=64, update_s=6.4, rank_cv=0.05, minibatches=4)
    rng = random.Random(1)
    mean = sum(update_time(p, 1, rng) for _ in range(2000)) / 2000
    assert mean == pytest.approx(0.1 * straggler(64, 0.05), rel=0.01)   # 1 row each: 0.1 s, x the slowest
    assert update_time(p) == pytest.approx(0.1)                        # no rng: the mean rank


def test_a_persistently_slow_gpu_sets_an_even_deals_pace_and_not_a_deal_by_speed() -> None:
    """12 batches of 12 rows in groups of 3 (48 groups) over 4 ranks, rank 2 taking 1.25x: dealt
    evenly it carries 12 groups at 1.25 (the pace, 45 rows' time against 36); dealt by speed
    (learner/shares.py::cuts) it gets 10, the others 13, 13, 12: the busiest 39 rows' time."""
    slow = [1.0, 1.0, 1.25, 1.0]
    even, speed = Params(learner_ranks=4, completions_per_batch=12, deal_unit=3), \
        Params(learner_ranks=4, completions_per_batch=12, deal_unit=3, deal="speed")
    assert paced_rows(even, 12) == paced_rows(even, 12, [1.0] * 4) == 36
    assert paced_rows(even, 12, slow) == pytest.approx(45.0)
    assert paced_rows(speed, 12, slow) == pytest.approx(39.0)
    p = Params(learner_ranks=64, rank_spread=0.05)
    draws = rank_slowness(p, random.Random(0))
    assert len(draws) == 64 and 0.03 < statistics.pstdev(draws) < 0.07 and min(draws) >= 0.5
    assert rank_slowness(Params(learner_ranks=8), random.Random(0)) == [1.0] * 8


def test_whole_run_efficiency_counts_the_start_and_extrapolates_the_steady_rate() -> None:
    from benchmarks.scale_model import efficiency, one_gpu, whole_run

    p = Params(samplers=2, learner_ranks=1, batches=400, rollout_s=0.2, rollout_cv=0.0, update_s=0.05,
               learner_start_s=5.0, learner_samples=False, shared_budget=False, **FAST_STORE)
    r = simulate(p, horizon_s=20.0, warmup_s=6.0)
    window = r["consumed"] * p.completions_per_batch / (r["last_update_s"] * 3 * one_gpu(p))
    assert whole_run(p, r, r["last_update_s"] / 3600) == pytest.approx(window)   # up to its last update alone
    long = whole_run(p, r, 24.0)
    assert window < long < efficiency(p, r) + 1e-9  # the start weighs less over a day, never more than steady


def test_validation_calibrates_on_the_small_runs_and_extrapolates_to_the_large_one() -> None:
    """The 64-process prediction takes nothing from the 64-process run: each contended cost is
    the line through the 4- and 16-process runs, the wire costs their mean."""
    from benchmarks.model_fit import CALIBRATED, calibrate

    runs = [{"processes": 4, **{k: 1.0 for k in CALIBRATED}, "startup_polls": 1.0, "wire": {"poll": 2.0}},
            {"processes": 16, **{k: 2.0 for k in CALIBRATED}, "startup_polls": 1.0, "wire": {"poll": 4.0}}]
    at64 = calibrate(runs, 64)
    assert all(at64[k] == pytest.approx(1.0 + (64 - 4) / 12) for k in CALIBRATED) and at64["wire"] == {"poll": 3.0}
    falling = [{**runs[0], "learner_host_s": 2.0}, {**runs[1], "learner_host_s": 1.0}]  # noqa: E501
    assert calibrate(falling, 64)["learner_host_s"] == 0.0  # a line below zero is clipped, never negative
    assert calibrate(runs[:1], 64)["measured_update_s"] == 1.0  # one run: its own value


def test_straggler_predictions_charge_the_slow_rank_and_a_deal_by_speed_recovers() -> None:
    """A learner-bound emulated shape (4 ranks, 12 groups each): one rank 1.5x slower lowers the
    predicted efficiency dealt evenly, dealt by speed much less; checked() pairs each prediction
    with its run and gives the error with its sign."""
    from benchmarks.model_fit import CALIBRATED, checked, predict

    def run(procs: int) -> dict:
        return {"processes": procs, "samplers": procs - 4, "learner_ranks": 4, "batches": 30 * (procs - 4), "completions_per_batch": 8,
                "group_size": 2, "minibatches": 1, **{k: 0.0 for k in CALIBRATED}, "measured_rollout_s": 1.0,
                "measured_update_s": 1.6, "allreduce_bytes": 0.0, "link_bytes_s": 1e9, "adapter_bytes": 1.0,
                "batch_bytes": 1.0, "store_latency_s": 0.0, "store_bytes_s": 1e12, "store_rate": 1e9, "poll_s": 0.01,
                "poll_backoff": 1.0, "poll_max_s": 0.01, "max_staleness": 4, "batches_per_update": 12,
                "ideal_completions_per_s": 10.0, "efficiency": 0.5, "startup_polls": 0}
    plain = [run(4 + 4), run(16)]
    configs = [{"processes": 16, "slow_rank": x, "rank_spread": 0.0, "deal": d} for x in (1.0, 1.5) for d in ("even", "speed")]
    pred = {(c["slow_rank"], c["deal"]): c["predicted"] for c in predict(plain, configs)}
    assert pred[1.0, "even"] == pytest.approx(pred[1.0, "speed"], rel=1e-9)          # equal speeds: the same deal
    # learner-bound: evenly the pace is 1/1.5 of plain; by speed 48 groups go 13, 13, 13, 9: 12 / 13.5 of plain
    assert pred[1.5, "even"] == pytest.approx(pred[1.0, "even"] / 1.5, rel=0.02)
    assert pred[1.5, "speed"] == pytest.approx(pred[1.0, "even"] * 12 / 13.5, rel=0.02)
    from benchmarks.model_fit import tail_share
    from benchmarks.standin import in_tail

    assert tail_share(8, 4, 0.1) == 2 / 32 == sum(in_tail(f"w{i}", s, 0.1) for i in range(8) for s in range(4)) / 32
    assert tail_share(8, 4, 0.0) == 0.0 and tail_share(8, 4, 1.0) == 1.0
    done = checked(predict(plain, configs[3:]), [{**configs[3], "efficiency": 0.5, "completions_per_batch": 8},
                                                  {**configs[2], "efficiency": 9.0, "completions_per_batch": 8}])
    assert len(done) == 1 and done[0]["error"] == pytest.approx(done[0]["predicted"] / 0.5 - 1)


def test_steady_rate_does_not_move_with_where_the_horizon_ends_in_the_update_cycle() -> None:
    """A learner-bound pipeline without variance consumes one batch per cycle: its steady rate is
    the cycle's, whichever fraction of a cycle the window ends on (counting the updates inside the
    window would move by one update in ten here)."""
    p = Params(samplers=4, learner_ranks=1, batches=10**6, rollout_s=0.2, rollout_cv=0.0, update_s=0.5,
               completions_per_batch=8, learner_samples=False, shared_budget=False,
               **{**FAST_STORE, "poll_s": 0.01})  # batches always wait for the learner: polls never delay it
    rates = [simulate(p, horizon_s=7.0 + frac * 0.5, warmup_s=2.0)["steady_completions_per_s"]
             for frac in (0.0, 0.3, 0.6, 0.9)]
    cycle = 8 / rates[0]
    assert 0.5 <= cycle < 0.51  # the update plus the fast store's requests
    assert max(rates) == pytest.approx(min(rates), rel=1e-9)


def test_the_refresh_model_gives_each_step_the_newest_version_published_a_delay_before_it() -> None:
    from benchmarks.sim import STEP_POINTS, Run, refresh_steps

    run = Run(published=[0.0, 10.0, 20.0, 30.0])  # versions 0-3
    p = Params(refresh=True, refresh_delay_s=4.0)
    steps = refresh_steps(p, run, 1, 0.0, 32.0)  # 16 steps at 1, 3, ..., 31 s; a version counts 4 s after its publish
    want = [max(1, sum(t - 4.0 >= v for v in run.published) - 1) for t in (1.0 + 2 * j for j in range(STEP_POINTS))]
    assert list(steps) == want and steps[0] == 1 and steps[-1] == 2  # v3 counts from 34 s: after the last step
    # without refresh every step is the start version; with it the steps are younger, and a batch whose
    # newest step is within the bound is kept where a batch judged by its first step would be dropped
    base = Params(samplers=4, batches=120, rollout_s=2.0, update_s=0.4, max_staleness=2, batches_per_update=1,
                  learner_samples=False, shared_budget=False, rollout_cv=0.3, poll_s=0.01)
    plain, fresh = simulate(base), simulate(replace(base, refresh=True, refresh_delay_s=0.05))
    assert fresh["step_age_mean"] < plain["step_age_mean"] and fresh["dropped"] <= plain["dropped"]
    assert plain["stale_step_frac"] == 0.0 and fresh["consumed"] + fresh["dropped"] == 120
