"""Reading a public benchmark file: JSONL (optionally .gz), a JSON list, CSV, Parquet, or a folder
of one JSON object per problem (hendrycks/math), from a local path or any fsspec URI, one row at a
time, never downloading anything.

Why rows are skipped and counted rather than raised: a public file with a few malformed rows
(a truncated last line, a row with an empty answer, bytes that are not UTF-8) should still load,
but nobody may be surprised by what it held. Every skipped row gets a message naming the file,
the line (or row) and the field, :class:`LoadReport` keeps the counts and ``miles data check``
prints them. A file that is missing, unreadable, empty, or holds no valid row at all is an error
naming the file (:class:`DataFileError`): a benchmark of zero problems is never a result.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import fsspec

from miles_core.data.arith import Problem

MAX_ERRORS = 50  # messages kept per file; the count of skipped rows is always exact


class DataFileError(ValueError):
    """A data file that cannot be used at all (missing, unreadable, empty, no valid rows)."""


class RowError(ValueError):
    """One row that cannot be used; the message names the field and what is wrong with it."""


@dataclass
class LoadReport:
    """What loading one file gave: the problems, and how many rows were skipped and why."""

    source: str
    problems: list[Problem] = field(default_factory=list)
    skipped: int = 0
    errors: list[str] = field(default_factory=list)  # the first MAX_ERRORS messages

    def skip(self, where: str, why: str) -> None:
        self.skipped += 1
        if len(self.errors) < MAX_ERRORS:
            self.errors.append(f"{self.source}: {where}: {why}")

    def summary(self) -> dict[str, Any]:
        return {"source": self.source, "rows": len(self.problems), "skipped": self.skipped, "errors": self.errors}


def _fmt(uri: str) -> tuple[str, bool]:
    name = uri.lower().split("?")[0]
    gz = name.endswith(".gz")
    name = name[:-3] if gz else name
    for ext in ("jsonl", "json", "csv", "parquet"):
        if name.endswith("." + ext):
            return ext, gz
    return "jsonl", gz  # HumanEval ships as .jsonl.gz, MBPP as .jsonl; other names are read as JSONL


def _read_bytes(uri: str, storage_options: dict | None) -> bytes:
    try:
        with fsspec.open(uri, "rb", **(storage_options or {})) as f:
            data = f.read()
    except FileNotFoundError:
        raise DataFileError(f"{uri}: file not found") from None
    except (OSError, ValueError) as e:
        raise DataFileError(f"{uri}: cannot read ({type(e).__name__}: {e})") from None
    if uri.lower().split("?")[0].endswith(".gz"):
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as e:
            raise DataFileError(f"{uri}: not a valid gzip file ({e})") from None
    if not data.strip():
        raise DataFileError(f"{uri}: the file is empty")
    return data


def iter_rows(uri: str, report: LoadReport, storage_options: dict | None = None) -> Iterator[tuple[str, dict]]:
    """``(where, row)`` for every row that is a JSON object / CSV record; other rows are skipped
    into ``report`` (invalid JSON, not an object, not UTF-8)."""
    fs, root = fsspec.core.url_to_fs(uri, **(storage_options or {}))
    if fs.isdir(root):  # hendrycks/math ships one JSON object per problem: data/train/<subject>/N.json
        files = sorted(p for p in fs.find(root) if p.endswith(".json"))
        if not files:
            raise DataFileError(f"{uri}: a folder without .json files")
        for path in files:
            rel = path[len(root):].lstrip("/")
            try:
                row = json.loads(fs.cat_file(path).decode("utf-8"))
            except (UnicodeDecodeError, ValueError) as e:
                report.skip(rel, f"not a JSON object ({type(e).__name__})")
                continue
            if isinstance(row, dict):
                yield rel, row
            else:
                report.skip(rel, f"expected a JSON object, got {type(row).__name__}")
        return
    fmt, _ = _fmt(uri)
    if fmt == "parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(io.BytesIO(_read_bytes(uri, storage_options)))
        except DataFileError:
            raise
        except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a bad file
            raise DataFileError(f"{uri}: not a readable Parquet file ({type(e).__name__}: {e})") from None
        for i, row in enumerate(table.to_pylist(), start=1):
            yield f"row {i}", row
        return
    data = _read_bytes(uri, storage_options)
    if fmt == "json" and data.lstrip()[:1] == b"[":
        try:
            rows = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            raise DataFileError(f"{uri}: not a valid JSON list ({e})") from None
        for i, row in enumerate(rows, start=1):
            if isinstance(row, dict):
                yield f"item {i}", row
            else:
                report.skip(f"item {i}", f"expected a JSON object, got {type(row).__name__}")
        return
    lines = data.split(b"\n")
    if fmt == "csv":
        yield from _csv_rows(lines, report)
        return
    for lineno, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            row = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            report.skip(f"line {lineno}", f"not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})")
            continue
        except ValueError as e:
            last = lineno == len(lines) or (lineno == len(lines) - 1 and not lines[-1].strip())
            report.skip(f"line {lineno}", f"invalid JSON ({getattr(e, 'msg', e)})"
                        + ("; the file looks truncated" if last else ""))
            continue
        if not isinstance(row, dict):
            report.skip(f"line {lineno}", f"expected a JSON object, got {type(row).__name__}")
            continue
        yield f"line {lineno}", row


def _csv_rows(lines: list[bytes], report: LoadReport) -> Iterator[tuple[str, dict]]:
    text: list[str] = []
    for lineno, raw in enumerate(lines, start=1):
        try:
            text.append(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            report.skip(f"line {lineno}", f"not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})")
            text.append("")
    reader = csv.reader(text)
    header = next(reader, None)
    if not header:
        return
    header = [h.strip() for h in header]
    for values in reader:
        lineno = reader.line_num
        if not any(v.strip() for v in values):
            continue
        if len(values) != len(header):
            report.skip(f"line {lineno}", f"{len(values)} values for {len(header)} columns ({', '.join(header)})")
            continue
        yield f"line {lineno}", dict(zip(header, values))


def load_file(uri: str, parse: Callable[[dict], Problem], storage_options: dict | None = None,
              limit: int | None = None) -> LoadReport:
    """Every valid row of ``uri`` as a Problem (``parse`` raises RowError for a bad one); skipped
    rows are counted in the report. Raises DataFileError when no row is valid."""
    report = LoadReport(uri)
    for where, row in iter_rows(uri, report, storage_options):
        if limit is not None and len(report.problems) >= limit:
            break
        try:
            p = parse(row)
        except RowError as e:
            report.skip(where, str(e))
            continue
        p.meta.setdefault("source", uri)
        p.meta.setdefault("row", where)
        report.problems.append(p)
    if not report.problems:
        first = f"; first problem: {report.errors[0]}" if report.errors else ""
        raise DataFileError(f"{uri}: no valid rows ({report.skipped} skipped){first}")
    return report


def need_str(row: dict, name: str, allow_empty: bool = False) -> str:
    """Field ``name`` as a non-empty string, else RowError naming it."""
    if name not in row or row[name] is None:
        raise RowError(f"missing field {name!r}")
    v = row[name]
    if not isinstance(v, str):
        raise RowError(f"field {name!r} must be a string, got {type(v).__name__}")
    if not allow_empty and not v.strip():
        raise RowError(f"field {name!r} is empty")
    return v


def need_list(row: dict, name: str, item: type, min_len: int = 1) -> list:
    """Field ``name`` as a list of ``item`` (a JSON-encoded list in a CSV cell is accepted)."""
    if name not in row or row[name] is None:
        raise RowError(f"missing field {name!r}")
    v = row[name]
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except ValueError:
            raise RowError(f"field {name!r} must be a list, got the string {v[:40]!r}") from None
    if hasattr(v, "tolist"):  # numpy arrays from Parquet
        v = v.tolist()
    if not isinstance(v, (list, tuple)) or len(v) < min_len:
        raise RowError(f"field {name!r} must be a list of at least {min_len} {item.__name__}")
    if not all(isinstance(x, item) and not isinstance(x, bool) for x in v):
        raise RowError(f"field {name!r} must hold only {item.__name__} values")
    return list(v)
