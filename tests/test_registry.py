"""The registered champion is usable outside Miles: a fresh Python process loads it with plain
``mlflow.pyfunc`` and generates, and its adapter loads with plain ``peft``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from conftest import TrainedProject
from peft import PeftModel
from safetensors.torch import load_file

from miles_core.config import load_recipe
from miles_core.eval.evaluate import sampler_for
from miles_core.models.tiny import TinyDenoiser
from miles_core.samplers.sampler import sample
from miles_core.eval.evaluate import eval_config
from miles_core.storage import AdapterRegistry
from miles_core.tokenizer import CharTokenizer
from tracking import registry

import pytest

pytestmark = pytest.mark.e2e

PROMPTS = ["3+4*2", "9 - 2*3"]

CHILD = """
import json, sys
import mlflow.pyfunc
import pandas as pd
model = mlflow.pyfunc.load_model(sys.argv[1])
as_list = model.predict(["3+4*2", "9 - 2*3"])
as_frame = model.predict(pd.DataFrame({"prompt": ["3+4*2", "9 - 2*3"]}))
import miles_core

print(json.dumps({"list": list(as_list), "frame": [str(x) for x in as_frame], "miles_core": miles_core.__file__}))
"""


def _child_env(project: TrainedProject) -> dict[str, str]:
    """The test's environment minus anything that would put this checkout on the child's path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(project.env)
    return env


def test_champion_loads_and_generates_in_a_fresh_process(trained: TrainedProject, tmp_path: Path) -> None:
    uri = f"models:/{trained.model_name}@champion"
    proc = subprocess.run([sys.executable, "-c", CHILD, uri], cwd=tmp_path, env=_child_env(trained),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Add type hints" not in proc.stderr  # predict is annotated: MLflow prints no advice at load
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(out["list"]) == 2 and all(isinstance(s, str) for s in out["list"])
    assert out["frame"] == out["list"]  # list or DataFrame input, same greedy answers
    # the model carries its own miles_core (MLflow code path), not this checkout's
    assert "code" in Path(out["miles_core"]).parts
    assert not Path(out["miles_core"]).resolve().is_relative_to(Path(__file__).resolve().parents[1])

    # the same answers as sampling the trained policy directly with the recipe's eval settings
    src = registry.resolve_model(uri, tmp_path / "dl")
    base = TinyDenoiser.from_pretrained(src["base_dir"])
    policy = PeftModel.from_pretrained(base, src["adapter_dir"]).eval()
    tok = CharTokenizer.load(src["base_dir"])
    ec = eval_config(load_recipe(src["recipe"]))
    ids = [tok.encode("".join(p.split())) for p in PROMPTS]
    direct = sample(policy, tok, ids, sampler_for(ec), ec.completion_len, torch.Generator().manual_seed(ec.seed))
    assert direct.completions == out["list"]


def test_registered_adapter_loads_with_plain_peft(trained: TrainedProject, tmp_path: Path) -> None:
    src = registry.resolve_model(f"models:/{trained.model_name}@champion", tmp_path / "dl")
    adapter_dir = Path(src["adapter_dir"])
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in adapter_dir.iterdir()}
    base = TinyDenoiser.from_pretrained(src["base_dir"]).eval()
    x = torch.tensor([CharTokenizer().encode("3+4*2") + [CharTokenizer().mask_id] * 8])
    with torch.no_grad():
        before = base(x).clone()
        model = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
        after = model(x)
    weights = load_file(str(adapter_dir / "adapter_model.safetensors"))
    assert any("lora_B" in k for k in weights)
    # the adapter says what it belongs to: the base's name and the hash of its weights; once
    # resolved, it names the downloaded base, so peft's AutoPeftModel finds it
    from miles_core.models.base import base_identity

    ident = base_identity(src["base_dir"])
    assert json.loads((adapter_dir / "adapter_config.json").read_text())["base_model_name_or_path"] == ident["path"]
    recorded = json.loads((adapter_dir / "miles_base.json").read_text())
    assert (recorded["name"], recorded["sha256"]) == (ident["name"], ident["sha256"]) and len(ident["sha256"]) == 64
    assert any(float(v.abs().max()) > 0 for k, v in weights.items() if "lora_B" in k), "ADPO never moved the adapter"
    assert not torch.allclose(before, after)  # the adapter changes the policy
    # and it is byte-for-byte the version published to the store by the training run
    fetched = AdapterRegistry(trained.store_uri).fetch(trained.train["adapter_version"], tmp_path / "fetched")
    stored = load_file(str(fetched / "adapter_model.safetensors"))
    assert stored.keys() == weights.keys() and all(torch.equal(stored[k], weights[k]) for k in weights)


