"""The six benchmarks' loaders and checkers on files written here in each public format.

Run: python -m benchmarks.tasks [--variants 2400] [--smoke]

Per task (GSM8K, MATH-500, Countdown, Sudoku, HumanEval, MBPP; MATH's train format too): rows
loaded and skipped from a sample file that holds malformed rows on purpose, the accuracy of gold
completions (must be 1.0) and of corrupted ones (must be 0.0) under the reward pass@1 counts,
and the scoring time per sample. Then the agreement of the math checker the GSM8K/MATH reward
uses (rewards/mathverify.py: our answer span, math-verify's equivalence) with math-verify alone
on a generated set of answer variants, broken down by how the completion states its answer; the
two differ on purpose where a completion has several boxes (we take the last, MATH's convention),
or states its answer after ``####`` (GSM8K's convention) or in an ``<answer>`` tag (d1's) after
numbers in the reasoning: math-verify alone knows neither marker and can take one of those numbers.
Writes benchmarks/results/tasks.json. ``--smoke`` (CI) scores the same sample files (already a few
rows each) but only ~100 answer variants, so math-verify's part takes a second, not a minute.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

from benchmarks.harness import add_smoke, table, write_result
from tools.sample_files import corrupt_completion, gold_completion, write_samples
from miles_core.config import load_recipe
from miles_core.data.registry import build_task, check_reward
from miles_core.rewards.pool import shared_pools_closed_after
from miles_core.rewards.mathverify import check_answer, math_verify_alone
from miles_core.rewards.registry import call_reward, get_reward

TASKS = ("gsm8k", "math", "math500", "countdown", "sudoku", "humaneval", "mbpp")
# How a completion states its answer A (W: a wrong earlier answer). "on purpose": the two checkers
# are meant to differ there (module docstring).
TEMPLATES = {
    "boxed": ("The work.\n\\boxed{A}", False),
    "answer_tag_boxed": ("<reasoning>\n3 + 4 = 7 and 7 * 2 = 14\n</reasoning>\n<answer>\n\\boxed{A}\n</answer>", False),
    "answer_is": ("So 12 / 4 = 3 is not it. The answer is $A$.", False),
    "gsm8k_hash": ("12 + 30 = 42\n#### A", True),
    "last_of_two_boxes": ("First try \\boxed{W}, which is wrong. Finally \\boxed{A}", True),
    "answer_tag_after_numbers": ("<reasoning>\n3 + 4 = 7\n</reasoning>\n<answer>A</answer>", True),
}


def _forms(rng: random.Random) -> list[tuple[str, list[str], list[str]]]:
    """(gold, equivalent renderings, wrong renderings): hand-picked hard cases plus random numbers."""
    hard = [("\\frac{1}{2}", ["0.5", "\\dfrac{1}{2}", "\\tfrac12", "1/2"], ["\\frac{1}{3}", "2"]),
            ("2\\sqrt{2}", ["\\sqrt{8}", "2 \\sqrt{2}"], ["\\sqrt{2}", "4"]),
            ("(1,2]", ["(1, 2]"], ["[1,2)", "(1,2)"]),
            ("\\left( 3, \\frac{\\pi}{2} \\right)", ["(3, \\frac{\\pi}{2})", "(3,\\pi/2)"], ["(\\frac{\\pi}{2}, 3)"]),
            ("25\\%", ["25"], ["2.5"]),
            ("\\{1,2\\}", ["\\{2, 1\\}"], ["\\{1\\}"]),
            ("x^2+1", ["1+x^2"], ["x^2-1"]),
            ("\\pi", ["\\pi"], ["3"]),
            ("5", ["5 \\text{ cm}", "x = 5", "5.0"], ["6"]),
            ("-6", ["-6.0", "−6"], ["6"])]
    out = list(hard)
    for _ in range(60):
        n = rng.randint(1000, 999999)
        out.append((str(n), [f"{n:,}", f"{n}.0", f"{n:,}".replace(",", "{,}")], [str(n + 1), f"{n + 10:,}"]))
        a, b = rng.randint(1, 40), rng.randint(41, 97)
        out.append((f"\\frac{{{a}}}{{{b}}}", [f"\\dfrac{{{a}}}{{{b}}}", f"{a}/{b}", f"\\frac{{{2 * a}}}{{{2 * b}}}"],
                    [f"\\frac{{{a + 1}}}{{{b}}}"]))
    return out


def agreement(target: int, seed: int = 0) -> dict:
    """Our checker vs math-verify alone on >= ``target`` generated (completion, gold) pairs."""
    rng = random.Random(seed)
    rows: list[tuple[str, bool, bool, bool, bool]] = []  # template, should match, ours, alone, on purpose
    while len(rows) < target:
        for gold, same, wrong in _forms(rng):
            for name, (tpl, purposeful) in TEMPLATES.items():
                for ans, truth in [(gold, True), *[(s, True) for s in same], *[(w, False) for w in wrong]]:
                    text = tpl.replace("W", wrong[0]).replace("A", ans)
                    rows.append((name, truth, check_answer(text, gold), math_verify_alone(text, gold), purposeful))
            if len(rows) >= target:
                break
    by = {}
    for name, (_, purposeful) in TEMPLATES.items():
        mine = [r for r in rows if r[0] == name]
        by[name] = {"n": len(mine), "agree": sum(r[2] == r[3] for r in mine) / len(mine),
                    "ours_correct": sum(r[2] == r[1] for r in mine) / len(mine),
                    "alone_correct": sum(r[3] == r[1] for r in mine) / len(mine), "differ_on_purpose": purposeful}
    plain = [r for r in rows if not r[4]]
    return {"n": len(rows), "agree": sum(r[2] == r[3] for r in rows) / len(rows),
            "agree_where_not_on_purpose": sum(r[2] == r[3] for r in plain) / len(plain),
            "ours_correct": sum(r[2] == r[1] for r in rows) / len(rows),
            "alone_correct": sum(r[3] == r[1] for r in rows) / len(rows), "by_template": by}


def task_rows(root: Path) -> list[dict]:
    files = write_samples(root)
    out = []
    for name in TASKS:
        f = files[name]
        over = [f"task.name={name}", f"task.test_path={f['test']}", "sandbox.isolation=bwrap_shared"]
        if f["train"]:
            over.append(f"task.path={f['train']}")
        cfg = load_recipe("arith", over)
        data = build_task(cfg)
        reward = get_reward(check_reward(cfg.task))
        probs = data.test
        t0 = time.perf_counter()
        gold = call_reward(reward, [p.prompt for p in probs], [gold_completion(name, p) for p in probs],
                           answer=[p.answer for p in probs])
        bad = call_reward(reward, [p.prompt for p in probs], [corrupt_completion(name, p) for p in probs],
                          answer=[p.answer for p in probs])
        seconds = (time.perf_counter() - t0) / (2 * len(probs))
        rep = data.task.test_report
        g = sum(r is not None and r >= 1.0 for r in gold) / len(probs)
        c = sum(r is not None and r >= 1.0 for r in bad) / len(probs)
        out.append({"name": name, "ok": g == 1.0 and c == 0.0 and rep.skipped == f["bad"], "rows": len(rep.problems),
                    "skipped": rep.skipped, "expected_skipped": f["bad"], "gold_accuracy": g, "corrupt_accuracy": c,
                    "seconds_per_sample": seconds, "reward": check_reward(cfg.task),
                    "train_rows": len(data.task.train), "train_test_overlap_dropped": data.task.overlap,
                    "first_skip": rep.errors[0].split(": ", 1)[1] if rep.errors else ""})
    return out


SMOKE_VARIANTS = 100  # --smoke: a few of the hand-picked hard forms, every template


def main(argv: list[str] | None = None) -> None:
    ap = add_smoke(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    ap.add_argument("--variants", type=int, default=2400, help="answer variants for the checker agreement (>= 2000)")
    ap.add_argument("--out", default=None, metavar="FILE", help="the result JSON (default: benchmarks/results/tasks.json)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.variants = SMOKE_VARIANTS
    # the code tasks' shared sandbox pools this run starts: closed after, the caller's processes as they were
    with shared_pools_closed_after(), tempfile.TemporaryDirectory() as d:
        rows = task_rows(Path(d))
    print(table([[r["name"], r["ok"], r["rows"], r["skipped"], r["gold_accuracy"], r["corrupt_accuracy"],
                  f"{1000 * r['seconds_per_sample']:.1f}", r["reward"]] for r in rows],
                ["task", "ok", "rows", "skipped", "gold acc", "corrupt acc", "ms/sample", "reward"]))
    agree = agreement(args.variants)
    print(f"\nmath checker vs math-verify alone on {agree['n']} answer variants: agree {agree['agree']:.3f} "
          f"({agree['agree_where_not_on_purpose']:.3f} where they are not meant to differ); right answer: "
          f"ours {agree['ours_correct']:.3f}, math-verify alone {agree['alone_correct']:.3f}")
    print(table([[k, v["n"], v["agree"], v["ours_correct"], v["alone_correct"], v["differ_on_purpose"]]
                 for k, v in agree["by_template"].items()],
                ["answer stated as", "n", "agree", "ours right", "alone right", "differ on purpose"]))
    # per task, what was scored: a task that loaded no rows, or scored none, fails the run (check_measured)
    scored = {r["name"]: {"problems": r["rows"], "seconds_per_sample": r["seconds_per_sample"]} for r in rows}
    path = write_result("tasks", {"tasks": rows, "scored": scored, "math_verify_agreement": agree,
                                  "all_ok": all(r["ok"] for r in rows), "smoke": args.smoke}, args.out,
                        positive=["scored.*.problems", "scored.*.seconds_per_sample", "math_verify_agreement.n",
                                  "math_verify_agreement.by_template.*.n"],
                        present=["all_ok", "math_verify_agreement.agree", "math_verify_agreement.ours_correct"])
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
