"""Process-level settings of the long-lived asynchronous workers (from a profile of the asynchronous run): the heap
they keep, and the imports they pay before their loop rather than inside their first batch."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from miles_core.allocator import MMAP_THRESHOLD_MAX, apply_heap_setting, retain_freed_memory

ROOT = Path(__file__).resolve().parents[1]


def run_python(code: str, *args: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


ROLLOUT_FAULTS = """
    import resource, sys, torch
    torch.set_num_threads(1)
    from miles_core.allocator import retain_freed_memory
    from miles_core.algo.rl import sample_batch
    from miles_core.config import load_recipe
    from miles_core.data.registry import build_task
    from miles_core.learner.baseline import new_model
    from miles_core.models.lora import add_lora_from
    from miles_core.tokenizer import CharTokenizer
    cfg = load_recipe("arith")  # the arith recipe's base: d 64, 3 layers; 16 x 8 completions a batch
    tok = CharTokenizer()
    model = add_lora_from(new_model(cfg, tok, 0).eval(), cfg.lora, dropout=0.0)
    data = build_task(cfg)

    def faults_per_batch() -> int:
        sample_batch(cfg, model, tok, data, None, "w0", 0, 99, 0)  # warm: what stays mapped is mapped now
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for seq in range(2):
            sample_batch(cfg, model, tok, data, None, "w0", 0, seq, 0)
        return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) // 2

    default = faults_per_batch()
    assert retain_freed_memory(1 << 30)
    print(default, faults_per_batch())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_sampler_with_a_retained_heap_stops_faulting_in_fresh_pages_every_step() -> None:
    # a process that only samples frees each denoising step's activations; glibc hands the top of
    # the heap back and the next step faults it in again, page by page (35k faults per batch)
    # glibc's own thresholds adapt to what a process freed before (a freed mmapped chunk raises them),
    # so in one process in a few the default keeps its heap too and there is nothing to compare: up
    # to three fresh processes, and the retained heap must fault 10x less in one of them
    seen = []
    for _ in range(3):
        default, retained = map(int, run_python(ROLLOUT_FAULTS).split())
        seen.append((default, retained))
        if retained * 10 < default:  # measured here: 3,701 to 69,572 against 0 to 181
            break
    assert retained * 10 < default, seen


def test_allocator_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="mmap_bytes"):
        retain_freed_memory(1 << 20, MMAP_THRESHOLD_MAX + 1)
    with pytest.raises(ValueError, match="trim_bytes"):
        retain_freed_memory(0)
    assert apply_heap_setting(0) is False  # async_rl.retain_heap_mb=0: glibc's default is left alone


def test_warm_imports_leave_nothing_for_the_first_commit_to_import() -> None:
    # pyarrow imports pandas the first time it builds an array from numpy; a forked worker must
    # find that done by the fork server's preload, not pay it inside its first batch
    new = run_python("""
        import sys
        import miles_core.asyncrl.warm  # noqa: F401
        sys.path.insert(0, "tests")
        from test_storage import make_batch
        from miles_core.storage import to_arrow
        before = set(sys.modules)
        to_arrow(make_batch())
        print(sorted(set(sys.modules) - before))
    """)
    assert new == "[]"
