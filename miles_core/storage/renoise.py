"""Arrow/Parquet layout of renoising trajectories (DiffusionGemma, types.RenoiseBatch).

Why its own layout: a position can change at every step, so ``step_map`` cannot describe the
chain. What is stored is each step's action (the accepted positions, their tokens and behaviour
log-probs) and the row's generator seed; the renoise tokens are never stored, they are replayed
from the seed (samplers/renoise.py::replay_states). A row costs O(sum_k |A_k|), not O(K * L).

Layout, version 1 (one row per trajectory):

  column          Arrow type                  meaning
  group_id        int64, not null             rows with equal id share a prompt (GRPO group)
  prompt_ids      list<int32>, not null       the prompt tokens
  completion_ids  list<int32>, not null       the output canvas (L tokens)
  accepted_pos    list<list<int32>>, not null per executed step, the accepted positions (0..L-1)
  accepted_tok    list<list<int32>>, not null the sampled token at each of them
  accepted_logp   list<list<float32>>, nn     its behaviour log-prob
  num_steps       int32, not null             denoiser calls; = the outer list lengths
  seed            int64, not null             the row's generator seed (init canvas and renoise)
  reward          float32                     null = not scored (NaN in memory)
  advantage       float32                     null = not computed
  policy_version  int64, not null             adapter version that sampled the row
  prompt, completion  string                  decoded text (may be null)
  meta_json       string                      the row's meta (the reward's reference answer), JSON

Schema metadata: ``miles.schema_version`` = "1", ``miles.kind`` = "renoise_trajectory",
``miles.max_steps`` = K, ``miles.canvas_length`` = L, ``miles.sampler_hash``,
``miles.created_at``, ``miles.sampler`` (the sampler's settings, JSON). Stored by TrajectoryStore (same commit markers,
checksums and quarantine as every other kind): its default codec reads ``miles.kind`` and
dispatches, so one store holds either kind.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from miles_core.storage.errors import SchemaError
from miles_core.storage.layouts import BatchCodec, register_layout
from miles_core.types import RenoiseBatch

SCHEMA_VERSION = 1
KIND = "renoise_trajectory"
FIELDS = [
    pa.field("group_id", pa.int64(), nullable=False),
    pa.field("prompt_ids", pa.list_(pa.int32()), nullable=False),
    pa.field("completion_ids", pa.list_(pa.int32()), nullable=False),
    pa.field("accepted_pos", pa.list_(pa.list_(pa.int32())), nullable=False),
    pa.field("accepted_tok", pa.list_(pa.list_(pa.int32())), nullable=False),
    pa.field("accepted_logp", pa.list_(pa.list_(pa.float32())), nullable=False),
    pa.field("num_steps", pa.int32(), nullable=False),
    pa.field("seed", pa.int64(), nullable=False),
    pa.field("reward", pa.float32()),
    pa.field("advantage", pa.float32()),
    pa.field("policy_version", pa.int64(), nullable=False),
    pa.field("prompt", pa.string()),
    pa.field("completion", pa.string()),
    pa.field("meta_json", pa.string()),
]


def to_table(batch: RenoiseBatch) -> pa.Table:
    """RenoiseBatch -> Arrow table (version 1)."""
    assert batch.reward is not None and batch.advantage is not None
    pos, tok, lp = [], [], []
    for b in range(len(batch)):
        k_b = int(batch.num_steps[b])
        acc = batch.accepted[b, :k_b]
        pos.append([acc[k].nonzero().squeeze(1).tolist() for k in range(k_b)])
        tok.append([batch.tokens[b, k][acc[k]].tolist() for k in range(k_b)])
        lp.append([batch.logp[b, k][acc[k]].tolist() for k in range(k_b)])

    def f32(t: torch.Tensor) -> pa.Array:
        a = t.float().numpy()
        return pa.array(a, type=pa.float32(), mask=np.isnan(a))

    def text(xs: list[str]) -> pa.Array:
        return pa.array(xs, type=pa.string()) if xs else pa.nulls(len(batch), type=pa.string())

    cols = [pa.array(batch.group_id.numpy(), type=pa.int64()),
            pa.array(batch.prompt_ids, type=pa.list_(pa.int32())),
            pa.array(batch.completion_ids.tolist(), type=pa.list_(pa.int32())),
            pa.array(pos, type=pa.list_(pa.list_(pa.int32()))), pa.array(tok, type=pa.list_(pa.list_(pa.int32()))),
            pa.array(lp, type=pa.list_(pa.list_(pa.float32()))),
            pa.array(batch.num_steps.numpy().astype(np.int32), type=pa.int32()),
            pa.array(batch.seed.numpy(), type=pa.int64()), f32(batch.reward), f32(batch.advantage),
            pa.array(batch.policy_version.numpy(), type=pa.int64()), text(batch.prompts), text(batch.completions),
            text([json.dumps(m, sort_keys=True) for m in batch.meta])]
    meta = {"miles.schema_version": str(SCHEMA_VERSION), "miles.kind": KIND,
            "miles.max_steps": str(batch.max_steps), "miles.canvas_length": str(batch.completion_len),
            "miles.sampler_hash": batch.sampler_hash, "miles.created_at": repr(float(batch.created_at)),
            "miles.sampler": json.dumps(batch.sampler, sort_keys=True)}
    return pa.Table.from_arrays(cols, schema=pa.schema(FIELDS, metadata=meta))


def check_schema(schema: pa.Schema) -> int:
    """The schema version, or :class:`SchemaError` naming what is wrong."""
    md = {k.decode(): v.decode() for k, v in (schema.metadata or {}).items()}
    if md.get("miles.kind") != KIND:
        raise SchemaError(f"miles.kind is {md.get('miles.kind')!r}, expected {KIND!r}")
    if md.get("miles.schema_version") != str(SCHEMA_VERSION):
        raise SchemaError(f"miles.schema_version {md.get('miles.schema_version')!r} is not supported "
                          f"(this code reads {SCHEMA_VERSION})")
    for f in FIELDS:
        if f.name not in schema.names:
            raise SchemaError(f"column {f.name!r} is missing")
        if not schema.field(f.name).type.equals(f.type):
            raise SchemaError(f"column {f.name!r} has type {schema.field(f.name).type}, expected {f.type}")
    return SCHEMA_VERSION


def from_table(table: pa.Table) -> RenoiseBatch:
    """Arrow table -> RenoiseBatch; a row that contradicts the layout is an error naming it."""
    check_schema(table.schema)
    md = {k.decode(): v.decode() for k, v in table.schema.metadata.items()}
    n, length = int(md["miles.max_steps"]), int(md["miles.canvas_length"])
    d = table.to_pydict()
    b = table.num_rows
    accepted = torch.zeros(b, n, length, dtype=torch.bool)
    tokens = torch.zeros(b, n, length, dtype=torch.long)
    logp = torch.zeros(b, n, length)
    for i in range(b):
        k_b = d["num_steps"][i]
        lists = (d["accepted_pos"][i], d["accepted_tok"][i], d["accepted_logp"][i])
        if not 1 <= k_b <= n or any(len(x) != k_b for x in lists) or len(d["completion_ids"][i]) != length:
            raise SchemaError(f"row {i}: num_steps={k_b}, {[len(x) for x in lists]} recorded steps and "
                              f"{len(d['completion_ids'][i])} completion tokens do not fit max_steps={n}, L={length}")
        for k, (p, t, lp) in enumerate(zip(*lists)):
            if len(p) != len(t) or len(p) != len(lp) or any(not 0 <= q < length for q in p):
                raise SchemaError(f"row {i}, step {k}: accepted_pos {p} / accepted_tok / accepted_logp disagree "
                                  f"or leave the canvas of {length}")
            accepted[i, k, p] = True
            tokens[i, k, p] = torch.tensor(t, dtype=torch.long)
            logp[i, k, p] = torch.tensor(lp, dtype=torch.float32)

    def f(name: str) -> torch.Tensor:
        return torch.tensor([float("nan") if v is None else v for v in d[name]], dtype=torch.float32)

    texts = lambda name: [] if all(v is None for v in d[name]) else [v or "" for v in d[name]]  # noqa: E731
    return RenoiseBatch(
        prompt_ids=d["prompt_ids"], completion_ids=torch.tensor(d["completion_ids"], dtype=torch.long).view(b, length),
        accepted=accepted, tokens=tokens, logp=logp, num_steps=torch.tensor(d["num_steps"], dtype=torch.long),
        seed=torch.tensor(d["seed"], dtype=torch.long), group_id=torch.tensor(d["group_id"], dtype=torch.long),
        policy_version=torch.tensor(d["policy_version"], dtype=torch.long), reward=f("reward"),
        advantage=f("advantage"), prompts=texts("prompt"), completions=texts("completion"),
        meta=[json.loads(m) if m else {} for m in d["meta_json"]], sampler=json.loads(md.get("miles.sampler", "{}")),
        sampler_hash=md["miles.sampler_hash"], created_at=float(md["miles.created_at"]))


def describe(batch: RenoiseBatch) -> dict[str, Any]:
    """The commit marker's fields for a renoising batch (its kind and layout version included)."""
    pv = batch.policy_version
    return {"kind": KIND, "schema_version": SCHEMA_VERSION, "completion_len": batch.completion_len,
            "max_steps": batch.max_steps,
            "policy_version_min": int(pv.min()) if len(batch) else None,
            "policy_version_max": int(pv.max()) if len(batch) else None, "sampler_hash": batch.sampler_hash,
            "created_at": datetime.fromtimestamp(batch.created_at, timezone.utc).isoformat(),
            "created_at_unix": batch.created_at}


# RenoiseBatch.kind "renoise": the store writes and reads renoising batches in this layout.
LAYOUT = register_layout("renoise", BatchCodec(KIND, SCHEMA_VERSION, to_table, from_table, check_schema, describe))
