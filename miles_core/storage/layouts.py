"""How each kind of trajectory batch is stored, keyed by the batch's ``kind`` (types.py).

Why a registry: the store sits on a floor below the models, so it cannot ask a model family what
its batches are. Each batch says its ``kind`` ("masked", "renoise"), each layout module registers
its codec under that kind (storage/renoise.py for renoising batches, storage/trajectories.py for
masked ones), and a file read back is matched by the ``miles.kind`` its schema carries.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa


@dataclass(frozen=True)
class BatchCodec:
    """How one kind of batch is stored: to and from an Arrow table, the schema check a reader
    runs, and the fields its commit marker adds (so readers can plan without reading the data)."""

    kind: str
    schema_version: int
    to_table: Callable[[Any], pa.Table]
    from_table: Callable[[pa.Table], Any]
    check_schema: Callable[[pa.Schema], Any]  # raises SchemaError / ValueError on a foreign schema
    describe: Callable[[Any], dict[str, Any]]


_BY_BATCH_KIND: dict[str, BatchCodec] = {}
DEFAULT_KIND = "masked"  # a file whose schema names no registered layout is checked as a masked batch


def register_layout(batch_kind: str, codec: BatchCodec) -> BatchCodec:
    """Store batches whose ``kind`` is ``batch_kind`` with ``codec``."""
    _BY_BATCH_KIND[batch_kind] = codec
    return codec


def layout_of(batch: Any) -> BatchCodec:
    """The layout a batch is written in (by its ``kind``)."""
    kind = batch.kind
    if kind not in _BY_BATCH_KIND:
        raise ValueError(f"no storage layout for batches of kind {kind!r} (registered: {sorted(_BY_BATCH_KIND)})")
    return _BY_BATCH_KIND[kind]


def layout_read(schema: pa.Schema) -> BatchCodec:
    """The layout a stored file is in (by its schema's ``miles.kind``)."""
    kind = (schema.metadata or {}).get(b"miles.kind", b"").decode()
    return next((c for c in _BY_BATCH_KIND.values() if c.kind == kind), _BY_BATCH_KIND[DEFAULT_KIND])
