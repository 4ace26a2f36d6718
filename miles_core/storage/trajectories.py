"""Trajectory batches as versioned Parquet files with a commit protocol (ARCHITECTURE.md).

Why a commit protocol: samplers and the learner share only object storage, and S3 has no atomic
rename. A batch is visible only once ``commits/{id}.json`` exists, and that marker is written last
with an exclusive create, so a killed writer leaves at most an unlisted data file and a committed
batch is never overwritten. The marker carries the SHA-256 of the Parquet bytes so readers detect
corruption, quarantine the file, and keep going. See ``SCHEMA.md`` next to this file.

The protocol does not depend on what a batch holds: a :class:`BatchCodec` turns a batch into an
Arrow table and back. The default (:data:`DIFFUSION`) holds every batch kind registered in
storage/layouts.py (masked-diffusion and renoising ones), each in its own layout;
continuous trajectories pass theirs (miles_core/continuous/storage.py), so both get the same
markers, checksums and quarantine.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import re
import time
import uuid
from datetime import datetime, timezone
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from miles_core.storage import uri as U
from miles_core.storage.arrow import KIND, SCHEMA_VERSION, check_schema, from_arrow, to_arrow
from miles_core.storage.errors import BatchExistsError, BatchNotFoundError, CorruptBatchError, SchemaError
from miles_core.storage import renoise  # noqa: F401  (registers the renoising layout)
from miles_core.storage.layouts import BatchCodec, layout_of, layout_read, register_layout
from miles_core.types import TrajectoryBatch

log = logging.getLogger(__name__)

_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")


def _describe_discrete(batch: TrajectoryBatch) -> dict[str, Any]:
    pv = batch.policy_version
    return {"completion_len": batch.completion_len,
            "policy_version_min": int(pv.min()) if len(batch) else None,
            "policy_version_max": int(pv.max()) if len(batch) else None,
            "sampler_hash": batch.sampler_hash,
            "created_at": datetime.fromtimestamp(batch.created_at, timezone.utc).isoformat(),
            "created_at_unix": batch.created_at}


# TrajectoryBatch.kind "masked"
DISCRETE = register_layout("masked", BatchCodec(KIND, SCHEMA_VERSION, to_arrow, from_arrow, check_schema,
                                                _describe_discrete))

# The store's default: every registered layout (storage/layouts.py; renoising batches register in
# storage/renoise.py), picked by the batch's ``kind`` when written and the file's ``miles.kind`` when read.
DIFFUSION = BatchCodec(
    KIND, SCHEMA_VERSION,
    to_table=lambda b: layout_of(b).to_table(b),
    from_table=lambda t: layout_read(t.schema).from_table(t),
    check_schema=lambda s: layout_read(s).check_schema(s),
    describe=lambda b: layout_of(b).describe(b))


def new_batch_id() -> str:
    """Sortable unique id: nanosecond wall clock then 8 random hex digits."""
    return f"{time.time_ns():020d}-{uuid.uuid4().hex[:8]}"


# ----------------------------------------------------------------------------------- Store


class TrajectoryStore:
    """Committed trajectory batches under ``root_uri`` (local folder, ``file://`` or ``s3://``).

    Layout: ``batches/{id}/{writer token}.parquet`` (data, one object per writer),
    ``commits/{id}.json`` (marker, written last, naming the data object that counts),
    ``inbox/{id}`` (an empty object per committed batch its reader has not yet retired),
    ``quarantine/{id}/`` (corrupt batches moved aside with ``reason.json``).
    """

    def __init__(self, root_uri: str | os.PathLike[str], storage_options: dict[str, Any] | None = None,
                 codec: BatchCodec = DIFFUSION) -> None:
        self.root_uri = os.fspath(root_uri)
        self.fs, self.root = U.resolve(self.root_uri, storage_options)
        self.codec = codec

    def __repr__(self) -> str:
        return f"TrajectoryStore({self.root_uri!r})"

    def data_path(self, batch_id: str) -> str:
        """The committed data object of ``batch_id``: the file its commit marker names."""
        return U.join(self.root, self.commit_info(batch_id)["file"])

    def _leftovers(self, batch_id: str) -> list[str]:
        """Data objects of ``batch_id`` no marker names: writers that lost, or died before committing
        (and the one-file-per-id layout older stores wrote)."""
        folder, legacy = U.join(self.root, "batches", batch_id), U.join(self.root, "batches", f"{batch_id}.parquet")
        files = [U.join(folder, n) for n in U.list_names(self.fs, folder) if n.endswith(".parquet")]
        return files + ([legacy] if U.exists(self.fs, legacy) else [])

    def marker_path(self, batch_id: str) -> str:
        return U.join(self.root, "commits", f"{batch_id}.json")

    @staticmethod
    def _check_id(batch_id: str) -> None:
        if not isinstance(batch_id, str) or not _ID_RE.match(batch_id) or batch_id.endswith((".json", ".parquet")):
            raise ValueError(f"invalid batch id {batch_id!r}: use letters, digits, '.', '_', '-' (no slashes)")

    def write_batch(self, batch: Any, batch_id: str | None = None) -> str:
        """Write and commit ``batch``; return its id. Raises :class:`BatchExistsError` if committed.

        Order: the data, in an object of this writer's own (``batches/{id}/{token}.parquet``), then
        the marker naming it, with an exclusive create. Only the marker makes it visible, and no
        writer ever touches another's data: two writers of one id (a retried task, a restarted
        sampler whose old process still runs) cannot damage the batch that wins.
        """
        bid = batch_id if batch_id is not None else new_batch_id()
        self._check_id(bid)
        marker = self.marker_path(bid)
        table = self.codec.to_table(batch)
        buf = io.BytesIO()
        pq.write_table(table, buf, compression="zstd")
        data = buf.getvalue()
        rel = f"batches/{bid}/{uuid.uuid4().hex[:16]}.parquet"
        U.write_bytes_atomic(self.fs, U.join(self.root, rel), data)
        info = {"batch_id": bid, "file": rel, "rows": len(batch), "bytes": len(data),
                "sha256": hashlib.sha256(data).hexdigest(), "schema_version": self.codec.schema_version,
                "kind": self.codec.kind, **self.codec.describe(batch),
                "committed_at": datetime.now(timezone.utc).isoformat()}
        try:
            U.create_exclusive(self.fs, marker, U.dumps(info))
        except U.AlreadyExistsError as e:
            try:
                self.fs.rm_file(U.join(self.root, rel))  # ours, never named by a marker
            except OSError:
                pass  # an orphan costs space, never correctness: readers follow markers only
            raise BatchExistsError(f"trajectory batch {bid!r} is already committed ({marker}); not overwriting") from e
        return bid

    def list_batches(self) -> list[str]:
        """Committed batch ids, sorted (ids from :func:`new_batch_id` sort by creation time)."""
        names = U.list_names(self.fs, U.join(self.root, "commits"))
        return sorted(n[: -len(".json")] for n in names if n.endswith(".json") and not n.startswith(".tmp-"))

    # ------------------------------------------------------------------ the inbox
    # Listing commits/ costs one request per 1,000 markers, so a reader polling it pays for every
    # batch the run ever committed (over a day at 4,096 GPUs, ~600 requests a poll). The inbox holds
    # only what its reader has not retired: a writer announces a batch after its commit, the reader
    # retires the batches its checkpoint records as taken, so a listing costs what is in flight.

    def inbox_path(self, batch_id: str) -> str:
        return U.join(self.root, "inbox", batch_id)

    def announce(self, batch_id: str) -> None:
        """Put committed batch ``batch_id`` in the inbox (idempotent: a retried or resumed writer
        announces again). Call it after the commit, so the inbox names no uncommitted batch."""
        self._check_id(batch_id)
        U.write_bytes_atomic(self.fs, self.inbox_path(batch_id), b"")

    def list_inbox(self) -> list[str]:
        """Announced batch ids not yet retired, sorted like :meth:`list_batches`."""
        names = U.list_names(self.fs, U.join(self.root, "inbox"))
        return sorted(n for n in names if _ID_RE.match(n))  # a local temp file (.tmp-...) is no id

    def retire(self, batch_ids: list[str]) -> None:
        """Take ``batch_ids`` out of the inbox (one bulk delete per 1,000 on S3; gone ones ignored).
        Their data and markers stay: retiring is the reader's bookkeeping, not a deletion."""
        paths = [self.inbox_path(b) for b in batch_ids]
        if not paths:
            return
        if U.is_local(self.fs):
            for path in paths:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
            return
        try:
            self.fs.rm(paths)
        except FileNotFoundError:
            pass
        U.refresh(self.fs, U.join(self.root, "inbox"))

    def commit_info(self, batch_id: str) -> dict[str, Any]:
        """The commit marker (rows, sha256, policy version range ...) without reading the data."""
        self._check_id(batch_id)
        marker = self.marker_path(batch_id)
        try:
            return U.read_json(self.fs, marker)
        except FileNotFoundError as e:
            raise BatchNotFoundError(f"no committed trajectory batch {batch_id!r} (missing {marker})") from e
        except ValueError as e:
            raise CorruptBatchError(batch_id, marker, str(e)) from e

    def read_table(self, batch_id: str) -> pa.Table:
        """Read and verify a committed batch as an Arrow table (checksum, row count, schema)."""
        info = self.commit_info(batch_id)
        path = U.join(self.root, info.get("file") or f"batches/{batch_id}.parquet")
        try:
            data = self.fs.cat_file(path)
        except FileNotFoundError as e:
            raise CorruptBatchError(batch_id, path, "data file missing although commit marker exists") from e
        digest = hashlib.sha256(data).hexdigest()
        if digest != info.get("sha256"):
            raise CorruptBatchError(batch_id, path, f"sha256 {digest} does not match commit marker {info.get('sha256')}")
        try:
            table = pq.read_table(pa.BufferReader(data))
        except (pa.ArrowException, OSError, ValueError) as e:
            raise CorruptBatchError(batch_id, path, f"unreadable Parquet ({e})") from e
        try:
            self.codec.check_schema(table.schema)
        except (SchemaError, ValueError) as e:
            raise CorruptBatchError(batch_id, path, f"incompatible schema: {e}") from e
        if table.num_rows != info.get("rows"):
            raise CorruptBatchError(batch_id, path, f"{table.num_rows} rows, commit marker says {info.get('rows')}")
        return table

    def read_batch(self, batch_id: str) -> Any:
        """Read a committed batch; raises :class:`CorruptBatchError` naming the file on any defect."""
        table = self.read_table(batch_id)
        try:
            return self.codec.from_table(table)
        except (SchemaError, ValueError) as e:
            raise CorruptBatchError(batch_id, self.marker_path(batch_id), str(e)) from e

    def _committed_and_leftover_files(self, batch_id: str, has_marker: bool) -> list[str]:
        """Every data object of ``batch_id``, the committed one first (a marker that no longer
        parses names none)."""
        committed: list[str] = []
        if has_marker:
            try:
                committed = [self.data_path(batch_id)]
            except (CorruptBatchError, KeyError):
                committed = []
            committed = [p for p in committed if U.exists(self.fs, p)]
        return committed + [p for p in self._leftovers(batch_id) if p not in committed]

    def quarantine(self, batch_id: str, reason: str) -> str:
        """Move a batch's data and marker to ``quarantine/{id}/`` with ``reason.json``; return that folder.

        The marker is removed first, so the batch leaves :meth:`list_batches` as early as possible.
        """
        self._check_id(batch_id)
        marker = self.marker_path(batch_id)
        has_marker = U.object_exists(self.fs, marker)
        data = self._committed_and_leftover_files(batch_id, has_marker)
        if not (data or has_marker):
            raise BatchNotFoundError(f"nothing to quarantine for batch {batch_id!r} under {self.root_uri}")
        dest = U.join(self.root, "quarantine", batch_id)
        if U.exists(self.fs, dest):
            dest = f"{dest}-{time.time_ns()}"
        record = {"batch_id": batch_id, "reason": reason, "quarantined_at": datetime.now(timezone.utc).isoformat()}
        U.write_bytes_atomic(self.fs, U.join(dest, "reason.json"), U.dumps(record))
        if has_marker:
            self.fs.pipe_file(U.join(dest, f"{batch_id}.json"), self.fs.cat_file(marker))
            self.fs.rm_file(marker)
        for i, path in enumerate(data):  # the committed data first: {id}.parquet
            self.fs.mv(path, U.join(dest, f"{batch_id}.parquet" if i == 0 else f"{batch_id}.{i}.parquet"))
        U.refresh(self.fs, self.root)
        log.warning("quarantined trajectory batch %s -> %s: %s", batch_id, dest, reason)
        return dest

    def list_quarantined(self) -> list[str]:
        """Folder names under ``quarantine/`` (batch ids, with a suffix if quarantined twice)."""
        return U.list_names(self.fs, U.join(self.root, "quarantine"))

