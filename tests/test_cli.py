"""The ``miles`` command line, run as a user runs it: a separate process, exit codes, stderr.

Why subprocesses: what matters is what a shell sees (exit code 2 and one line naming the field for
a bad override, before any flow or model is started; ``--help`` that does not pay for torch), and
the demo's whole chain SFT -> ADPO -> registered model -> ``miles generate``.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import tomllib
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]
COMMANDS = ["train", "sft", "eval", "generate", "demo", "recipes", "models", "serve", "data", "export", "stop", "lm-eval"]
FLOW_STARTED = ("Beginning flow run", "Starting temporary server")


def cli_env(tmp: Path | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API", "MLFLOW_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    if tmp is not None:
        env.update({"PREFECT_HOME": str(tmp / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
                    "MLFLOW_TRACKING_URI": f"sqlite:///{tmp / 'mlruns' / 'mlflow.db'}"})
    return env


def miles(*args: str, cwd: Path = REPO, env: dict[str, str] | None = None,
          timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "miles.cli", *args], cwd=cwd, env=env or cli_env(),
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


# ----------------------------------------------------------------------------- help

def test_top_level_help_lists_every_command() -> None:
    r = miles("--help")
    assert r.returncode == 0, r.stderr
    for cmd in COMMANDS:
        assert cmd in r.stdout, f"{cmd} missing from --help"


@pytest.mark.parametrize("cmd", COMMANDS)
def test_subcommand_help(cmd: str) -> None:
    r = miles(cmd, "--help")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"usage: miles {cmd}"), r.stdout[:200]


def test_help_and_validation_do_not_import_heavy_libraries() -> None:
    """``--help`` and recipe checks must stay instant: no torch, prefect or mlflow imported, and of
    the flows only their parameter models (flows/params.py, pydantic), which the subcommands are
    generated from."""
    code = ("import sys\nfrom miles import cli\np = cli.build_parser()\np.format_help()\n"
            "cli.validate_recipe('arith', ['optim.lr=0.01'])\n"
            "mods = [m for m in ('torch', 'prefect', 'mlflow', 'tasks', 'tracking') if m in sys.modules]\n"
            "print(sorted(mods + [m for m in sys.modules if m.startswith('flows.') and m != 'flows.params']))")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=cli_env(), capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_unknown_command_is_a_usage_error() -> None:
    r = miles("fly")
    assert r.returncode == 2
    assert "invalid choice" in r.stderr


# ----------------------------------------------------------------------------- bad input

@pytest.mark.parametrize(("args", "names"), [
    (["train", "arith", "optim.lr=abc"], ["optim.lr", "abc"]),
    (["train", "arith", "adpo.nope=1"], ["adpo.nope"]),
    (["sft", "tiny", "sft.steps=many"], ["sft.steps"]),
    (["train", "tiny", "sampler.kind=fast"], ["sampler.kind", "static", "nsd"]),
    (["train", "no-such-recipe"], ["no-such-recipe", "arith", "tiny"]),
    (["train", "tiny", "lr"], ["lr", "key.sub=value"]),
    (["eval", "--model", "models:/miles-arith@champion", "eval.temperature=hot"], ["eval.temperature"]),
    (["demo", "train.group_size=1"], ["train.group_size"]),
    (["sft", "tiny", "sft.steps=-1"], ["sft.steps", "-1", "[1, inf]"]),
    (["train", "tiny", "train.iterations=0"], ["train.iterations", "0", "[1, inf]"]),
    (["train", "tiny", "--iterations", "0"], ["--iterations", "1"]),
    (["train", "tiny", "adpo.lrr=1"], ["adpo.lrr", "did you mean 'optim.lr'"]),  # an old key: where it lives now
    (["train", "tiny", "optim.lrr=1"], ["optim.lrr", "did you mean 'optim.lr'"]),
    (["train", "tiny", "estimators.spg.copys=2"], ["estimators.spg.copys", "did you mean 'estimators.spg.copies'"]),
    (["train", "tiny", "update.estimator=adpoo"], ["update.estimator", "adpoo", "did you mean 'adpo'"]),
    (["train", "tiny", "train.reward=arith_stepz"], ["train.reward", "arith_stepz", "did you mean 'arith_steps'"]),
    (["train", "tiny", "task.name=arithmatic"], ["task.name", "arithmatic"]),
    (["train", "tiny", "iterations"], ["iterations", "did you mean train.iterations=VALUE"]),
    (["train", "tiny", "--iterations", "2", "optim.lr=abc"], ["optim.lr", "abc"]),  # an override after a flag
    (["train", "--iterations", "2", "tiny", "adpo.nope=1"], ["adpo.nope"]),  # the recipe after a flag
    (["train", "tiny", "--iterations", "2", "--bogus"], ["--bogus"]),
    (["models", "check", "/no/such/folder"], ["/no/such/folder", "no such folder"]),
    (["train", "tiny", "--tracking-uri", "sqlite:////no/such/dir/mlflow.db"], ["/no/such", "does not exist"]),
    (["train", "tiny", "lora.r=0"], ["lora.r", "0", "[1, 4096]"]),
])
def test_bad_recipe_or_override_fails_fast_naming_the_field(args: list[str], names: list[str]) -> None:
    r = miles(*args, timeout=60)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("miles: error: "), r.stderr
    for name in names:
        assert name in lines[0], f"{name!r} not named in: {lines[0]}"
    assert not any(marker in r.stdout + r.stderr for marker in FLOW_STARTED)


def test_print_config_is_the_resolved_recipe_and_runs_as_a_file(tmp_path: Path) -> None:
    r = miles("train", "tiny", "--iterations", "3", "optim.lr=0.002", "--print-config", timeout=60)
    assert r.returncode == 0, r.stderr
    import yaml

    cfg = yaml.safe_load(r.stdout)
    assert cfg["name"] == "tiny" and cfg["optim"]["lr"] == 0.002 and cfg["train"]["iterations"] == 3
    (tmp_path / "r.yaml").write_text(r.stdout)
    again = miles("train", str(tmp_path / "r.yaml"), "--print-config", timeout=60)
    assert again.returncode == 0 and again.stdout == r.stdout, again.stderr
    assert not any(marker in r.stdout + r.stderr for marker in FLOW_STARTED)


def test_prefect_settings_are_in_place_before_prefect_is_imported() -> None:
    """Prefect reads its settings once, at import: the CLI sets the temporary server's start-up limit
    (120 s and up, scaled by load; Prefect's own default 20 s is what a busy machine misses) before any
    subcommand can import Prefect; a value the user exported wins."""
    code = ("from miles import cli\ncli.main(['recipes'])\nfrom prefect.settings import get_current_settings\n"
            "print('LIMIT', get_current_settings().server.ephemeral.startup_timeout_seconds)")
    env = {k: v for k, v in cli_env().items() if not k.startswith("PREFECT_SERVER_EPHEMERAL")}
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert int(float(r.stdout.split("LIMIT")[-1])) >= 120, r.stdout
    env["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] = "77"
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert int(float(r.stdout.split("LIMIT")[-1])) == 77, r.stdout + r.stderr


@pytest.mark.parametrize(("args", "needle"), [
    (["eval"], "--model"),
    (["eval", "--adapter", "some/adapter"], "--base"),
    (["eval", "--model", "models:/m@champion", "--base", "b"], "--base"),
    (["train", "tiny", "--resume"], "--run-dir"),
])
def test_source_and_resume_errors(args: list[str], needle: str) -> None:
    r = miles(*args, timeout=60)
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr


def test_empty_register_as_reaches_the_flow_as_do_not_register() -> None:
    """``--register-as ''`` must not become None, which call_flow drops in favour of the flow's default name."""
    from flows.params import AsyncTrainParams, call_values
    from miles import cli

    args = cli.build_parser().parse_args(["async-train", "tiny", "--register-as", ""])
    values = call_values(args, AsyncTrainParams)
    assert values["register_as"] == "" and not AsyncTrainParams.model_validate(values).register_as


def test_devices_and_an_explicit_split_are_exclusive() -> None:
    r = miles("async-train", "tiny", "--devices", "4", "--ranks", "2", timeout=60)
    assert r.returncode == 2 and "devices" in r.stderr, r.stderr


def test_recipes_lists_builtins_with_descriptions() -> None:
    r = miles("recipes")
    assert r.returncode == 0, r.stderr
    rows: dict[str, str] = {}
    for line in r.stdout.splitlines():  # a description wraps onto indented lines under its name
        if line.strip() and not line.startswith(" "):
            name = line.split()[0]
            rows[name] = line[len(name):].strip()
        elif line.strip():
            rows[name] += " " + line.strip()
    assert {"arith", "tiny", "code", "countdown"} <= set(rows)
    assert "arithmetic" in rows["arith"].lower()
    assert all(d.endswith(".") for d in rows.values()), rows  # whole sentences, never cut mid-way


def test_console_script_is_declared() -> None:
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert meta["project"]["scripts"]["miles"] == "miles.cli:main"
    script = Path(sys.executable).with_name("miles")
    if script.exists():  # installed (make install / pip install -e .): the real entry point works
        r = subprocess.run([str(script), "recipes"], capture_output=True, text=True, timeout=60, env=cli_env())
        assert r.returncode == 0 and "tiny" in r.stdout, r.stderr


# ----------------------------------------------------------------------------- the demo, end to end

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _printed(out: str, label: str) -> list[str]:
    """The command the demo printed after ``label :`` (up to a two-space-and-paren remark), as argv."""
    line = next(x for x in out.splitlines() if re.match(rf"\s*{label}\s*:", x))
    return shlex.split(line.split(":", 1)[1].split("   (")[0])


def _until_http(proc: subprocess.Popen[bytes], url: str, body: bytes | None = None, timeout: float = 240) -> bytes:
    """Poll ``url`` until it answers 200 (POST ``body`` when given) while ``proc`` lives."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.read()
        except OSError:
            time.sleep(1)
    raise AssertionError(f"{url}: no answer (process exit code {proc.poll()})")


def _serving(argv: list[str], cwd: Path, env: dict[str, str], url: str, body: bytes | None = None) -> bytes:
    """Start a printed server command in its own process group, return its first answer, stop it."""
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        return _until_http(proc, url, body)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_demo_and_every_command_it_prints(tmp_path: Path) -> None:
    """`miles demo`, then each command it printed, pasted into a shell without the venv on PATH and
    without MLFLOW_TRACKING_URI (the default ./mlruns store), the only edit being a free port for the
    servers: generate answers, serve answers over HTTP, the MLflow UI shows the demo's experiment as a
    training experiment, and the Prefect UI's server holds the demo's flows (one PREFECT_HOME)."""
    env = cli_env(tmp_path)
    # as a new user meets it: no start-up limit exported (the CLI's own), and every core busy with
    # another process while Prefect's temporary server starts (Prefect's default 20 s failed here)
    env.pop("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS")
    hogs = [subprocess.Popen([sys.executable, "-c", "import time\nt = time.time() + 40\nwhile time.time() < t: pass"])
            for _ in range(os.cpu_count() or 1)]
    try:
        r = miles("demo", "--recipe", "tiny", "--no-progress", "--register-as", "cli-demo",
                  "sft.steps=10", "eval.num_problems=8", "train.iterations=2", "train.eval_every=1",
                  "train.prompts_per_iter=2", cwd=tmp_path, env=env, timeout=480)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    out = r.stdout
    for needle in ("SFT baseline pass@1", "ADPO (RL)    pass@1", "paired sign test", "held-out curve      : 0: ",
                   "models:/cli-demo/1", f"ui --backend-store-uri {env['MLFLOW_TRACKING_URI']}"):
        assert needle in out, f"{needle!r} missing from the demo output:\n{out}"
    assert (tmp_path / "mlruns" / "mlflow.db").exists()
    assert any(tmp_path.glob("runs/demo-*/train"))
    assert "Task run" not in out  # Prefect's per-task lines: in the run's prefect.log and the UI, not the console
    assert "prefect.task_runs" in next(tmp_path.glob("runs/demo-*/prefect.log")).read_text()
    shell = {**{k: v for k, v in env.items() if k not in ("MLFLOW_TRACKING_URI", "PYTHONPATH")}, "PATH": "/usr/bin:/bin"}

    tries = _printed(out, "try it")
    g = subprocess.run(tries, cwd=tmp_path, env=shell, capture_output=True, text=True,
                       timeout=180, stdin=subprocess.DEVNULL)
    assert g.returncode == 0 and len(g.stdout.splitlines()) == 2, g.stderr[-3000:]
    # the printed prompts are held-out problems of the recipe the demo trained (in its range), and
    # generate answers them as the evaluation did, the answers the demo printed beside them
    from miles.commands import demo_overrides
    from miles_core.config import load_recipe
    from miles_core.data.registry import build_task

    held_out = {q.prompt for q in build_task(load_recipe("tiny", demo_overrides("tiny", ["eval.num_problems=8"]))).test}
    line = next(x for x in out.splitlines() if x.strip().startswith("try it"))
    said = re.findall(r"(\S+) -> '([^']*)' \((right|wrong)\)", line)
    assert [p for p, _, _ in said] == tries[-2:] and set(tries[-2:]) <= held_out, line
    assert g.stdout.splitlines() == [c for _, c, _ in said], (line, g.stdout)
    assert not (tmp_path / "mlflow.db").exists()  # the default store, not a stray one MLflow made up
    other = tmp_path / "elsewhere"  # from another folder, --tracking-uri names the store
    other.mkdir()
    g = miles("generate", "--model", "models:/cli-demo@champion", "--tracking-uri", env["MLFLOW_TRACKING_URI"],
              "--with-prompt", "--temperature", "1.0", "--seed", "3", "--max-tokens", "4", "1+2*3", "4-5",
              cwd=other, env=shell, timeout=180)
    assert g.returncode == 0, g.stderr[-3000:]
    assert [line.split("\t")[0] for line in g.stdout.splitlines()] == ["1+2*3", "4-5"], g.stdout
    assert all(len(line.split("\t")[1]) <= 4 for line in g.stdout.splitlines()), g.stdout  # --max-tokens
    assert not (other / "mlflow.db").exists()

    serve = _printed(out, "serve it")
    port = _free_port()
    serve[serve.index("--port") + 1] = str(port)
    answer = json.loads(_serving(serve, tmp_path, shell, f"http://127.0.0.1:{port}/invocations",
                                 json.dumps({"inputs": ["1+2*3"]}).encode()))
    assert len(answer["predictions"]) == 1 and isinstance(answer["predictions"][0], str)

    ui = _printed(out, "MLflow UI")
    port = _free_port()
    ui[ui.index("--port") + 1] = str(port)
    exp = json.loads(_serving(ui, tmp_path, shell, f"http://127.0.0.1:{port}/api/2.0/mlflow/experiments/"
                                                   "get-by-name?experiment_name=miles-demo"))["experiment"]
    assert {t["key"]: t["value"] for t in exp["tags"]}["mlflow.experimentKind"] == "custom_model_development"

    prefect = _printed(out, "Prefect UI") + ["--port", str(port := _free_port())]
    flows = json.loads(_serving(prefect, tmp_path, shell, f"http://127.0.0.1:{port}/api/flows/filter", b"{}"))
    assert {"miles-sft", "miles-train", "miles-evaluate"} <= {f["name"] for f in flows}


def test_a_missing_gpu_is_refused_before_any_flow_starts() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    r = miles("sft", "tiny", "model.device=cuda")
    assert r.returncode == 2 and "model.device" in r.stderr and "sees no CUDA device" in r.stderr, r.stderr
    assert not any(s in r.stdout + r.stderr for s in FLOW_STARTED)


@pytest.mark.parametrize("cmd", [["generate", "--model", "models:/m/1", "1+2"], ["serve", "--model", "models:/m/1"],
                                 ["train", "tiny"]])
def test_a_tracking_server_that_does_not_answer_is_refused_in_seconds(cmd: list[str]) -> None:
    """``miles generate`` / ``serve`` / a flow command against a tracking server that is down fail in
    seconds with a usage error naming it (MLflow's client alone retried for 249 s), before any flow."""
    port = _free_port()
    t0 = time.monotonic()
    r = miles(*cmd, "--tracking-uri", f"http://127.0.0.1:{port}", timeout=120)
    assert r.returncode == 2 and f"127.0.0.1:{port}" in r.stderr and "does not answer" in r.stderr, r.stderr[-2000:]
    assert time.monotonic() - t0 < 60 and not any(s in r.stdout + r.stderr for s in FLOW_STARTED)


@pytest.mark.parametrize(("flag", "cmd", "where"), [("--store", "train", "afile/store"), ("--run-dir", "sft", "/proc/x"),
                                                   ("--store", "train", "ro/store")])
def test_an_unwritable_store_or_run_folder_is_refused_before_any_flow_starts(flag: str, cmd: str, where: str,
                                                                            tmp_path: Path) -> None:
    """A store or run folder that cannot be created fails in seconds, naming the flag and the
    path, before Prefect or MLflow start (it used to fail 18 s in, with a raw NotADirectoryError)."""
    import os

    (tmp_path / "afile").write_text("x")
    (tmp_path / "ro").mkdir(mode=0o555)
    if where == "ro/store" and os.geteuid() == 0:
        pytest.skip("root writes into a read-only folder")
    r = miles(cmd, "tiny", flag, where, cwd=tmp_path, timeout=60)
    assert r.returncode == 2 and flag in r.stderr and where in r.stderr, r.stderr
    assert not any(s in r.stdout + r.stderr for s in FLOW_STARTED)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    from tools.sample_files import write_samples

    return write_samples(tmp_path_factory.mktemp("bench"))


def test_miles_eval_prints_a_table_per_task_and_logs_fingerprints(files: dict, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture) -> None:
    """`miles eval --model DIR --tasks ... --preset ...` on a tiny LLaDA-layout checkpoint with
    its chat template: one row per task, JSON with the config per cell, an MLflow run."""
    import json

    import mlflow

    from miles.cli import main
    from miles_core.models.hf import init_tiny

    model = init_tiny("llada", tmp_path / "llada", seed=1)
    data_dir = Path(files["gsm8k"]["test"]).parent
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    # CPU-sized: 16 tokens in 4 steps instead of a preset (test_presets_are_recorded covers those)
    rc = main(["eval", "eval.preset=", "eval.steps=4", "task.completion_len=16", "--model", str(model), "--tasks",
               "gsm8k,sudoku,mbpp", "--data-dir", str(data_dir), "--num-problems", "2", "--run-dir",
               str(tmp_path / "run"), "--tracking-uri", uri])
    out = capsys.readouterr().out
    assert rc == 0, out
    for task in ("gsm8k", "sudoku", "mbpp"):
        assert f"| {task}" in out
    res = json.loads((tmp_path / "run" / "benchmarks.json").read_text())
    cells = {c["task"]: c for c in res["cells"]}
    assert (cells["gsm8k"]["config"]["completion_len"], cells["gsm8k"]["config"]["steps"]) == (16, 4)
    assert cells["gsm8k"]["config"]["prompt_template"] == "chat" and cells["gsm8k"]["config"]["prompt_prefill"]
    assert cells["sudoku"]["config"]["prompt_prefill"] == "" and cells["mbpp"]["num_problems"] == 2
    mlflow.set_tracking_uri(uri)
    run = mlflow.get_run(json.loads(out[out.index("{"):])["mlflow_run_id"])
    assert run.data.tags["miles.eval_fingerprint.sudoku"] == cells["sudoku"]["fingerprint"]
    assert "gsm8k/pass1" in run.data.metrics
    assert main(["eval", "--model", str(model), "--tasks", "gsm8k", "--data-dir", str(tmp_path)]) == 1


def test_data_check_reports_skipped_rows_and_exit_codes(files: dict, tmp_path: Path) -> None:
    r = miles("data", "check", str(files["gsm8k"]["test"]), "--task", "gsm8k")
    assert r.returncode == 0 and "4 gsm8k rows loaded, 6 skipped" in r.stdout
    assert "skipped line 9: field 'answer' has no '#### <final answer>' marker" in r.stdout
    assert miles("data", "check", str(files["sudoku"]["test"]), "--task", "sudoku", "--strict").returncode == 1
    gone = miles("data", "check", str(tmp_path / "none.jsonl"), "--task", "gsm8k")
    assert gone.returncode == 2 and "none.jsonl: file not found" in gone.stderr
    assert "unknown task 'gsm9k'" in miles("data", "check", "x", "--task", "gsm9k").stderr
