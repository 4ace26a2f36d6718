"""In-flight policy refresh: a rollout that swaps adapters between denoising steps records, per
step, the version that took it and that version's log-probs; the learner counts staleness per
step (its verdict, the rows it draws); the stored schema carries the versions and stays readable
by a reader that does not know them; a sampler's refresh fetches in the background and swaps at
a step boundary."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pytest
import torch

from miles_core.algo.rows import RecordedStep, score_rows
from miles_core.algo.step_choice import build_rows
from miles_core.algo.draws import Draws
from miles_core.algo.update import update_policy
from miles_core.asyncrl.refresh import InFlightRefresh
from miles_core.config import load_recipe
from miles_core.learner.baseline import new_model
from miles_core.learner.channels import BatchChannel, PolicyChannel
from miles_core.learner.ledger import Verdict
from miles_core.models.lora import adapter_tensors, add_lora_from, save_adapter
from miles_core.samplers.sampler import sample
from miles_core.storage import from_arrow, to_arrow
from miles_core.storage.arrow import check_schema
from miles_core.storage.run import RunStore
from miles_core.tokenizer import CharTokenizer

CFG = load_recipe("arith")
TOK = CharTokenizer()


def policy() -> torch.nn.Module:
    torch.manual_seed(0)
    return add_lora_from(new_model(CFG, TOK, 0).eval(), CFG.lora, dropout=0.0)


def adapter_state(seed: int, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Random LoRA tensors for ``model`` (B included: a zero B would make every adapter the base)."""
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g) * 0.3 for k, v in adapter_tensors(model).items()}


