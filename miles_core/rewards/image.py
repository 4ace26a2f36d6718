"""What a sandbox can read: private, frozen copies, never a host file.

A read-only bind of the host's interpreter and standard library shares the host's page cache with
every sandbox, and every sandbox with the next. A run can evict pages of a shared file
(``posix_fadvise``, ``madvise(MADV_PAGEOUT)`` on a library only sandboxes map) and a later job can
tell which pages are cached (``preadv2(RWF_NOWAIT)``, ``mincore``, or only the time of a read of a
rarely read file); it can hold ``flock``/``fcntl`` locks on the host's inodes, or watch them with
inotify. A completion can pass answers between jobs, and from one job to the next, that way.

So nothing a run reads is a host file: as it starts, bwrap copies (``--file``) the interpreter, the
shared objects it loads, the allowed extension modules and one uncompressed zip of the compiled
pure standard library into the sandbox's own tmpfs root, which is then remounted read-only. tmpfs
pages are the file itself: they cannot be evicted (``POSIX_FADV_DONTNEED`` is a no-op there and
a sandbox has no swap to page to), they are never cold, and their inodes die with the sandbox, so a
run can neither change nor observe their cache state, and a lock or a watch on them reaches no other
sandbox (stage one refuses locks and watches anyway: isolation.py). bwrap reads each host file whole,
the same way at every start, so a run has no say in the host's cache either. Cost: about 20 MB
copied per sandbox start (benchmarks/speed/sandbox.py measures it).

The standard library goes in as ``pythonXY.zip`` at the path the interpreter already searches
first (``sys.path[0]`` under ``-I``), compiled by the sandbox interpreter itself; what it leaves
out (:data:`EXCLUDED`: networking, processes, GUI, the test suite, packaging) is absent, and the
audit hook's import policy is exactly the set of modules packed (:attr:`Image.importable`).
"""

from __future__ import annotations

import functools
import glob
import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass

# Top-level standard-library names not packed: they reach the network, other processes, a GUI or
# a terminal (the kernel refuses those anyway), or are the test suite and the packaging tools.
EXCLUDED = frozenset(
    "test idlelib tkinter turtle turtledemo lib2to3 ensurepip venv distutils pydoc pydoc_data site-packages "
    "dist-packages socket ssl socketserver selectors subprocess pty tty multiprocessing concurrent asyncio "
    "ctypes sqlite3 dbm curses http urllib xmlrpc wsgiref smtplib smtpd ftplib poplib imaplib nntplib telnetlib "
    "webbrowser mailcap cgi cgitb crypt getpass pdb bdb cProfile profile pstats trace tracemalloc antigravity "
    "this site sitecustomize usercustomize __phello__ __hello__ config-3.11-x86_64-linux-gnu lib-dynload "
    "__pycache__".split())
# Extension modules copied beside the zip (pure computation; each only with what ``ldd`` says it
# loads). ``resource`` is the harness's own (rlimits), not a completion's.
EXTENSIONS = ("resource", "_decimal", "_json", "_queue", "_contextvars", "_typing", "_zoneinfo", "_bz2", "_lzma",
              "_multibytecodec", "_codecs_cn", "_codecs_hk", "_codecs_iso2022", "_codecs_jp", "_codecs_kr",
              "_codecs_tw", "_uuid", "audioop", "mmap")
# Built-in modules a completion may not import: what reaches the OS or the harness itself (gc walks
# every object, the hook's included; fcntl takes locks). Listed for the hook's readable refusal.
# _elementtree: its initialisation costs ~7 ms per run (sandbox.py makes the allowed built-ins in
# advance), and xml.etree falls back to its pure-Python twin without it.
REFUSED_BUILTINS = frozenset({"gc", "_socket", "fcntl", "faulthandler", "_posixsubprocess", "_tracemalloc", "pwd",
                              "grp", "spwd", "syslog", "xxsubtype", "_xxsubinterpreters", "resource", "_ctypes",
                              "_elementtree"})
_PACK = r"""
import importlib.util, json, marshal, os, sys, zipfile
stdlib, out, excluded = sys.argv[1], sys.argv[2], set(json.loads(sys.argv[3]))
header = importlib.util.MAGIC_NUMBER + bytes(12)  # flags 0, no source to compare a time with
names = set()
with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
    for d, dirs, files in os.walk(stdlib):
        rel = os.path.relpath(d, stdlib)
        if rel == "." :
            dirs[:] = sorted(x for x in dirs if x not in excluded and os.path.isfile(os.path.join(d, x, "__init__.py")))
        else:
            dirs[:] = sorted(x for x in dirs if x not in ("__pycache__", "test", "tests", "idle_test"))
        for f in sorted(files):
            top = rel.split(os.sep)[0] if rel != "." else f[:-3]
            if not f.endswith(".py") or top in excluded:
                continue
            path = os.path.join(d, f)
            try:
                code = compile(open(path, "rb").read(), path, "exec", dont_inherit=True)
            except SyntaxError:
                continue
            z.writestr(os.path.normpath(os.path.join(rel, f[:-3] + ".pyc")), header + marshal.dumps(code))
            names.add(top)
    for src, arcname, filename in json.loads(sys.argv[4]):  # the harness, as a package of its own
        code = compile(open(src, "rb").read() if src else b"", filename, "exec", dont_inherit=True)
        z.writestr(arcname, header + marshal.dumps(code))
dyn = [p for p in sys.path if p.endswith("lib-dynload")]
print(json.dumps({"zip": sys.path[0], "dynload": dyn[0] if dyn else "", "modules": sorted(names),
                  "builtins": sorted(sys.builtin_module_names)}))
"""


