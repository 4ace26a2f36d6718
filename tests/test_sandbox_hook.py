"""The audit hook's gaps, closed (defence in depth: the kernel is the boundary, the hook gives early
refusals with a reason): a relative path whose directory a ``dir_fd`` names, descriptors given as
paths, and ``_imp.create_builtin``, which makes a built-in module without an import event. Honest
programs that import what the benchmarks import still pass. Both modes; root and an ordinary user."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from miles_core.rewards.jobs import Job, SandboxLimits
from miles_core.rewards.pool import SandboxPool

LIMITS = SandboxLimits(timeout_s=3.0, cpu_s=1, memory_mb=256, tmpfs_mb=8)
SPEC = "type('S', (), {'name': 'faulthandler'})()"
GAPS = {
    "dir_fd": "import os\ndef f(x):\n    d = os.open('/usr', os.O_RDONLY | os.O_DIRECTORY)\n"
              "    return os.read(os.open('lib/os-release', os.O_RDONLY, dir_fd=d), 9).decode()\n",
    "dir_fd from the job folder": "import os\ndef f(x):\n    d = os.open('.', os.O_RDONLY)\n"
                                  "    return os.open('x', os.O_RDONLY, dir_fd=d)\n",
    "a descriptor as a path": "import os\ndef f(x):\n    return os.listdir(os.open('/', os.O_RDONLY))\n",
    "fchdir": "import os\ndef f(x):\n    os.chdir(os.open('/', os.O_RDONLY))\n    return 1\n",
    "open a run's descriptor": "def f(x):\n    open(3, 'wb', closefd=False).write(b'x')\n    return 1\n",
    "_imp.create_builtin": f"import _imp\ndef f(x):\n    return _imp.create_builtin({SPEC}).__name__\n",
    "the loader's create_module": ("import sys\ndef f(x):\n    b = sys.modules['_frozen_importlib'].BuiltinImporter\n"
                                   f"    return b.create_module({SPEC}).__name__\n"),
    "the tester's folder and the output file": "def f(x):\n    return open('/tmp/.output1', 'a').write('x')\n",
}
HONEST = "import math, heapq, collections, itertools, re, json\ndef f(x):\n    return [math.isqrt(x), heapq.nlargest(1, [x, 2])]\n"


@pytest.fixture(scope="module", params=("bwrap", "bwrap_shared"))
def pool(request: pytest.FixtureRequest) -> Iterator[SandboxPool]:
    with SandboxPool(1, LIMITS, isolation=request.param, cache_size=0) as p:
        yield p


def test_every_gap_is_refused(pool: SandboxPool) -> None:
    """Each is refused with a reason (``blocked``); the two built-in module makers raise
    ImportError in the run. Before: the job-folder dir_fd open ran, ``open(3)`` corrupted the
    run's report, and both makers returned faulthandler."""
    got = dict(zip(GAPS, pool.run([Job(src, [[0]]) for src in GAPS.values()])))
    makers = ("_imp.create_builtin", "the loader's create_module")
    wrong = {n: r for n, r in got.items()
             if (r.errors != ["raised ImportError"] if n in makers else r.status != "blocked")}
    assert wrong == {}, wrong


def test_honest_imports_still_work(pool: SandboxPool) -> None:
    res = pool.run([Job(HONEST, [[10]])])[0]
    assert (res.status, res.outputs) == ("ok", [[3, [10]]]), res
