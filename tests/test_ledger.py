"""The ledger (learner/ledger.py): each batch listed once, its running totals equal to the totals
recomputed from its lists, and a checkpoint's lists (today's and earlier checkpoints') loading back
into the same ledger."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from miles_core.algo.rl import SELF_WORKER, batch_id
from miles_core.learner.ledger import Ledger, Verdict


def _random_ledger(seed: int, n: int = 300) -> Ledger:
    rng, ledger, update = random.Random(seed), Ledger(), 0
    for seq in range(n):
        bid = batch_id(seq, rng.choice(["w0", "w1", SELF_WORKER]))
        kind = rng.choices(["consumed", "dropped", "quarantined"], [8, 2, 1])[0]
        if kind == "consumed":
            update += rng.random() < 0.5
            v = rng.randrange(0, 10)
            ledger.consume(bid, policy_version=v, learner_version=v + 4, rows=rng.choice([8, 16, 24]),
                           update=max(update, 1), staleness=rng.randrange(0, 6))
        elif kind == "dropped":
            ledger.drop(bid, staleness=rng.randrange(6, 9))
        else:
            ledger.quarantine(bid, "sha256 mismatch " + "x" * rng.randrange(0, 500))
    return ledger


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_running_totals_equal_the_totals_recomputed_from_the_lists(seed: int) -> None:
    ledger = _random_ledger(seed)
    st = [e["staleness"] for e in ledger.consumed]
    assert ledger.staleness == Counter(st) and ledger.max_staleness() == max(st)
    assert ledger.completions == sum(e["rows"] for e in ledger.consumed)
    assert ledger.self_consumed == sum(e["id"].endswith(f"-{SELF_WORKER}") for e in ledger.consumed) > 0
    every = [e["id"] for kind in ("consumed", "dropped", "quarantined") for e in getattr(ledger, kind)]
    assert len(ledger) == len(every) == len(set(every)) and ledger.handled() == frozenset(every)
    assert all(bid in ledger for bid in every) and batch_id(10_000, "w0") not in ledger
    assert all(len(e["reason"]) <= 300 for e in ledger.quarantined)
    for e in ledger.consumed:
        assert ledger.update_of(e["id"]) == e["update"]
    assert ledger.update_of(ledger.dropped[0]["id"]) is None


def test_a_checkpoints_lists_load_back_into_the_same_ledger() -> None:
    """What the checkpoint holds is plain lists of dicts (as every earlier checkpoint's ledger was),
    and loading them rebuilds the handled set and the totals."""
    ledger = _random_ledger(3)
    state = ledger.state()
    assert set(state) == {"consumed", "dropped", "quarantined"}
    assert all(type(e) is dict for entries in state.values() for e in entries)
    again = Ledger({k: [dict(e) for e in v] for k, v in state.items()})
    assert again.state() == state and again.handled() == ledger.handled()
    assert (again.staleness, again.completions, again.self_consumed) == (
        ledger.staleness, ledger.completions, ledger.self_consumed)
    legacy = {"consumed": [{"id": "000000-w0", "staleness": 0, "policy_version": 0, "learner_version": 0,
                            "rows": 8, "update": 1}], "dropped": [], "quarantined": []}
    assert Ledger(legacy).completions == 8 and "000000-w0" in Ledger(legacy)


def test_a_batch_is_listed_once_whatever_its_kind() -> None:
    ledger = Ledger()
    ledger.consume("000000-w0", policy_version=0, learner_version=0, rows=8, update=1, staleness=0)
    with pytest.raises(ValueError, match="000000-w0 is listed already"):
        ledger.drop("000000-w0", staleness=9)
    with pytest.raises(ValueError, match="000000-w0 is listed already"):
        Ledger({"consumed": ledger.consumed, "quarantined": [{"id": "000000-w0", "reason": "r"}]})
    assert len(ledger) == 1 and not ledger.dropped


def test_verdicts_are_typed_values_that_compare_and_pickle() -> None:
    import pickle

    v = Verdict.fresh(3)
    assert v.kind == "fresh" and v.version == 3 and pickle.loads(pickle.dumps(v)) == v
    assert Verdict.dropped(7) != Verdict.dropped(6) and Verdict.quarantined("bad").reason == "bad"


def test_each_checkpoint_writes_what_changed_and_a_resume_reads_the_parts_back(tmp_path) -> None:
    """A checkpoint names the ledger's parts and writes one more holding only the entries since
    the one before, so what it pickles does not grow with the run; the parts read back make the
    same ledger, a checkpoint with nothing new writes no part, and the lists of a checkpoint
    written before parts go whole into the first part after it."""
    import pickle

    from miles_core.learner.ledger import load, save_part, stored_state
    from miles_core.storage.run import RunStore

    rs, full = RunStore(str(tmp_path / "run")), _random_ledger(3, 900)
    live, parts, blob_sizes, part_sizes = Ledger(), [], [], []
    state = full.state()
    for cut in range(0, 900, 100):  # nine checkpoints, 100 more batches before each
        chunk = Ledger({k: [e for e in v if int(e["id"].split("-")[0]) < cut + 100] for k, v in state.items()})
        for kind in ("consumed", "dropped", "quarantined"):
            for e in getattr(chunk, kind)[len(getattr(live, kind)):]:
                live._add(kind, dict(e))
        parts = save_part(rs, live, parts, version=cut)
        live.mark_saved()
        blob_sizes.append(len(pickle.dumps({"parts": parts})))
        part_sizes.append(len(rs.fs.cat_file(rs.path("learner", "ledger", parts[-1]))))
    assert len(parts) == 9 and max(blob_sizes) - min(blob_sizes) < 200  # nine names, not 900 entries
    assert max(part_sizes) < 2 * min(part_sizes)                         # each part holds ~100 entries
    assert save_part(rs, live, parts, version=900) == parts              # nothing new: no part
    back, named = load(rs, {"parts": parts})
    assert back.state() == state and named == parts and stored_state(rs, {"parts": parts}) == state
    legacy, none = load(rs, state)                                       # a checkpoint from before parts
    assert none == [] and legacy.state() == state
    first = save_part(rs, legacy, [], version=901)
    assert stored_state(rs, {"parts": first}) == state
    rs.fs.rm_file(rs.path("learner", "ledger", parts[4]))
    with pytest.raises(FileNotFoundError, match="ledger part"):
        load(rs, {"parts": parts})