HARNESS_PACKAGE = "_miles_sandbox"  # the harness's modules inside the zip (never importable by a completion)
HARNESS_MODULES = ("sandbox", "sandbox_values", "sandbox_tests", "sandbox_worker")
HARNESS_FILE = "<miles-harness>"  # the file-name prefix its code is compiled under (sandbox.py trusts it)


@dataclass(frozen=True)
class Image:
    """The files bwrap copies into a sandbox: ``(path inside, host path, mode)`` each."""

    files: tuple[tuple[str, str, int], ...]
    zip_host: str                 # the zip on the host (mode none puts it on sys.path)
    importable: tuple[str, ...]   # top-level modules a completion may import (packed, copied or built in)
    read_roots: tuple[str, ...]   # where the import system reads: the zip and the extension directory


@functools.lru_cache(maxsize=None)
def build_image(exe: str, stdlib: str, libs: tuple[str, ...], seccomp_module: str = "") -> Image:
    """Pack ``exe``'s standard library (compiled by ``exe``) and list what a sandbox of it needs:
    the interpreter, ``libs`` (its shared objects), the allowed extensions with theirs, libseccomp's
    bindings. Built once per process; the zip lives in a private temporary directory until exit."""
    import atexit

    from miles_core.rewards.isolation import IsolationUnavailable, shared_libs

    d = tempfile.mkdtemp(prefix="miles-image-")
    atexit.register(shutil.rmtree, d, True)
    os.chmod(d, 0o711)  # mode none's worker, started as nobody, reads the zip in place
    zpath = os.path.join(d, "stdlib.zip")
    here = os.path.dirname(os.path.abspath(__file__))
    harness = [["", f"{HARNESS_PACKAGE}/__init__.pyc", f"{HARNESS_FILE}/__init__.py"]] + [
        [os.path.join(here, f"{m}.py"), f"{HARNESS_PACKAGE}/{m}.pyc", f"{HARNESS_FILE}/{m}.py"] for m in HARNESS_MODULES]
    res = subprocess.run([exe, "-I", "-S", "-c", _PACK, stdlib, zpath, json.dumps(sorted(EXCLUDED)), json.dumps(harness)],
                         capture_output=True, text=True, env={}, timeout=300)
    if res.returncode != 0:
        raise IsolationUnavailable(f"{exe} could not pack its standard library for the sandbox: "
                                   f"{res.stderr.strip()[-300:]}")
    os.chmod(zpath, 0o644)
    info = json.loads(res.stdout)
    exts = [so for name in EXTENSIONS for so in sorted(glob.glob(os.path.join(info["dynload"], f"{name}.cpython-*.so")))]
    bindings = [seccomp_module] if seccomp_module else []
    ext_libs = [p for p in shared_libs(exts + bindings) if p not in libs]
    # each file under the path the loader asks for (ldd's, which may be a link), holding its target's bytes
    files = [(exe, exe, 0o555), (info["zip"], zpath, 0o444)]
    files += [(p, os.path.realpath(p), 0o555) for p in dict.fromkeys([*libs, *ext_libs, *exts, *bindings])]
    importable = {*info["modules"], *(os.path.basename(p).split(".")[0] for p in exts),
                  *info["builtins"]} - REFUSED_BUILTINS
    return Image(tuple(files), zpath, tuple(sorted(importable)), (info["zip"], info["dynload"]))


def copy_args(image: Image) -> tuple[list[str], list[int]]:
    """bwrap arguments that copy ``image`` into the sandbox, and the descriptors they read (opened
    fresh for every start: bwrap reads each to its end, and starts may run in parallel). The caller
    closes the descriptors once bwrap has started."""
    argv: list[str] = []
    fds: list[int] = []
    try:
        for inside, host, mode in image.files:
            fds.append(os.open(host, os.O_RDONLY | os.O_CLOEXEC))
            argv += ["--perms", f"{mode:04o}", "--file", str(fds[-1]), inside]
    except OSError:
        for fd in fds:
            os.close(fd)
        raise
    return argv, fds
