"""Storage: trajectory batches (Parquet + commit markers) and adapter versions, through fsspec.

One URI scheme for local folders, ``file://`` and ``s3://`` (ARCHITECTURE.md, "Why each store round trip exists"); see
``SCHEMA.md`` in this folder for the Arrow schema and the commit protocol.
"""

from miles_core.storage.adapters import (
    AdapterExistsError,
    AdapterNotFoundError,
    AdapterRegistry,
    CorruptAdapterError,
)
from miles_core.storage.arrow import KIND, SCHEMA_VERSION, TRAJECTORY_SCHEMA, check_schema, from_arrow, to_arrow
from miles_core.storage.errors import (
    BatchExistsError,
    BatchNotFoundError,
    CorruptBatchError,
    SchemaError,
    StorageError,
)
from miles_core.storage.trajectories import TrajectoryStore, new_batch_id
from miles_core.storage.uri import resolve

__all__ = [
    "KIND",
    "SCHEMA_VERSION",
    "TRAJECTORY_SCHEMA",
    "AdapterExistsError",
    "AdapterNotFoundError",
    "AdapterRegistry",
    "BatchExistsError",
    "BatchNotFoundError",
    "CorruptAdapterError",
    "CorruptBatchError",
    "SchemaError",
    "StorageError",
    "TrajectoryStore",
    "check_schema",
    "from_arrow",
    "new_batch_id",
    "resolve",
    "to_arrow",
]
