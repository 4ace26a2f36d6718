"""Storage errors, shared by the trajectory store, the Arrow codec and the adapter registry.

Each names the batch or file at fault, so a caller can quarantine it or report it and go on.
"""

from __future__ import annotations


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
