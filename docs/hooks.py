"""MkDocs hook: the reference pages, generated from the code at every build (never edited by hand).

* ``reference/cli.md``: ``miles --help`` and every command's ``--help``, from the parser itself;
* ``reference/recipe.md``: every recipe field, its type, default and bounds, from the dataclasses
  (``miles_core/config/``: bounds are declared beside each field with ``bounded``), with the
  comment written beside it in the source;
* ``concepts/store.md``, ``concepts/sandbox-invariants.md``, ``reference/architecture.md``,
  ``reference/benchmarks.md``: the repository's own pages (storage/SCHEMA.md, infra/sandbox.md,
  ARCHITECTURE.md, benchmarks/README.md), so one text serves the code and the site.

Links from those pages to repository files become code spans (they are not pages of the site).
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys
import typing
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
GENERATED = ("reference/cli.md", "reference/recipe.md", "concepts/store.md", "concepts/sandbox-invariants.md",
             "reference/architecture.md", "reference/benchmarks.md")


def repo_links_to_code(text: str) -> str:
    """``[text](path)`` to a repository file -> ``text (`path`)``; web links and anchors stay."""
    def one(m: re.Match) -> str:
        label, target = m.group(1), m.group(2)
        if target.startswith(("http://", "https://", "mailto:", "#")):
            return m.group(0)
        return f"`{target}`" if label.strip("`") == target else f"{label} (`{target}`)"
    return re.sub(r"\[([^\]]+)\]\(([^)]+)\)", one, text)


def cli_page() -> str:
    from miles.cli import build_parser

    parser = build_parser()
    out = ["# Command line", "", "Generated from `miles/cli.py` at build time.", "", "```text",
           parser.format_help().rstrip(), "```", ""]
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    for name, p in sub.choices.items():
        out += [f"## miles {name}", "", "```text", p.format_help().rstrip(), "```", ""]
    return "\n".join(out)


def _comments(cls: type) -> dict[str, str]:
    """The comment beside each field in ``cls``'s source: the lines just above it, or after it."""
    try:
        src = inspect.getsource(cls).splitlines()
    except (OSError, TypeError):
        return {}
    out, above = {}, []
    for line in src:
        s = line.strip()
        m = re.match(r"^([a-z_][a-z0-9_]*)\s*:", s)
        if s.startswith("#"):
            above.append(s.lstrip("# "))
        elif m:
            after = s.split("#", 1)[1].strip() if "  #" in line else ""
            out[m.group(1)] = " ".join(above + ([after] if after else []))
            above = []
        else:
            above = []
    return out


def _type(t: Any) -> str:
    if typing.get_origin(t) is typing.Literal:
        return " \\| ".join(f"`{a!r}`" for a in typing.get_args(t))
    return f"`{getattr(t, '__name__', str(t))}`"


def _section(title: str, cls: type) -> list[str]:
    """One section's table: each field, its type, default, bounds and the comment beside it."""
    out = [f"## {title}", ""]
    if cls.__doc__ and not cls.__doc__.startswith(cls.__name__ + "("):
        out += [" ".join(cls.__doc__.split()), ""]
    out += ["| field | type | default | bounds | what |", "| --- | --- | --- | --- | --- |"]
    notes, sub = _comments(cls), typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else "")
        lo, hi = f.metadata.get("bounds", (None, None))
        bounds = "" if lo is None and hi is None else f"[{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}]"
        what = notes.get(f.name, "").replace("|", "\\|")
        out.append(f"| `{f.name}` | {_type(sub[f.name])} | `{default!r}` | {bounds} | {what} |")
    return out + [""]


def recipe_page() -> str:
    from miles_core.config import BUILTIN_ESTIMATORS, SETTINGS, EstimatorSections, RecipeConfig

    out = ["# Recipe fields", "",
           "Generated from `miles_core/config/` at build time. Set any field in a recipe YAML or on the "
           "command line as `section.field=value` (e.g. `optim.lr=5e-4`, `estimators.spg.copies=4`); a value "
           "out of its bounds or not among its choices is refused before any work, naming the field. Keys of "
           "the old single `adpo` section still load, each with a warning naming where it now lives "
           "(`miles_core/config/legacy.py`).", ""]
    hints = typing.get_type_hints(RecipeConfig)
    for top in dataclasses.fields(RecipeConfig):
        cls = hints[top.name]
        if cls is EstimatorSections:
            out += ["## estimators", "", "Each estimator's own settings, `estimators.NAME.FIELD`; the engine "
                    "reads those of `update.estimator`.", ""]
            out += [line for name in BUILTIN_ESTIMATORS for line in _section(f"estimators.{name}", SETTINGS[name])]
        elif dataclasses.is_dataclass(cls):
            out += _section(top.name, cls)
        else:
            out += [f"- `{top.name}` ({_type(cls)}, default `{top.default!r}`)", ""]
    return "\n".join(out)


def copied(path: str, title: str | None = None) -> str:
    text = repo_links_to_code((ROOT / path).read_text())
    note = f"\n\n*This page is `{path}` of the repository.*\n"
    if title:
        text = f"# {title}\n\n" + text
    first_break = text.find("\n")
    return text[:first_break] + note + text[first_break:]


def on_pre_build(config: Any, **_: Any) -> None:
    sys.path.insert(0, str(ROOT))
    docs = Path(config["docs_dir"])
    pages = {"reference/cli.md": cli_page(), "reference/recipe.md": recipe_page(),
             "concepts/store.md": copied("miles_core/storage/SCHEMA.md"),
             "concepts/sandbox-invariants.md": copied("infra/sandbox.md"),
             "reference/architecture.md": copied("ARCHITECTURE.md"),
             "reference/benchmarks.md": copied("benchmarks/README.md")}
    for rel, text in pages.items():
        (docs / rel).parent.mkdir(parents=True, exist_ok=True)
        (docs / rel).write_text(text)
