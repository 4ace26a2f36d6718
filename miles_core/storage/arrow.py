"""Trajectory batches <-> Arrow tables with the versioned schema (SCHEMA.md next to this file).

Kept apart from the store so the commit protocol reads on its own: this module knows columns and
dtypes, ``trajectories.py`` knows files, markers and checksums. ``from_arrow(to_arrow(b))`` is an
exact round trip; a table this code cannot read raises :class:`SchemaError` naming the field.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from miles_core.storage.errors import SchemaError
from miles_core.types import TrajectoryBatch

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

# Optional columns: written only when a batch has them, ignored by a reader that does not know them
# (check_schema checks the columns above and no others), so version 1 still names the schema.
# step_version: the adapter version of the step that committed each position (in-flight refresh).
STEP_VERSION = pa.field("step_version", pa.list_(pa.int32()), nullable=False)

_INT32 = np.iinfo(np.int32)


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
    if batch.step_version is not None:
        columns[STEP_VERSION.name] = _fixed_list(batch.step_version, "step_version", np.int32, pa.int32())
        schema = schema.append(STEP_VERSION)
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
    for f in (*TRAJECTORY_SCHEMA, STEP_VERSION):
        idx = schema.get_field_index(f.name)
        if idx < 0:
            if f is STEP_VERSION:  # optional
                continue
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
        step_version=(_fixed_tensor(table, STEP_VERSION.name, torch.long, length)
                      if table.schema.get_field_index(STEP_VERSION.name) >= 0 else None),
    )