def test_registered_model_serves_over_http_without_the_venv_on_path(trained: TrainedProject, tmp_path: Path) -> None:
    """`miles serve` as printed by the demo: a clean PATH (no venv), the project's store, a real
    HTTP request; and the model's requirements install torch from PyTorch's CPU index."""
    import socket
    import time
    import urllib.request

    import mlflow.artifacts

    req = Path(mlflow.artifacts.download_artifacts(f"models:/{trained.model_name}@champion",
                                                   dst_path=str(tmp_path / "art"))) / "requirements.txt"
    assert req.read_text().splitlines()[0] == registry.TORCH_CPU_INDEX
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**_child_env(trained), "PATH": "/usr/bin:/bin"}
    miles_exe = str(Path(sys.executable).parent / "miles")
    proc = subprocess.Popen([miles_exe, "serve", "--model", f"models:/{trained.model_name}@champion", "--port",
                             str(port)], cwd=trained.root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        deadline, body = time.monotonic() + 240, None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                r = urllib.request.urlopen(urllib.request.Request(
                    f"http://127.0.0.1:{port}/invocations", data=json.dumps({"inputs": PROMPTS}).encode(),
                    headers={"Content-Type": "application/json"}), timeout=30)
                body = json.loads(r.read())
                break
            except OSError:
                time.sleep(1)
        assert body is not None, (proc.stdout.read(4000) if proc.poll() is not None else "no answer in time")
        preds = body["predictions"]
        assert len(preds) == 2 and all(isinstance(p, str) for p in preds)
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()


def test_policy_is_a_logged_model_of_its_training_run(trained: TrainedProject) -> None:
    """The registered version points at an MLflow 3 LoggedModel (the UI's "Logged models" tab): READY,
    produced by the training run, with the pyfunc's signature and the pass@1 the version is tagged with."""
    from mlflow import MlflowClient
    from mlflow.models import Model

    client = MlflowClient(tracking_uri=trained.tracking_uri, registry_uri=trained.tracking_uri)
    mv = client.get_model_version_by_alias(trained.model_name, "champion")
    assert mv.source.startswith("models:/m-"), f"the version is not a LoggedModel: {mv.source}"
    model_id = mv.source.removeprefix("models:/")
    lm = client.get_logged_model(model_id)
    assert json.loads(lm.tags["mlflow.modelVersions"]) == [{"name": trained.model_name, "version": mv.version}]
    run_id = trained.train["mlflow_run_id"]
    assert (lm.status.to_string() if hasattr(lm.status, "to_string") else str(lm.status)).endswith("READY")
    assert lm.source_run_id == run_id and lm.tags["miles.registered_as"] == trained.model_name
    assert {m.key: m.value for m in lm.metrics or []}["pass1"] == float(mv.tags[registry.PASS1_TAG])
    outputs = client.get_run(run_id).outputs
    assert model_id in [o.model_id for o in outputs.model_outputs]
    mlmodel = Model.load(mv.source)
    assert mlmodel.signature is not None and [c.type.name for c in mlmodel.signature.inputs.inputs] == ["string"]
    assert {p.name for p in mlmodel.signature.params.params} == {"temperature", "seed", "max_tokens"}


def test_export_merges_a_registered_model_into_a_folder_with_a_card(trained: TrainedProject, tmp_path: Path) -> None:
    """`miles export models:/NAME@champion OUT`: the merged folder is the registered policy, and its
    card names the base, the recipe, the version, pass@1 and the evaluation fingerprint."""
    from miles.cli import main
    from miles_core.models.base import load_checkpoint

    out = tmp_path / "exported"
    assert main(["export", f"models:/{trained.model_name}@champion", str(out)]) == 0
    src = registry.resolve_model(f"models:/{trained.model_name}@champion", tmp_path / "dl")
    policy = PeftModel.from_pretrained(TinyDenoiser.from_pretrained(src["base_dir"]), src["adapter_dir"]).eval()
    merged, _ = load_checkpoint(out)
    x = torch.tensor([CharTokenizer().encode("3+4*2") + [CharTokenizer().mask_id] * 8])
    with torch.no_grad():
        assert torch.allclose(merged(x), policy(x), atol=1e-5)
    card = (out / "README.md").read_text()
    assert f"registry version: {src['version']}" in card and "pass@1" in card and "fingerprint" in card
    assert "recipe: `" in card
    # the tiny family's folder carries its remote code: transformers loads it (tests/test_adapters_outside.py)
    assert "library_name: transformers" in card and "trust_remote_code=True" in card
