"""Trajectory batches as versioned Parquet files with a commit protocol (DESIGN.md section 6).

Why a commit protocol: samplers and the learner share only object storage, and S3 has no atomic
rename. A batch is visible only once ``commits/{id}.json`` exists, and that marker is written last
with an exclusive create, so a killed writer leaves at most an unlisted data file and a committed
batch is never overwritten. The marker carries the SHA-256 of the Parquet bytes so readers detect
corruption, quarantine the file, and keep going. See ``SCHEMA.md`` next to this file.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import math
import os
import re
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime, timezone
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from miles_core.storage import uri as U
from miles_core.types import TrajectoryBatch

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
KIND = "discrete_trajectory"
META_VERSION = b"miles.schema_version"
META_KIND = b"miles.kind"
META_CREATED_AT = b"miles.created_at"  # exact float seconds; the column is only ms precise

TRAJECTORY_SCHEMA = pa.schema(
    [
        pa.field("group_id", pa.int64(), nullable=False),
        pa.field("prompt_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("completion_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("step_map", pa.list_(pa.int32()), nullable=False),
        pa.field("behaviour_logp", pa.list_(pa.float32()), nullable=False),
        pa.field("reward", pa.float32()),  # null = not scored (NaN in memory)
        pa.field("advantage", pa.float32()),  # null = not computed (NaN in memory)
        pa.field("policy_version", pa.int64(), nullable=False),
        pa.field("nfe", pa.int32(), nullable=False),
        pa.field("sampler_hash", pa.string()),
        pa.field("created_at", pa.timestamp("ms", tz="UTC"), nullable=False),
        pa.field("prompt", pa.string()),  # null when the batch carries no text
        pa.field("completion", pa.string()),
        pa.field("meta_json", pa.string()),
    ],
    metadata={META_VERSION: str(SCHEMA_VERSION).encode(), META_KIND: KIND.encode()},
)

_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")
_INT32 = np.iinfo(np.int32)


class StorageError(Exception):
    """Base class for Miles storage errors."""


class BatchExistsError(StorageError, FileExistsError):
    """A batch with this id is already committed (or being committed by another writer)."""


class BatchNotFoundError(StorageError, FileNotFoundError):
    """No committed batch with this id."""


class SchemaError(StorageError, ValueError):
    """An Arrow table does not match the trajectory schema this code understands."""


class CorruptBatchError(StorageError):
    """A committed batch cannot be read: checksum mismatch, unreadable Parquet or wrong schema."""

    def __init__(self, batch_id: str, path: str, reason: str) -> None:
        super().__init__(f"corrupt trajectory batch {batch_id!r} at {path}: {reason}")
        self.batch_id, self.path, self.reason = batch_id, path, reason


def new_batch_id() -> str:
    """Sortable unique id: nanosecond wall clock then 8 random hex digits."""
    return f"{time.time_ns():020d}-{uuid.uuid4().hex[:8]}"


# ----------------------------------------------------------------------------------- Arrow


def _fixed_list(t: torch.Tensor, name: str, np_dtype: Any, pa_type: pa.DataType) -> pa.ListArray:
    b, length = t.shape
    arr = t.detach().cpu().numpy()
    if np.issubdtype(np_dtype, np.integer) and arr.size and (arr.min() < _INT32.min or arr.max() > _INT32.max):
        raise ValueError(f"TrajectoryBatch.{name}: values do not fit int32 storage")
    flat = np.ascontiguousarray(arr.astype(np_dtype, copy=False).reshape(-1))
    offsets = pa.array(np.arange(b + 1, dtype=np.int32) * length, type=pa.int32())
    return pa.ListArray.from_arrays(offsets, pa.array(flat, type=pa_type))


def _optional_strings(values: list[str], b: int, name: str) -> pa.Array:
    if not values:
        return pa.nulls(b, type=pa.string())
    if len(values) != b:
        raise ValueError(f"TrajectoryBatch.{name}: {len(values)} entries for {b} rows")
    return pa.array(values, type=pa.string())


def to_arrow(batch: TrajectoryBatch) -> pa.Table:
    """Convert a batch to an Arrow table with :data:`TRAJECTORY_SCHEMA` (one row per sequence)."""
    b = len(batch)
    assert batch.reward is not None and batch.advantage is not None
    lens = np.array([len(p) for p in batch.prompt_ids], dtype=np.int64)
    flat_prompt = np.array([t for p in batch.prompt_ids for t in p], dtype=np.int64)
    if flat_prompt.size and (flat_prompt.min() < _INT32.min or flat_prompt.max() > _INT32.max):
        raise ValueError("TrajectoryBatch.prompt_ids: values do not fit int32 storage")
    prompt_offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    meta_json: list[str] = []
    for i, m in enumerate(batch.meta):
        try:
            meta_json.append(json.dumps(m, sort_keys=True))
        except (TypeError, ValueError) as e:
            raise ValueError(f"TrajectoryBatch.meta[{i}] is not JSON-serialisable: {e}") from e
    created_ms = int(math.floor(batch.created_at * 1000))

    def f32(t: torch.Tensor) -> pa.Array:
        a = t.detach().cpu().numpy().astype(np.float32)
        return pa.array(a, type=pa.float32(), mask=np.isnan(a))

    columns = {
        "group_id": pa.array(batch.group_id.cpu().numpy().astype(np.int64), type=pa.int64()),
        "prompt_ids": pa.ListArray.from_arrays(
            pa.array(prompt_offsets, type=pa.int32()), pa.array(flat_prompt.astype(np.int32), type=pa.int32())
        ),
        "completion_ids": _fixed_list(batch.completion_ids, "completion_ids", np.int32, pa.int32()),
        "step_map": _fixed_list(batch.step_map, "step_map", np.int32, pa.int32()),
        "behaviour_logp": _fixed_list(batch.logp, "logp", np.float32, pa.float32()),
        "reward": f32(batch.reward),
        "advantage": f32(batch.advantage),
        "policy_version": pa.array(batch.policy_version.cpu().numpy().astype(np.int64), type=pa.int64()),
        "nfe": pa.array(batch.nfe.cpu().numpy().astype(np.int32), type=pa.int32()),
        "sampler_hash": pa.array([batch.sampler_hash] * b, type=pa.string()),
        "created_at": pa.array(np.full(b, created_ms, dtype=np.int64)).cast(pa.timestamp("ms", tz="UTC")),
        "prompt": _optional_strings(batch.prompts, b, "prompts"),
        "completion": _optional_strings(batch.completions, b, "completions"),
        "meta_json": _optional_strings(meta_json, b, "meta"),
    }
    schema = TRAJECTORY_SCHEMA.with_metadata(
        {**TRAJECTORY_SCHEMA.metadata, META_CREATED_AT: repr(float(batch.created_at)).encode()}
    )
    return pa.Table.from_arrays([columns[f.name] for f in schema], schema=schema)


def check_schema(schema: pa.Schema) -> int:
    """Return the schema version, or raise :class:`SchemaError` saying which field is wrong."""
    md = schema.metadata or {}
    if META_VERSION not in md:
        raise SchemaError(f"missing schema metadata {META_VERSION.decode()!r} (not written by Miles?)")
    try:
        version = int(md[META_VERSION])
    except ValueError as e:
        raise SchemaError(f"bad {META_VERSION.decode()}={md[META_VERSION]!r}") from e
    if not 1 <= version <= SCHEMA_VERSION:
        raise SchemaError(f"schema version {version} not supported (this code reads 1..{SCHEMA_VERSION})")
    kind = md.get(META_KIND, b"").decode()
    if kind != KIND:
        raise SchemaError(f"{META_KIND.decode()}={kind!r}, expected {KIND!r}")
    for f in TRAJECTORY_SCHEMA:
        idx = schema.get_field_index(f.name)
        if idx < 0:
            raise SchemaError(f"missing column {f.name!r}")
        if not schema.field(idx).type.equals(f.type):
            raise SchemaError(f"column {f.name!r} has type {schema.field(idx).type}, expected {f.type}")
    return version


def _list_values(table: pa.Table, name: str) -> tuple[np.ndarray, np.ndarray]:
    col = table.column(name).combine_chunks()
    if col.null_count:
        raise SchemaError(f"column {name!r} has {col.null_count} null rows")
    lengths = pc.list_value_length(col).to_numpy(zero_copy_only=False)
    return col.flatten().to_numpy(zero_copy_only=False), lengths


def _fixed_tensor(table: pa.Table, name: str, dtype: torch.dtype, length: int | None) -> torch.Tensor:
    values, lengths = _list_values(table, name)
    b = table.num_rows
    length = int(lengths[0]) if length is None and b else (length or 0)
    if b and not np.all(lengths == length):
        raise SchemaError(f"column {name!r}: ragged rows (lengths {sorted(set(lengths.tolist()))}, expected {length})")
    return torch.from_numpy(np.array(values).reshape(b, length)).to(dtype)


def _strings(table: pa.Table, name: str) -> list[str | None]:
    return table.column(name).to_pylist()


def from_arrow(table: pa.Table) -> TrajectoryBatch:
    """Rebuild a :class:`TrajectoryBatch` from a table written by :func:`to_arrow` (exact round trip)."""
    check_schema(table.schema)
    b = table.num_rows
    completion_ids = _fixed_tensor(table, "completion_ids", torch.long, None)
    length = completion_ids.shape[1]
    pvals, plens = _list_values(table, "prompt_ids")
    splits = np.cumsum(plens)[:-1] if b else []
    prompt_ids = [p.astype(np.int64).tolist() for p in np.split(np.asarray(pvals), splits)] if b else []

    def scalar(name: str, dtype: torch.dtype) -> torch.Tensor:
        col = table.column(name).combine_chunks()
        if pa.types.is_floating(col.type):
            col = pc.fill_null(col, float("nan"))
        elif col.null_count:
            raise SchemaError(f"column {name!r} has {col.null_count} null rows")
        return torch.from_numpy(np.array(col.to_numpy(zero_copy_only=False))).to(dtype)

    prompts, completions, metas = _strings(table, "prompt"), _strings(table, "completion"), _strings(table, "meta_json")
    hashes = [h for h in _strings(table, "sampler_hash") if h]
    created_col = table.column("created_at").cast(pa.int64())
    created = (pc.min(created_col).as_py() or 0) / 1000.0 if b else time.time()
    exact = (table.schema.metadata or {}).get(META_CREATED_AT)
    if exact is not None and (not b or math.floor(float(exact) * 1000) == pc.min(created_col).as_py()):
        created = float(exact)
    try:
        meta = [] if all(m is None for m in metas) else [json.loads(m) if m else {} for m in metas]
    except ValueError as e:
        raise SchemaError(f"column 'meta_json': invalid JSON ({e})") from e
    return TrajectoryBatch(
        prompt_ids=prompt_ids,
        completion_ids=completion_ids,
        step_map=_fixed_tensor(table, "step_map", torch.long, length),
        logp=_fixed_tensor(table, "behaviour_logp", torch.float32, length),
        nfe=scalar("nfe", torch.long),
        group_id=scalar("group_id", torch.long),
        policy_version=scalar("policy_version", torch.long),
        reward=scalar("reward", torch.float32),
        advantage=scalar("advantage", torch.float32),
        prompts=[] if all(p is None for p in prompts) else [p or "" for p in prompts],
        completions=[] if all(c is None for c in completions) else [c or "" for c in completions],
        meta=meta,
        sampler_hash=hashes[0] if hashes else "",
        created_at=created,
    )


# ----------------------------------------------------------------------------------- Store


class TrajectoryStore:
    """Committed trajectory batches under ``root_uri`` (local folder, ``file://`` or ``s3://``).

    Layout: ``batches/{id}.parquet`` (data), ``commits/{id}.json`` (marker, written last),
    ``quarantine/{id}/`` (corrupt batches moved aside with ``reason.json``).
    """

    def __init__(self, root_uri: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> None:
        self.root_uri = os.fspath(root_uri)
        self.fs, self.root = U.resolve(self.root_uri, storage_options)

    def __repr__(self) -> str:
        return f"TrajectoryStore({self.root_uri!r})"

    def data_path(self, batch_id: str) -> str:
        return U.join(self.root, "batches", f"{batch_id}.parquet")

    def marker_path(self, batch_id: str) -> str:
        return U.join(self.root, "commits", f"{batch_id}.json")

    @staticmethod
    def _check_id(batch_id: str) -> None:
        if not isinstance(batch_id, str) or not _ID_RE.match(batch_id) or batch_id.endswith((".json", ".parquet")):
            raise ValueError(f"invalid batch id {batch_id!r}: use letters, digits, '.', '_', '-' (no slashes)")

    def write_batch(self, batch: TrajectoryBatch, batch_id: str | None = None) -> str:
        """Write and commit ``batch``; return its id. Raises :class:`BatchExistsError` if committed.

        Order: data object (exclusive create, or overwrite of an uncommitted leftover from a dead
        writer), then the marker with an exclusive create. Only the marker makes it visible.
        """
        bid = batch_id if batch_id is not None else new_batch_id()
        self._check_id(bid)
        data_path, marker = self.data_path(bid), self.marker_path(bid)
        if U.exists(self.fs, marker):
            raise BatchExistsError(f"trajectory batch {bid!r} is already committed ({marker}); not overwriting")
        table = to_arrow(batch)
        buf = io.BytesIO()
        pq.write_table(table, buf, compression="zstd")
        data = buf.getvalue()
        if U.exists(self.fs, data_path):  # uncommitted leftover of a killed writer: replace it
            U.write_bytes_atomic(self.fs, data_path, data)
        else:
            try:
                U.create_exclusive(self.fs, data_path, data)
            except U.AlreadyExistsError as e:
                raise BatchExistsError(f"trajectory batch {bid!r} is being written by another writer ({data_path})") from e
        pv = batch.policy_version
        info = {
            "batch_id": bid,
            "file": f"batches/{bid}.parquet",
            "rows": len(batch),
            "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
            "schema_version": SCHEMA_VERSION,
            "kind": KIND,
            "completion_len": batch.completion_len,
            "policy_version_min": int(pv.min()) if len(batch) else None,
            "policy_version_max": int(pv.max()) if len(batch) else None,
            "sampler_hash": batch.sampler_hash,
            "created_at": datetime.fromtimestamp(batch.created_at, timezone.utc).isoformat(),
            "created_at_unix": batch.created_at,
            "committed_at": datetime.now(timezone.utc).isoformat(),
        }
        try:
            U.create_exclusive(self.fs, marker, U.dumps(info))
        except U.AlreadyExistsError as e:
            raise BatchExistsError(f"trajectory batch {bid!r} was committed concurrently by another writer ({marker})") from e
        return bid

    def list_batches(self) -> list[str]:
        """Committed batch ids, sorted (ids from :func:`new_batch_id` sort by creation time)."""
        names = U.list_names(self.fs, U.join(self.root, "commits"))
        return sorted(n[: -len(".json")] for n in names if n.endswith(".json") and not n.startswith(".tmp-"))

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
        path = self.data_path(batch_id)
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
            check_schema(table.schema)
        except SchemaError as e:
            raise CorruptBatchError(batch_id, path, f"incompatible schema: {e}") from e
        if table.num_rows != info.get("rows"):
            raise CorruptBatchError(batch_id, path, f"{table.num_rows} rows, commit marker says {info.get('rows')}")
        return table

    def read_batch(self, batch_id: str) -> TrajectoryBatch:
        """Read a committed batch; raises :class:`CorruptBatchError` naming the file on any defect."""
        table = self.read_table(batch_id)
        try:
            return from_arrow(table)
        except (SchemaError, ValueError) as e:
            raise CorruptBatchError(batch_id, self.data_path(batch_id), str(e)) from e

    def quarantine(self, batch_id: str, reason: str) -> str:
        """Move a batch's data and marker to ``quarantine/{id}/`` with ``reason.json``; return that folder.

        The marker is removed first, so the batch leaves :meth:`list_batches` as early as possible.
        """
        self._check_id(batch_id)
        data_path, marker = self.data_path(batch_id), self.marker_path(batch_id)
        has_data, has_marker = U.exists(self.fs, data_path), U.exists(self.fs, marker)
        if not (has_data or has_marker):
            raise BatchNotFoundError(f"nothing to quarantine for batch {batch_id!r} under {self.root_uri}")
        dest = U.join(self.root, "quarantine", batch_id)
        if U.exists(self.fs, dest):
            dest = f"{dest}-{time.time_ns()}"
        record = {"batch_id": batch_id, "reason": reason, "quarantined_at": datetime.now(timezone.utc).isoformat()}
        U.write_bytes_atomic(self.fs, U.join(dest, "reason.json"), U.dumps(record))
        if has_marker:
            self.fs.pipe_file(U.join(dest, f"{batch_id}.json"), self.fs.cat_file(marker))
            self.fs.rm_file(marker)
        if has_data:
            self.fs.mv(data_path, U.join(dest, f"{batch_id}.parquet"))
        U.refresh(self.fs, self.root)
        log.warning("quarantined trajectory batch %s -> %s: %s", batch_id, dest, reason)
        return dest

    def list_quarantined(self) -> list[str]:
        """Folder names under ``quarantine/`` (batch ids, with a suffix if quarantined twice)."""
        return U.list_names(self.fs, U.join(self.root, "quarantine"))

    def delete_batch(self, batch_id: str) -> None:
        """Uncommit (marker first) and delete a batch. Raises :class:`BatchNotFoundError` if absent."""
        self._check_id(batch_id)
        data_path, marker = self.data_path(batch_id), self.marker_path(batch_id)
        found = False
        for path in (marker, data_path):
            if U.exists(self.fs, path):
                self.fs.rm_file(path)
                found = True
        U.refresh(self.fs, self.root)
        if not found:
            raise BatchNotFoundError(f"no trajectory batch {batch_id!r} under {self.root_uri}")

    def iter_new(
        self,
        consumed: Iterable[str],
        on_corrupt: Callable[[CorruptBatchError], None] | None = None,
        quarantine_corrupt: bool = True,
    ) -> Iterator[tuple[str, TrajectoryBatch]]:
        """Yield ``(id, batch)`` for committed batches not in ``consumed``, oldest first.

        Corrupt batches are quarantined (by default) and reported via ``on_corrupt`` and a log
        warning instead of stopping the stream: one bad file must not stall the learner.
        """
        seen = set(consumed)
        for bid in self.list_batches():
            if bid in seen:
                continue
            try:
                batch = self.read_batch(bid)
            except BatchNotFoundError:  # deleted or quarantined meanwhile
                continue
            except CorruptBatchError as e:
                log.warning("%s", e)
                if quarantine_corrupt:
                    try:
                        self.quarantine(bid, str(e))
                    except BatchNotFoundError:
                        pass
                if on_corrupt is not None:
                    on_corrupt(e)
                continue
            yield bid, batch
