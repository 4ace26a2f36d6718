"""The ledger: which committed batches the learner has taken, and what became of each.

Exactly-once rests on it (learner/runtime.py): it lives inside the learner checkpoint, next to
the adapter and optimizer it produced, so a resumed learner takes again exactly the batches its
checkpoint does not list. A batch is *consumed* (updated on), *dropped* (staler than
``async_rl.max_staleness``) or *quarantined* (unreadable); each is listed once.

Why a class rather than the lists alone: the learner asks "is this batch handled?" and "what are
the run's totals?" on every poll. Kept as running sets and sums, both cost O(1) per question and
O(1) per new entry, whatever the run's age (over a day at 4,096 GPUs the lists reach ~600k
entries; rebuilding the set and the totals on each poll would take 0.4 s and 0.26 s there).
The checkpoint does not hold the lists: pickling ~600k entries into every checkpoint would take
8.5 s and 34 MB there. Each checkpoint writes what the ledger gained since the one before as one
JSON *part* (``learner/ledger/``, :func:`save_part`) and names the parts that make its ledger, so
a checkpoint costs what changed; a resume reads the parts back (:func:`load`). A checkpoint
written before parts holds the lists themselves, and loads as it did.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Literal

from miles_core.algo.rl import SELF_WORKER
from miles_core.storage.run import RunStore

KINDS = ("consumed", "dropped", "quarantined")


@dataclass(frozen=True)
class Verdict:
    """What one committed batch is worth to an update, decided when it is read (every rank that
    read it decides alike: same bytes, same learner version)."""

    kind: Literal["fresh", "dropped", "quarantined"]
    version: int = -1      # fresh: the policy version that sampled it
    staleness: int = 0     # dropped: learner version minus that version, above the bound
    reason: str = ""       # quarantined: why it could not be read

    @classmethod
    def fresh(cls, version: int) -> "Verdict":
        return cls("fresh", version=version)

    @classmethod
    def dropped(cls, staleness: int) -> "Verdict":
        return cls("dropped", staleness=staleness)

    @classmethod
    def quarantined(cls, reason: str) -> "Verdict":
        return cls("quarantined", reason=reason)


class Ledger:
    """The batches taken, by kind, each an entry dict with its ``id``; running totals beside them.

    ``consumed`` entries: id, staleness, policy_version, learner_version, rows, update.
    ``dropped``: id, staleness. ``quarantined``: id, reason (cut to 300 characters)."""

    def __init__(self, state: dict[str, list[dict[str, Any]]] | None = None, saved: bool = True) -> None:
        """``state``: the lists (:meth:`state`); ``saved``: whether a part already holds them (not
        for the lists of a checkpoint written before parts, which the next part must carry)."""
        self.consumed: list[dict[str, Any]] = []
        self.dropped: list[dict[str, Any]] = []
        self.quarantined: list[dict[str, Any]] = []
        self._handled: set[str] = set()
        self._update_of: dict[str, int] = {}    # consumed id -> its update number
        self.staleness = Counter[int]()        # consumed batches by staleness
        self.completions = 0                   # rows of the consumed batches
        self.self_consumed = 0                 # consumed batches the learner sampled itself
        for kind in KINDS:
            for entry in (state or {}).get(kind, []):
                self._add(kind, dict(entry))
        self._saved = {kind: len(getattr(self, kind)) if saved else 0 for kind in KINDS}

    def _add(self, kind: str, entry: dict[str, Any]) -> None:
        bid = entry["id"]
        if bid in self._handled:
            raise ValueError(f"ledger: batch {bid} is listed already; a batch is taken once")
        getattr(self, kind).append(entry)
        self._handled.add(bid)
        if kind == "consumed":
            self._update_of[bid] = int(entry["update"])
            self.staleness[int(entry["staleness"])] += 1
            self.completions += int(entry["rows"])
            self.self_consumed += bid.endswith(f"-{SELF_WORKER}")

    def consume(self, bid: str, policy_version: int, learner_version: int, rows: int, update: int,
                staleness: int) -> None:
        self._add("consumed", {"id": bid, "staleness": staleness, "policy_version": policy_version,
                               "learner_version": learner_version, "rows": rows, "update": update})

    def drop(self, bid: str, staleness: int) -> None:
        self._add("dropped", {"id": bid, "staleness": staleness})

    def quarantine(self, bid: str, reason: str) -> None:
        self._add("quarantined", {"id": bid, "reason": reason[:300]})

    def __contains__(self, bid: object) -> bool:
        return bid in self._handled

    def __len__(self) -> int:
        """Batches handled, of every kind."""
        return len(self._handled)

    def handled(self) -> frozenset[str]:
        """The ids of every batch listed (a copy: O(N); ask ``bid in ledger`` for one batch)."""
        return frozenset(self._handled)

    def update_of(self, bid: str) -> int | None:
        """The update that consumed ``bid`` (1-based), or None if it was not consumed."""
        return self._update_of.get(bid)

    def max_staleness(self) -> int:
        return max(self.staleness, default=0)

    def unsaved(self) -> dict[str, list[dict[str, Any]]]:
        """The entries added since :meth:`mark_saved`, by kind: what the next part holds."""
        return {kind: getattr(self, kind)[self._saved[kind]:] for kind in KINDS}

    def mark_saved(self) -> None:
        self._saved = {kind: len(getattr(self, kind)) for kind in KINDS}

    def state(self) -> dict[str, list[dict[str, Any]]]:
        """The lists, as the checkpoint and ``history.json`` hold them (the totals are rebuilt on load)."""
        return {kind: getattr(self, kind) for kind in KINDS}


def save_part(rs: RunStore, ledger: Ledger, parts: list[str], version: int) -> list[str]:
    """Write the entries ``ledger`` gained since ``parts`` as one more part -> the parts the next
    checkpoint names (``parts`` itself when nothing changed). Call :meth:`Ledger.mark_saved` once
    that checkpoint is written. A part never overwrites one a checkpoint names: its name holds its
    place in the list, and a lineage resumed from an older checkpoint rewrites only names no
    checkpoint it descends from holds."""
    new = ledger.unsaved()
    if not any(new.values()):
        return parts
    name = f"{len(parts):06d}-v{version:06d}.json"
    rs.write_json(new, "learner", "ledger", name)
    return [*parts, name]


def load(rs: RunStore, stored: dict[str, Any]) -> tuple[Ledger, list[str]]:
    """The ledger a checkpoint names -> (the ledger, its parts). ``stored`` is the checkpoint's
    ``ledger``: ``{"parts": [...]}``, or, written before parts, the lists themselves."""
    if "parts" not in stored:
        return Ledger(stored, saved=False), []
    parts = list(stored["parts"])
    return Ledger(stored_state(rs, stored)), parts


def stored_state(rs: RunStore, stored: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """The lists a checkpoint's ``ledger`` stands for (its parts read back, in order)."""
    if "parts" not in stored:
        return {kind: list(stored.get(kind, [])) for kind in KINDS}
    state: dict[str, list[dict[str, Any]]] = {kind: [] for kind in KINDS}
    for name in stored["parts"]:
        part = rs.read_json("learner", "ledger", name)
        if part is None:
            raise FileNotFoundError(f"{rs.uri}/learner/ledger/{name}: a ledger part the checkpoint names is missing")
        for kind in KINDS:
            state[kind] += part.get(kind, [])
    return state
