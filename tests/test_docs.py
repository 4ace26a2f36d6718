"""The documentation site builds with ``mkdocs build --strict`` (a broken link, a page missing from
the navigation or a bad anchor fails), its reference pages are generated from the code, and the
README stays a short entry point."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]


def _build(root: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(root / "mkdocs.yml"),
                           "-d", str(out)], capture_output=True, text=True, cwd=root, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "NO_MKDOCS_2_WARNING": "1", "HOME": str(out.parent)})


def test_the_site_builds_strict_with_generated_reference_pages(tmp_path: Path) -> None:
    res = _build(ROOT, tmp_path / "site")
    assert res.returncode == 0, res.stderr[-3000:]
    cli = (tmp_path / "site" / "reference" / "cli" / "index.html").read_text()
    assert "miles export" in cli and "miles train" in cli
    recipe = (tmp_path / "site" / "reference" / "recipe" / "index.html").read_text()
    assert "step_fraction" in recipe and "[1, inf]" in recipe  # a bound, read from the dataclass


def test_a_broken_link_fails_the_build(tmp_path: Path) -> None:
    copy = tmp_path / "repo"
    skip = shutil.ignore_patterns(".venv", ".git", "site", "runs", "mlruns", "__pycache__")
    # the benchmarks' outputs are not the site's (benchmarks/README.md is: a generated page)
    shutil.copytree(ROOT, copy, ignore=lambda d, names: set(skip(d, names)) | ({"results", "tests"} if Path(d).name == "benchmarks" else set()))
    index = copy / "docs" / "index.md"
    index.write_text(index.read_text() + "\nSee [a page that is not there](concepts/missing.md).\n")
    res = _build(copy, tmp_path / "site")
    assert res.returncode != 0 and "missing.md" in res.stderr, res.stderr[-2000:]


def test_the_readme_is_an_entry_point() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 150
    for page in ("docs/getting-started/demo.md", "docs/getting-started/your-model.md", "docs/results/benchmarks.md"):
        assert page in readme and (ROOT / page).exists()