def load(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for k, v in adapter_tensors(model).items():
            v.copy_(state[k])


class SwapAt:
    """A Refresh that swaps in adapter ``states[i]`` (version i) before forward ``at[i - 1]``."""

    def __init__(self, model: torch.nn.Module, states: list[dict[str, torch.Tensor]], at: list[int]) -> None:
        self.model, self.states, self.at, self.calls = model, states, at, []

    def __call__(self, forwards: int) -> int | None:
        self.calls.append(forwards)
        if forwards in self.at:
            v = self.at.index(forwards) + 1
            load(self.model, self.states[v])
            return v
        return None


def prompts(n: int) -> list[list[int]]:
    return [TOK.encode_prompt(f"{i % 9}+{(3 * i) % 7}*{i % 5}") for i in range(n)]


@pytest.mark.parametrize("kind", ["static", "nsd"])
def test_a_rollout_that_swaps_adapters_mid_chain_records_each_steps_version_and_its_log_probs(kind: str) -> None:
    model = policy()
    states = [adapter_state(s, model) for s in (1, 2, 3)]
    load(model, states[0])
    cfg = replace(CFG.sampler, kind=kind, steps=8, block_size=8, threshold=0.5, max_per_step=3)
    refresh = SwapAt(model, states, [3, 5])
    batch = sample(model, TOK, prompts(6), cfg, 16, torch.Generator().manual_seed(0), policy_version=0,
                   refresh=refresh)
    assert refresh.calls[0] == 1  # never asked before the first forward: a rollout starts on its own adapter
    sv, sm = batch.step_version, batch.step_map
    assert sv is not None and set(sv.unique().tolist()) == {0, 1, 2} and batch.policy_version.tolist() == [0] * 6
    for b in range(len(batch)):  # one version per step, never older than an earlier step's
        per_step = [sv[b][sm[b] == k].unique().tolist() for k in range(int(sm[b].max()) + 1)]
        assert all(len(v) == 1 for v in per_step) and [v[0] for v in per_step] == sorted(v[0] for v in per_step)
    # each recorded log-prob is the one its step's adapter gives at the recorded state; any other's is not
    traj = torch.arange(len(batch)).repeat_interleave(int(batch.num_steps.max()))
    step = torch.arange(int(batch.num_steps.max())).repeat(len(batch))
    real = step < batch.num_steps[traj]
    traj, step = traj[real], step[real]
    for v, state in enumerate(states):
        load(model, state)
        with torch.no_grad():
            logp, _, commit = score_rows(model, batch, traj, step, TOK, cfg.temperature)
        mine = commit & (sv[traj] == v)
        others = commit & (sv[traj] != v)
        assert mine.any() and others.any()
        assert torch.allclose(logp[mine], batch.logp[traj][mine], atol=1e-5)
        assert (logp[others] - batch.logp[traj][others]).abs().max() > 1e-2


def test_a_swap_drops_the_kv_cache_of_the_older_weights() -> None:
    model = policy()
    states = [adapter_state(s, model) for s in (1, 2)]
    load(model, states[0])
    cfg = replace(CFG.sampler, kind="static", steps=4, block_size=16, cache="prefix")
    gen = lambda: torch.Generator().manual_seed(3)  # noqa: E731
    swapped = sample(model, TOK, prompts(4), cfg, 16, gen(), refresh=SwapAt(model, states, [2]))
    # the step after the swap is a block's first pass with the new weights (no cache yet): sampled from
    # exactly what the new adapter gives at that state with every position's keys recomputed
    load(model, states[1])
    k = torch.full((4,), 2)
    logp, _, commit = score_rows(model, swapped, torch.arange(4), k, TOK, cfg.temperature)
    assert commit.any() and torch.allclose(logp[commit], swapped.logp[commit], atol=1e-5)
    assert (swapped.step_version[commit] == 1).all()


def test_without_a_swap_a_batch_carries_no_step_versions() -> None:
    model = policy()
    batch = sample(model, TOK, prompts(3), CFG.sampler, 16, torch.Generator().manual_seed(0), policy_version=4,
                   refresh=lambda forwards: None)
    assert batch.step_version is None and torch.equal(batch.versions(), torch.full((3, 16), 4))


def mixed_batch(versions: list[list[int]]) -> "TrajectoryBatch":  # noqa: F821 - a sampled batch, versions per step set by hand
    model = policy()
    batch = sample(model, TOK, prompts(len(versions)), replace(CFG.sampler, steps=4, block_size=4), 16,
                   torch.Generator().manual_seed(1), policy_version=versions[0][0])
    sv = torch.stack([torch.tensor(v)[batch.step_map[b].clamp_min(0)] for b, v in enumerate(versions)])
    batch.step_version, batch.policy_version = sv, torch.tensor([v[0] for v in versions])
    batch.reward = torch.tensor([1.0, 0.0, 1.0, 0.0][:len(versions)])
    batch.advantage = torch.tensor([0.5, -0.5, 0.5, -0.5][:len(versions)])
    batch.group_id = torch.tensor([0, 0, 1, 1][:len(versions)])
    return batch


def test_a_rows_version_is_the_oldest_step_it_scores() -> None:
    batch = mixed_batch([[0, 0, 1, 2], [1, 1, 1, 1], [0, 2, 2, 3], [2, 3, 3, 3]])
    for merge in (1, 2):
        rows = build_rows(batch, 1.0, Draws.seeded(torch.Generator().manual_seed(0), torch.arange(4)), merge=merge)
        got = RecordedStep(rows.bounds).versions(batch, rows.traj, rows.step)
        first = rows.bounds[rows.traj, rows.step] if rows.bounds is not None else rows.step
        end = rows.bounds[rows.traj, rows.step + 1] if rows.bounds is not None else rows.step + 1
        want = [min(batch.step_version[b][(batch.step_map[b] >= f) & (batch.step_map[b] < e)].tolist())
                for b, f, e in zip(rows.traj.tolist(), first.tolist(), end.tolist())]
        assert got.tolist() == want


def _update(batch, oldest):
    model = policy()
    load(model, adapter_state(5, model))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    cfg = replace(CFG.update, num_minibatches=1)
    stats = update_policy(model, opt, batch, cfg, TOK, 1.0, torch.Generator().manual_seed(0), version=3,
                          own=CFG.own(), oldest=oldest)
    return stats, {k: v.detach().clone() for k, v in adapter_tensors(model).items()}


def test_rows_whose_steps_are_older_than_the_bound_are_not_learned_from() -> None:
    batch = mixed_batch([[0, 0, 1, 2], [1, 1, 1, 1], [0, 2, 2, 3], [2, 3, 3, 3]])
    rows = build_rows(batch, CFG.own().step_fraction, Draws.seeded(torch.Generator().manual_seed(0), torch.arange(4)),
                      cover=CFG.own().step_cover)
    versions = RecordedStep(rows.bounds).versions(batch, rows.traj, rows.step)
    stats, _ = _update(batch, oldest=1)
    assert stats["stale_rows"] == float((versions < 1).sum()) > 0
    assert stats["rows"] == float((versions >= 1).sum())
    # nothing older than every step: the update of the whole batch; everything stale: no step at all
    full, after_full = _update(batch, oldest=None)
    same, after_same = _update(batch, oldest=0)
    assert same["stale_rows"] == 0 and all(torch.equal(after_full[k], after_same[k]) for k in after_full)
    none, after_none = _update(batch, oldest=4)
    before = _update(batch.select(torch.arange(0)), oldest=None)[1]
    assert none["rows"] == 0 and all(torch.equal(after_none[k], before[k]) for k in before)


def test_the_verdict_drops_a_batch_only_when_even_its_newest_step_is_too_old(tmp_path: Path) -> None:
    cfg = load_recipe("tiny", ["async_rl.max_staleness=2"])
    ch = BatchChannel(RunStore(str(tmp_path / "run")), cfg)
    batch = mixed_batch([[0, 0, 1, 2], [1, 1, 1, 1]])
    assert ch.verdict(batch, 4) == Verdict.fresh(0)      # steps of version 2 are 2 old: within S
    assert ch.verdict(batch, 5) == Verdict.dropped(5)    # its newest step is 3 old; staleness is its oldest's
    batch.step_version = None                            # no refresh: the row versions (0, 1) say it all
    assert ch.verdict(batch, 3) == Verdict.fresh(0) and ch.verdict(batch, 4) == Verdict.dropped(4)


V1_COLUMNS = {  # the columns (and types) a version-1 reader checks, as that reader states them
    "group_id": pa.int64(), "prompt_ids": pa.list_(pa.int32()), "completion_ids": pa.list_(pa.int32()),
    "step_map": pa.list_(pa.int32()), "behaviour_logp": pa.list_(pa.float32()), "reward": pa.float32(),
    "advantage": pa.float32(), "policy_version": pa.int64(), "nfe": pa.int32(), "sampler_hash": pa.string(),
    "created_at": pa.timestamp("ms", tz="UTC"), "prompt": pa.string(), "completion": pa.string(),
    "meta_json": pa.string()}


def test_step_versions_round_trip_and_a_version_1_reader_still_reads_the_batch() -> None:
    batch = mixed_batch([[0, 0, 1, 2], [1, 1, 1, 1]])
    table = to_arrow(batch)
    back = from_arrow(table)
    assert torch.equal(back.step_version, batch.step_version)
    assert check_schema(table.schema) == 1 and table.schema.metadata[b"miles.schema_version"] == b"1"
    assert all(table.schema.field(n).type.equals(t) for n, t in V1_COLUMNS.items())
    old = from_arrow(table.drop_columns(["step_version"]))  # a batch written before: versions per row
    assert old.step_version is None and torch.equal(old.versions(), batch.policy_version[:, None].expand(2, 16))
    batch.step_version = None
    assert "step_version" not in to_arrow(batch).schema.names  # a batch sampled without refresh: no column


def test_the_samplers_refresh_fetches_in_the_background_and_swaps_at_a_step_boundary(tmp_path: Path) -> None:
    ch = PolicyChannel(RunStore(str(tmp_path / "run")))
    learner, sampler = policy(), policy()
    load(learner, adapter_state(7, learner))
    save_adapter(learner, tmp_path / "v1")
    with InFlightRefresh(ch, sampler, 0, 2, tmp_path / "cache", (0.01, 1.0, 0.01)) as refresh:
        assert refresh(2) is None          # nothing newer published yet
        ch.publish(tmp_path / "v1", 1)
        deadline = time.time() + 30
        while refresh._ready is None and time.time() < deadline:
            time.sleep(0.01)
        assert refresh(3) is None          # fetched, but 3 is not a step it swaps at (every 2)
        before = {k: v.clone() for k, v in adapter_tensors(sampler).items()}
        assert refresh(4) == 1 and refresh(6) is None
    got, want = adapter_tensors(sampler), adapter_tensors(learner)
    assert all(torch.equal(got[k], want[k]) for k in want) and not all(torch.equal(before[k], want[k]) for k in want)
    assert refresh.version == 1 and refresh.span == 1 and refresh.swaps == 1 and refresh.fetched_bytes > 0


def test_a_renoising_sampler_refuses_an_in_flight_refresh() -> None:
    from miles_core.samplers.registry import SAMPLERS
    with pytest.raises(ValueError, match="refresh_every"):
        SAMPLERS["renoise"](None, TOK, [[1]], CFG.sampler, CFG.renoise, 4, torch.Generator(), None, 0, None,
                            lambda forwards: None)
