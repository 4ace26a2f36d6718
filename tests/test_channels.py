"""The asynchronous protocol's two channels on a local run store: admission at its boundary, the
staleness verdict at its bound, a commit made twice, a published version loaded into a model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_storage import make_batch

from miles_core.config import load_recipe
from miles_core.learner.channels import BatchChannel, PolicyChannel, admits, uses_inbox
from miles_core.learner.ledger import Verdict
from miles_core.models.lora import add_lora, adapter_tensors, save_adapter
from miles_core.models.tiny import TinyConfig, TinyDenoiser
from miles_core.storage.run import RunStore


def test_the_batch_channel_admits_judges_and_commits_once(tmp_path: Path) -> None:
    cfg = load_recipe("tiny", ["async_rl.max_staleness=2"])
    ch = BatchChannel(RunStore(str(tmp_path / "run")), cfg)
    b = cfg.batches_per_update()
    for v in (0, 3):  # slot k starts only while k < (S + v + 1) B
        assert ch.admits((2 + v + 1) * b - 1, v) and not ch.admits((2 + v + 1) * b, v)
    assert admits(9, 1, 3, 2) and not admits(12, 1, 3, 2)
    assert admits(13, 1, 3, 2, passed=2) and not admits(14, 1, 3, 2, passed=2)  # 2 dropped: 2 more slots
    batch = make_batch(version=3)  # rows sampled by versions 3 and 2: fresh while its newest is within S
    assert ch.verdict(batch, 4) == Verdict.fresh(2) and ch.verdict(batch, 5) == Verdict.fresh(2)
    assert ch.verdict(batch, 6) == Verdict.dropped(4)  # the staleness of its oldest rows
    assert ch.commit(batch, "000000-w0") and not ch.commit(make_batch(seed=1), "000000-w0")
    assert ch.rs.trajectories.list_batches() == ["000000-w0"]
    stored = ch.rs.trajectories.read_batch("000000-w0")
    assert torch.equal(stored.completion_ids, batch.completion_ids)  # the first commit counts


def _lora(seed: int) -> torch.nn.Module:
    torch.manual_seed(0)
    model = add_lora(TinyDenoiser(TinyConfig(40, 16, 1, 2, 32, 32)), 4, 8, 0.0)
    with torch.no_grad():
        for p in adapter_tensors(model).values():
            p.normal_(0, 1, generator=torch.Generator().manual_seed(seed))
    return model


def test_the_policy_channel_publishes_and_loads_a_version_in_place(tmp_path: Path) -> None:
    ch = PolicyChannel(RunStore(str(tmp_path / "run")))
    assert ch.latest() is None
    learner, sampler = _lora(1), _lora(2)
    save_adapter(learner, tmp_path / "v1")
    ch.publish(tmp_path / "v1", 1)
    ch.publish(tmp_path / "v1", 1)  # a retried publish of a committed version changes nothing
    assert ch.latest() == 1
    before = {k: v.data_ptr() for k, v in adapter_tensors(sampler).items()}
    ch.load_into(sampler, 1, tmp_path / "fetched")
    got, want = adapter_tensors(sampler), adapter_tensors(learner)
    assert all(torch.equal(got[k], want[k]) for k in want) and {k: v.data_ptr() for k, v in got.items()} == before
    deeper = add_lora(TinyDenoiser(TinyConfig(40, 16, 2, 2, 32, 32)), 4, 8, 0.0)  # a layer the sampler lacks
    save_adapter(deeper, tmp_path / "v2")
    ch.publish(tmp_path / "v2", 2)
    with pytest.raises(ValueError, match="adapter v2 does not fit this model: unexpected keys"):
        ch.load_into(sampler, 2, tmp_path / "v2-fetched")


def test_an_inbox_channel_announces_each_commit_and_lists_only_what_is_not_retired(tmp_path: Path) -> None:
    """A run created with the inbox: every commit is announced (a second commit of the same id
    announces again, repairing an announcement its first writer never made), the learner's listing
    is the inbox, and retiring takes batches out of it without touching their markers or data. A
    run without it (an older run.json) is listed by its markers."""
    cfg = load_recipe("tiny", [])
    rs = RunStore(str(tmp_path / "run"))
    ch = BatchChannel(rs, cfg, inbox=True)
    for i in range(3):
        assert ch.commit(make_batch(seed=i), f"00000{i}-w0")
    assert ch.waiting() == rs.trajectories.list_inbox() == ["000000-w0", "000001-w0", "000002-w0"]
    rs.trajectories.retire(["000000-w0", "000001-w0", "gone-already"])
    assert ch.waiting() == ["000002-w0"] and len(rs.trajectories.list_batches()) == 3
    rs.trajectories.retire(["000002-w0"])
    assert not ch.commit(make_batch(seed=7), "000002-w0") and ch.waiting() == ["000002-w0"]
    assert rs.trajectories.read_batch("000000-w0") is not None  # retired, still readable
    legacy = BatchChannel(rs, cfg)
    assert legacy.waiting() == rs.trajectories.list_batches()
    assert uses_inbox({"protocol": {"inbox": True}}) and not uses_inbox({"cfg": {}})


def test_latest_names_the_batches_passed_without_an_update_so_a_drop_frees_its_slot(tmp_path: Path) -> None:
    ch = PolicyChannel(RunStore(str(tmp_path / "run")))
    assert ch.admission() == (None, 0)
    ch.pass_on(3)  # nothing published yet: nothing to rewrite, and no sampler is admitted before v0
    assert ch.admission() == (None, 0)
    save_adapter(_lora(1), tmp_path / "v0")
    ch.publish(tmp_path / "v0", 0, passed=1)
    assert ch.admission() == (0, 1) and ch.latest() == 0
    ch.pass_on(4)  # a drop between two versions: the same version, the new count
    assert ch.admission() == (0, 4) and ch.latest() == 0
