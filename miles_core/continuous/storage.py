"""Arrow/Parquet layout for recorded continuous trajectories (per-step latents).

Why a separate layout from the discrete one: a continuous state cannot be rebuilt from the final
sample the way a masked state is rebuilt from ``step_map``, so every state x_k is stored. Latents
are small (K + 1 states of D floats), so this stays O(K * D) per trajectory.

Layout, version 1 (one row per trajectory; B rows, K steps, D latent dims, P prompt width):

  column           Arrow type            meaning
  group_id         int64, not null       rows with equal id share a prompt (GRPO group)
  prompt           string, not null      the prompt text
  prompt_ids       list<int32>, not null the condition, right-padded to P
  latents          list<float32>, nn     x_0 ... x_K flattened row-major: (K + 1) * D values,
                                         element [k * D + d] is dim d of the state before step k
  behaviour_logp   list<float32>, nn     K Gaussian transition log-probs, summed over D
  reward           float32               null = not scored (NaN in memory)
  advantage        float32               null = not computed (NaN in memory)
  policy_version   int64, not null       adapter version that sampled the row

Schema metadata (UTF-8 JSON values): ``miles.schema_version`` = "1", ``miles.kind`` =
"continuous_trajectory", ``miles.latent_shape`` = [K + 1, D], ``miles.prompt_len`` = P,
``miles.timesteps`` = the K + 1 grid timesteps, ``miles.eta`` = the sampler's eta. Shapes live in
the metadata so list lengths are checked on read; a file that disagrees is rejected naming the
column. Batches are stored by :class:`~miles_core.storage.trajectories.TrajectoryStore` with the
:data:`CONTINUOUS` codec: data file, then an exclusively created commit marker with its SHA-256,
and a corrupt batch quarantined, exactly as discrete batches (a path or an ``s3://`` URI).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from miles_core.continuous.sde import ContinuousBatch
from miles_core.storage.trajectories import BatchCodec, TrajectoryStore

SCHEMA_VERSION = 1
KIND = "continuous_trajectory"
_META_KEYS = ("miles.schema_version", "miles.kind", "miles.latent_shape", "miles.prompt_len", "miles.timesteps", "miles.eta")

BASE_FIELDS = [
    pa.field("group_id", pa.int64(), nullable=False),
    pa.field("prompt", pa.string(), nullable=False),
    pa.field("prompt_ids", pa.list_(pa.int32()), nullable=False),
    pa.field("latents", pa.list_(pa.float32()), nullable=False),
    pa.field("behaviour_logp", pa.list_(pa.float32()), nullable=False),
    pa.field("reward", pa.float32()),
    pa.field("advantage", pa.float32()),
    pa.field("policy_version", pa.int64(), nullable=False),
]


class ContinuousSchemaError(ValueError):
    """A table or file does not match the continuous trajectory layout."""


def schema_for(batch: ContinuousBatch) -> pa.Schema:
    meta = {"miles.schema_version": str(SCHEMA_VERSION), "miles.kind": KIND,
            "miles.latent_shape": json.dumps(list(batch.latents.shape[1:])),
            "miles.prompt_len": json.dumps(int(batch.prompt_ids.shape[1])),
            "miles.timesteps": json.dumps(batch.timesteps.tolist()), "miles.eta": json.dumps(batch.eta)}
    return pa.schema(BASE_FIELDS, metadata=meta)


def _list_column(values: np.ndarray, typ: pa.DataType) -> pa.Array:
    """[B, n] -> list<typ> with B entries of length n (no per-row Python objects)."""
    b, n = values.shape
    offsets = pa.array(np.arange(0, (b + 1) * n, n, dtype=np.int32) if b else np.zeros(1, dtype=np.int32))
    return pa.ListArray.from_arrays(offsets, pa.array(values.reshape(-1), type=typ))


def _nullable(values: torch.Tensor) -> pa.Array:
    arr = values.float().numpy()
    return pa.array(arr, type=pa.float32(), mask=np.isnan(arr))


def to_table(batch: ContinuousBatch) -> pa.Table:
    """ContinuousBatch -> Arrow table in the version-1 layout."""
    assert batch.reward is not None and batch.advantage is not None
    b = len(batch)
    cols = [
        pa.array(batch.group_id.numpy(), type=pa.int64()),
        pa.array(batch.prompts, type=pa.string()),
        _list_column(batch.prompt_ids.numpy().astype(np.int32), pa.int32()),
        _list_column(batch.latents.float().numpy().reshape(b, -1), pa.float32()),
        _list_column(batch.logp.float().numpy(), pa.float32()),
        _nullable(batch.reward),
        _nullable(batch.advantage),
        pa.array(batch.policy_version.numpy(), type=pa.int64()),
    ]
    return pa.Table.from_arrays(cols, schema=schema_for(batch))


def _meta(table: pa.Table, source: str) -> dict[str, Any]:
    raw = table.schema.metadata or {}
    kind = raw.get(b"miles.kind", b"").decode()
    if kind and kind != KIND:  # a batch of another kind first: that is what is wrong, not a missing key
        raise ContinuousSchemaError(f"{source}: miles.kind is {kind!r}, expected {KIND!r}")
    out: dict[str, Any] = {}
    for key in _META_KEYS:
        if key.encode() not in raw:
            raise ContinuousSchemaError(f"{source}: schema metadata {key!r} is missing")
        text = raw[key.encode()].decode()
        out[key] = text if key == "miles.kind" else json.loads(text)
    if out["miles.kind"] != KIND:
        raise ContinuousSchemaError(f"{source}: miles.kind is {out['miles.kind']!r}, expected {KIND!r}")
    if int(out["miles.schema_version"]) != SCHEMA_VERSION:
        raise ContinuousSchemaError(f"{source}: miles.schema_version {out['miles.schema_version']} is not supported "
                                    f"(this code reads version {SCHEMA_VERSION})")
    return out


def _fixed(table: pa.Table, name: str, width: int, source: str) -> np.ndarray:
    """list column -> [B, width] numpy, checking every row's length."""
    col = table.column(name).combine_chunks()
    lengths = col.value_lengths().to_numpy(zero_copy_only=False)
    bad = np.nonzero(lengths != width)[0]
    if bad.size:
        raise ContinuousSchemaError(f"{source}: column {name!r} row {int(bad[0])} has {int(lengths[bad[0]])} values, "
                                    f"expected {width} (from the schema metadata)")
    return col.flatten().to_numpy(zero_copy_only=False).reshape(len(table), width)


