"""Numbered LoRA adapter versions in the same store as the trajectories (ARCHITECTURE.md, "Why each store round trip exists").

Why: the learner publishes adapters that samplers hot-swap, and both sides only share storage.
A version folder ``adapters/v{N:06d}/`` counts only once its ``COMMITTED`` marker (written last,
exclusive create) exists, so a sampler never loads a half-uploaded adapter and a publisher that
died half-way leaves nothing visible. ``adapters/LATEST`` is a cheap pointer for polling.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from miles_core.storage import uri as U
from miles_core.storage.errors import StorageError

COMMITTED = "COMMITTED"
METADATA_FILE = "miles_metadata.json"
RESERVED = frozenset({COMMITTED, METADATA_FILE})
_VERSION_RE = re.compile(r"^v(\d{6,})$")


class AdapterExistsError(StorageError, FileExistsError):
    """This adapter version is already committed."""


class AdapterNotFoundError(StorageError, FileNotFoundError):
    """No committed adapter with this version."""


class CorruptAdapterError(StorageError):
    """A fetched adapter file does not match the checksum recorded at publish time."""


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks (adapter manifests and checkpoint digests)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class AdapterRegistry:
    """Publish / fetch PEFT adapter folders as numbered versions under ``{root_uri}/adapters/``."""

    def __init__(self, root_uri: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> None:
        self.root_uri = os.fspath(root_uri)
        self.fs, root = U.resolve(self.root_uri, storage_options)
        self.root = U.join(root, "adapters")

    def __repr__(self) -> str:
        return f"AdapterRegistry({self.root_uri!r})"

    def version_path(self, version: int) -> str:
        return U.join(self.root, f"v{int(version):06d}")

    def is_committed(self, version: int) -> bool:
        return U.object_exists(self.fs, U.join(self.version_path(version), COMMITTED))

    def versions(self) -> list[int]:
        """Committed versions, ascending. Uncommitted (half-published) folders are ignored."""
        U.refresh(self.fs, self.root)
        found: set[int] = set()
        for path in self.fs.glob(U.join(self.root, "v*", COMMITTED)):
            m = _VERSION_RE.match(str(path).rstrip("/").split("/")[-2])
            if m:
                found.add(int(m.group(1)))
        return sorted(found)

    def pointer(self) -> int | None:
        """The version ``LATEST`` names: one small read, what pollers read (moved after the commit)."""
        doc = self.pointer_doc()
        return None if doc is None else doc["version"]

    def pointer_doc(self) -> dict[str, Any] | None:
        """The whole ``LATEST`` document (the version and what the publisher added), one small read."""
        try:
            doc = U.read_json(self.fs, U.join(self.root, "LATEST"))
        except (FileNotFoundError, ValueError):
            return None
        return doc if isinstance(doc, dict) and isinstance(doc.get("version"), int) else None

    def _write_pointer(self, version: int, fields: dict[str, Any] | None) -> None:
        U.write_bytes_atomic(self.fs, U.join(self.root, "LATEST"), U.dumps({**(fields or {}), "version": version}))

    def latest_version(self) -> int | None:
        """Latest committed version: the ``LATEST`` pointer if it names a committed version, else a scan."""
        v = self.pointer()
        if v is not None and self.is_committed(v):
            return v
        committed = self.versions()
        return committed[-1] if committed else None

    def publish(
        self, local_adapter_dir: str | os.PathLike[str], metadata: dict[str, Any] | None = None, version: int | None = None,
        pointer: dict[str, Any] | None = None,
    ) -> int:
        """Upload every file of ``local_adapter_dir`` as the next version (or ``version``); return it.

        Files first, then ``miles_metadata.json``, then ``COMMITTED`` (exclusive create), then the
        ``LATEST`` pointer (only moved forward). An uncommitted leftover folder at the chosen number
        is wiped and reused, so numbers stay contiguous after a crash; a committed one raises
        :class:`AdapterExistsError`. Assumes one publisher per registry (the learner). ``pointer``:
        fields the publisher adds to ``LATEST`` beside the version (what pollers read in the same GET).
        """
        src = Path(local_adapter_dir)
        if not src.is_dir():
            raise FileNotFoundError(f"adapter folder {src} does not exist")
        files = sorted(p for p in src.rglob("*") if p.is_file())
        if not files:
            raise ValueError(f"adapter folder {src} is empty")
        rels = [p.relative_to(src).as_posix() for p in files]
        clash = RESERVED.intersection(rels)
        if clash:
            raise ValueError(f"adapter folder {src} contains reserved file name(s) {sorted(clash)}")
        if version is None:
            committed = self.versions()
            version = committed[-1] + 1 if committed else 1
        if version < 0:
            raise ValueError(f"adapter version must be >= 0, got {version}")
        vdir = self.version_path(version)
        if self.is_committed(version):
            raise AdapterExistsError(f"adapter version {version} is already committed at {vdir}")
        if U.exists(self.fs, vdir):  # leftover of a publisher that died before committing
            self.fs.rm(vdir, recursive=True)
            U.refresh(self.fs, vdir)
        manifest: dict[str, Any] = {}
        for path, rel in zip(files, rels):
            self.fs.put_file(str(path), U.join(vdir, rel))
            manifest[rel] = {"sha256": sha256_file(path), "bytes": path.stat().st_size}
        now = datetime.now(timezone.utc).isoformat()
        record = {"version": version, "published_at": now, "files": manifest, "metadata": dict(metadata or {})}
        try:
            meta_bytes = U.dumps(record)
        except (TypeError, ValueError) as e:
            raise ValueError(f"adapter metadata is not JSON-serialisable: {e}") from e
        U.write_bytes_atomic(self.fs, U.join(vdir, METADATA_FILE), meta_bytes)
        try:
            U.create_exclusive(self.fs, U.join(vdir, COMMITTED), U.dumps({"version": version, "files": manifest}))
        except U.AlreadyExistsError as e:
            raise AdapterExistsError(f"adapter version {version} was committed concurrently at {vdir}") from e
        current = self.pointer()
        if current is None or version > current or not self.is_committed(current):
            self._write_pointer(version, pointer)
        return version

    def repoint(self, fields: dict[str, Any]) -> bool:
        """Rewrite ``LATEST`` with new publisher ``fields``, naming the same version (one publisher)
        -> False when nothing is published yet (there is no pointer to rewrite)."""
        v = self.pointer()
        if v is None:
            return False
        self._write_pointer(v, fields)
        return True

    def manifest(self, version: int) -> dict[str, Any]:
        """The publish record: ``version``, ``published_at``, ``files`` (sha256, bytes), ``metadata``."""
        vdir = self.version_path(version)
        if not self.is_committed(version):
            raise AdapterNotFoundError(f"no committed adapter version {version} at {vdir}")
        try:
            return U.read_json(self.fs, U.join(vdir, METADATA_FILE))
        except (FileNotFoundError, ValueError) as e:
            raise CorruptAdapterError(f"adapter version {version}: bad {U.join(vdir, METADATA_FILE)} ({e})") from e

    def metadata(self, version: int) -> dict[str, Any]:
        """The user metadata passed to :meth:`publish` for this version."""
        return dict(self.manifest(version).get("metadata") or {})

    def fetch(self, version: int, local_dir: str | os.PathLike[str], manifest: dict[str, Any] | None = None) -> Path:
        """Download a committed version to ``local_dir`` (ready for ``PeftModel.from_pretrained``).

        Files land in a temporary sibling folder and are checksum-verified before being moved into
        place, so ``local_dir`` never holds a half-downloaded adapter. ``manifest``: this version's
        :meth:`manifest`, when the caller has read it already (saves a round trip per sync).
        """
        files: dict[str, Any] = (manifest or self.manifest(version))["files"]
        vdir = self.version_path(version)
        dest = Path(local_dir)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.parent / f".{dest.name}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            for rel, info in files.items():
                target = tmp / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                self.fs.get_file(U.join(vdir, rel), str(target))
                digest = sha256_file(target)
                if digest != info["sha256"]:
                    raise CorruptAdapterError(f"{U.join(vdir, rel)}: sha256 {digest} != published {info['sha256']}")
            if not dest.exists() or (dest.is_dir() and not any(dest.iterdir())):
                if dest.exists():
                    dest.rmdir()
                os.replace(tmp, dest)
            else:
                for rel in files:
                    (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                    os.replace(tmp / rel, dest / rel)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        return dest
