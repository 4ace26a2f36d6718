"""The layering contracts (ARCHITECTURE.md, "Floors"), checked two independent ways.

Why both: import-linter follows the real import graph (including indirect chains such as
miles_core -> tasks -> prefect) but only sees module-level imports that grimp resolves; the AST
scan also catches imports hidden inside functions and ``importlib.import_module("...")`` calls.
Each checker is also run against a synthetic violating tree, so a broken checker cannot pass.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / ".importlinter"

# package folder -> top-level modules it must never import
RULES: dict[str, frozenset[str]] = {
    "miles_core": frozenset({"prefect", "mlflow", "tracking", "tasks", "flows", "miles"}),
    "tracking": frozenset({"tasks", "flows", "miles"}),
    "tasks": frozenset({"flows", "miles"}),
    "flows": frozenset({"torch", "miles"}),
    "tests": frozenset({"benchmarks"}),
    "tools": frozenset({"benchmarks"}),
}


@dataclass(frozen=True)
class Violation:
    path: Path
    line: int
    module: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line} imports {self.module}"


def _imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """Absolute module names imported anywhere in ``tree`` (top level, functions, dynamic)."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                found.append((node.lineno, node.args[0].value))
    return found


def scan(package_dir: Path, forbidden: frozenset[str]) -> list[Violation]:
    """Every import of a forbidden top-level module under ``package_dir``."""
    if not package_dir.is_dir():
        raise FileNotFoundError(f"layering scan: package folder {package_dir} does not exist")
    out: list[Violation] = []
    for path in sorted(package_dir.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for line, module in _imported_modules(tree):
            if module.split(".")[0] in forbidden:
                out.append(Violation(path.relative_to(package_dir.parent), line, module))
    return out


def lint_imports(cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run import-linter with the repo's contract file against the packages under ``cwd``."""
    exe = Path(sys.executable).with_name("lint-imports")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "importlinter.cli"]
    return subprocess.run([*cmd, str(CONFIG), "--no-cache"], cwd=cwd, capture_output=True,
                          text=True, timeout=300, env={**_clean_env(), "PYTHONPATH": str(cwd)})


def _clean_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


# A tree shaped like the repo whose every layer breaks the contract in a different way.
# The packages every tree needs (import-linter refuses a contract file naming a missing root).
ROOTS = {"tests/conftest.py": "", "tools/__init__.py": ""}
VIOLATING_TREE = {
    "miles/__init__.py": "",
    "miles_core/__init__.py": "",
    "miles_core/algo.py": "import prefect\n",
    "miles_core/deep/__init__.py": "",
    "miles_core/deep/lazy.py": "def f():\n    from mlflow.tracking import MlflowClient\n    return MlflowClient\n",
    "miles_core/dyn.py": "import importlib\nflows = importlib.import_module('flows.train')\n",
    "tracking/__init__.py": "",
    "tracking/runs.py": "import mlflow\nfrom tasks import run\n",
    "tasks/__init__.py": "",
    "tasks/run.py": "import torch\nimport prefect\n",
    "flows/__init__.py": "",
    "flows/train.py": "import torch.nn\nfrom tasks import run\n",
    "tests/test_speed.py": "def test_it():\n    from benchmarks.rollout import main\n",
    "tools/__init__.py": "",
}


def layer_names(contract: str = "core-layers") -> list[list[str]]:
    """A layers contract's floors as the contract file lists them, highest first."""
    text = CONFIG.read_text().split(f"[importlinter:contract:{contract}]", 1)[1]
    block = text.split("layers =", 1)[1].split("exhaustive", 1)[0]
    return [[m.strip() for m in line.split("|")] for line in block.strip().splitlines()]


# models/ as a package with every module its own contract lists (empty: the contract is kept).
MODELS_TREE = {f"miles_core/models/{m}.py": "" for floor in layer_names("models-layers") for m in floor} | {
    "miles_core/models/__init__.py": ""}

# Every floor present (empty modules), then three ways to break the floors: a bottom module
# importing a runtime, one sibling importing another, and a chain that climbs only indirectly.
LAYER_TREE = {f"miles_core/{m}.py": "" for floor in layer_names() for m in floor if m != "models"} | MODELS_TREE | {
    "miles_core/__init__.py": "",
    "miles_core/config.py": "import miles_core.learner\n",
    "miles_core/samplers.py": "from miles_core import data\n",
    "miles_core/storage.py": "import miles_core.types\nimport miles_core.algo\n",
}


# ----------------------------------------------------------------------------- the real repo

@pytest.mark.parametrize("package", sorted(RULES))
def test_repo_ast_scan_is_clean(package: str) -> None:
    violations = scan(REPO / package, RULES[package])
    assert not violations, "layering broken:\n" + "\n".join(map(str, violations))


def test_repo_import_linter_contracts_kept() -> None:
    for package in ("miles_core", "tracking", "tasks", "flows", "miles", "tools"):
        assert (REPO / package / "__init__.py").exists(), f"{package}/__init__.py missing: import-linter needs a package"
    result = lint_imports(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 6 kept, 0 broken" in result.stdout, result.stdout


# ----------------------------------------------------------------------------- the checkers can fail

def test_ast_scan_flags_synthetic_violations(tmp_path: Path) -> None:
    _write(tmp_path, VIOLATING_TREE)
    core = {(str(v.path), v.module) for v in scan(tmp_path / "miles_core", RULES["miles_core"])}
    assert core == {("miles_core/algo.py", "prefect"), ("miles_core/deep/lazy.py", "mlflow.tracking"),
                    ("miles_core/dyn.py", "flows.train")}
    flows = {(str(v.path), v.module) for v in scan(tmp_path / "flows", RULES["flows"])}
    assert flows == {("flows/train.py", "torch.nn")}
    tracking = {(str(v.path), v.module) for v in scan(tmp_path / "tracking", RULES["tracking"])}
    assert tracking == {("tracking/runs.py", "tasks")}
    tests = {(str(v.path), v.module) for v in scan(tmp_path / "tests", RULES["tests"])}
    assert tests == {("tests/test_speed.py", "benchmarks.rollout")}


def test_ast_scan_ignores_relative_and_allowed_imports(tmp_path: Path) -> None:
    _write(tmp_path, {"miles_core/__init__.py": "", "miles_core/a.py": "from . import b\nimport torch\n",
                      "miles_core/b.py": "from .a import torch\nimport prefect_like_name\n"})
    assert scan(tmp_path / "miles_core", RULES["miles_core"]) == []


def test_import_linter_flags_synthetic_violations(tmp_path: Path) -> None:
    _write(tmp_path, {**LAYER_TREE, **VIOLATING_TREE})
    result = lint_imports(tmp_path)
    assert result.returncode != 0, result.stdout + result.stderr
    assert "Contracts: 1 kept, 5 broken" in result.stdout, result.stdout
    assert "tests.test_speed -> benchmarks" in result.stdout  # the library's tests reaching a benchmark
    assert "miles_core.algo -> prefect" in result.stdout
    assert "flows.train -> torch" in result.stdout
    assert "tracking.runs -> tasks.run" in result.stdout  # a lower package importing a higher one


def test_import_linter_layers_contract_fails_on_a_tree_that_breaks_the_floors(tmp_path: Path) -> None:
    assert layer_names()[-1] == ["types", "config", "tokenizer", "allocator"] and len(layer_names()) == 8
    _write(tmp_path, {**LAYER_TREE, **ROOTS, "tracking/__init__.py": "", "tasks/__init__.py": "", "flows/__init__.py": "",
                      "miles/__init__.py": ""})
    result = lint_imports(tmp_path)
    out = result.stdout
    assert result.returncode != 0, out + result.stderr
    assert "Contracts: 5 kept, 1 broken" in out, out
    assert "miles_core.config -> miles_core.learner" in out  # a bottom floor importing a runtime
    assert "miles_core.samplers -> miles_core.data" in out  # siblings on one floor are independent
    assert "miles_core.storage -> miles_core.algo" in out


def test_import_linter_models_contract_fails_on_a_circle_inside_models(tmp_path: Path) -> None:
    """The circle models/ once had (base -> hf -> base, the second import inside a function, and a
    backend reaching another) breaks the ``models-layers`` contract and nothing else."""
    assert layer_names("models-layers")[2] == ["registry", "importer"]
    circle = {
        "miles_core/models/base.py": "from miles_core.models import registry\n",
        "miles_core/models/registry.py": "from miles_core.models import hf\n",
        "miles_core/models/hf.py": "def check():\n    from miles_core.models.base import load_checkpoint\n",
        "miles_core/models/llama.py": "from miles_core.models import lora\n",
        "miles_core/models/lora.py": "from miles_core.models import diffusion_gemma\n",
        "miles_core/models/diffusion_gemma.py": "from miles_core.models import hf\n",
    }
    _write(tmp_path, {**LAYER_TREE, "miles_core/config.py": "", "miles_core/samplers.py": "",
                      "miles_core/storage.py": "import miles_core.types\n", **circle,
                      "tracking/__init__.py": "", "tasks/__init__.py": "", "flows/__init__.py": "", "miles/__init__.py": "",
                      **ROOTS})
    result = lint_imports(tmp_path)
    out = result.stdout
    assert result.returncode != 0, out + result.stderr
    assert "Contracts: 5 kept, 1 broken" in out, out
    assert "miles_core.models.hf -> miles_core.models.base" in out  # a backend importing the loading API
    assert "miles_core.models.llama -> miles_core.models.lora" in out  # a backend importing LoRA
    assert "miles_core.models.diffusion_gemma -> miles_core.models.hf" in out  # one backend another