def from_table(table: pa.Table, source: str = "table") -> ContinuousBatch:
    """Arrow table in the version-1 layout -> ContinuousBatch; mismatches name the column."""
    meta = _meta(table, source)
    missing = [f.name for f in BASE_FIELDS if f.name not in table.column_names]
    if missing:
        raise ContinuousSchemaError(f"{source}: missing column(s) {missing}")
    steps_plus_one, dim = meta["miles.latent_shape"]
    k = steps_plus_one - 1
    if len(meta["miles.timesteps"]) != steps_plus_one:
        raise ContinuousSchemaError(f"{source}: miles.timesteps has {len(meta['miles.timesteps'])} entries, "
                                    f"expected {steps_plus_one} (latent_shape[0])")
    b = len(table)

    def floats(name: str) -> torch.Tensor:
        return torch.from_numpy(table.column(name).to_numpy(zero_copy_only=False).astype(np.float32))

    return ContinuousBatch(
        prompts=table.column("prompt").to_pylist(),
        prompt_ids=torch.from_numpy(_fixed(table, "prompt_ids", meta["miles.prompt_len"], source).astype(np.int64)),
        latents=torch.from_numpy(_fixed(table, "latents", steps_plus_one * dim, source).astype(np.float32)).view(b, steps_plus_one, dim),
        timesteps=torch.tensor(meta["miles.timesteps"], dtype=torch.long),
        logp=torch.from_numpy(_fixed(table, "behaviour_logp", k, source).astype(np.float32)),
        eta=float(meta["miles.eta"]),
        group_id=torch.from_numpy(table.column("group_id").to_numpy().astype(np.int64)),
        policy_version=torch.from_numpy(table.column("policy_version").to_numpy().astype(np.int64)),
        reward=floats("reward"),
        advantage=floats("advantage"),
    )


def _check(schema: pa.Schema) -> None:
    """What a store reader checks before decoding: the kind and version in the schema metadata."""
    _meta(pa.table({}, schema=pa.schema([], metadata=schema.metadata)), "continuous batch")


def _describe(batch: ContinuousBatch) -> dict[str, Any]:
    pv = batch.policy_version
    return {"num_steps": batch.num_steps, "latent_dim": int(batch.latents.shape[-1]),
            "policy_version_min": int(pv.min()) if len(batch) else None,
            "policy_version_max": int(pv.max()) if len(batch) else None}


# Continuous batches in a TrajectoryStore: the same commit markers, checksums and quarantine as
# discrete ones, e.g. ``TrajectoryStore(f"{run}/trajectories", codec=CONTINUOUS)``.
CONTINUOUS = BatchCodec(KIND, SCHEMA_VERSION, to_table, lambda t: from_table(t, "continuous batch"), _check, _describe)


def continuous_store(root_uri: str, storage_options: dict[str, Any] | None = None) -> TrajectoryStore:
    """A trajectory store of continuous batches under ``root_uri`` (local folder or ``s3://``)."""
    return TrajectoryStore(root_uri, storage_options, codec=CONTINUOUS)
