"""Data-parallel ADPO (miles_core/distributed.py): row sharding, the size-1 no-op, and a real
2-rank gloo run under torchrun that must land on the single-process parameters."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from miles_core.algo.advantages import group_advantages
from miles_core.algo.update import adpo_update
from miles_core.config import ADPOConfig, SamplerConfig, load_recipe
from miles_core.parallel import World, shard_bounds
from miles_core.models.llama import init_checkpoint
from miles_core.models.lora import add_lora
from miles_core.models.tiny import TinyConfig, TinyDenoiser
from miles_core.samplers.sampler import sample
from miles_core.data.registry import build_task
from miles_core.learner.policy import Learner
from miles_core.storage import AdapterRegistry, TrajectoryStore
from miles_core.tokenizer import CharTokenizer

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]
# Two optimizer steps (minibatches) so the frozen-prox scoring is sharded and all-reduced too;
# small chunks so each rank runs several backward passes per minibatch.
OVERRIDES = ["adpo.num_minibatches=2", "adpo.row_chunk=5", "adpo.step_fraction=0.5", "adpo.kl_coef=0.1"]


def test_shard_bounds_partition_every_minibatch():
    for n in range(0, 12):
        for size in (1, 2, 3, 4):
            blocks = [shard_bounds(n, r, size) for r in range(size)]
            assert blocks[0][0] == 0 and blocks[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))             # contiguous, disjoint
            assert max(hi - lo for lo, hi in blocks) - min(hi - lo for lo, hi in blocks) <= 1
    idx = torch.tensor([7, 3, 9, 1, 4])
    assert torch.equal(torch.cat([World(r, 2).shard(idx) for r in range(2)]), idx)
    with pytest.raises(ValueError, match="rank 2 is outside a world of size 2"):
        shard_bounds(5, 2, 2)


def test_world_of_size_one_is_bit_identical_to_no_world():
    tok = CharTokenizer()
    results = []
    for world in (None, World()):
        torch.manual_seed(0)
        model = add_lora(TinyDenoiser(TinyConfig(tok.vocab_size, d_model=32, n_layers=1, n_heads=2, d_ff=64, max_len=40)), 4, 8)
        prompts = [tok.encode(p) for p in ("1+2", "3*4") for _ in range(3)]
        batch = sample(model, tok, prompts, SamplerConfig(steps=4), 8, torch.Generator().manual_seed(0),
                       torch.arange(2).repeat_interleave(3))
        batch.reward = torch.arange(6, dtype=torch.float32) % 3
        batch.advantage = group_advantages(batch.reward, batch.group_id)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        stats = adpo_update(model, opt, batch, ADPOConfig(num_minibatches=2, row_chunk=3), tok, 1.0,
                            torch.Generator().manual_seed(1), world=world)
        results.append((stats, {k: v.clone() for k, v in model.state_dict().items() if "lora_" in k}))
    assert results[0][0] == results[1][0]
    assert all(torch.equal(results[0][1][k], results[1][1][k]) for k in results[0][1])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_rank_gloo_update_equals_one_process(tmp_path):
    """Same stored batch, same seed: 2 gloo ranks (rows sharded) == one process (all rows)."""
    base = init_checkpoint(tmp_path / "base", hidden=32, layers=2, heads=2, intermediate=64)
    cfg = load_recipe("llama_tiny", OVERRIDES)
    sampler = Learner(load_recipe("llama_tiny", [*OVERRIDES, "train.seed=7"]), base)  # another policy: off-policy rows
    batch = sampler.sample(build_task(cfg), 0)   # prompts of different lengths
    batch.reward = torch.arange(len(batch), dtype=torch.float32) % 3       # varied rewards in every group
    batch.advantage = group_advantages(batch.reward, batch.group_id)
    store = TrajectoryStore(tmp_path / "store")
    bid = store.write_batch(batch)

    ref = Learner(cfg, base)  # the single-process learner, over the same stored rows
    ref_stats = ref.update(store.read_batch(bid))
    assert ref_stats["rows"] >= 8

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
           "-m", "miles_core.distributed", "--recipe", "llama_tiny", "--set", *OVERRIDES,
           "--base", str(base), "--store", str(tmp_path / "store"), "--out", str(tmp_path / "out"),
           "--registry", str(tmp_path / "registry"), "--seed", "0", "--backend", "gloo"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]

    out = tmp_path / "out"
    lines = (out / "stats.jsonl").read_text().splitlines()
    assert len(lines) == 1  # rank 0 alone writes: one line per update, not one per rank
    dist_stats = json.loads(lines[0])
    assert dist_stats["world_size"] == 2 and dist_stats["batch_id"] == bid
    for k in ("rows", "tokens", "trajectories"):
        assert dist_stats[k] == ref_stats[k], k
    for k in ("loss", "clip_frac", "iw_mean", "kl_ref", "entropy", "approx_kl", "grad_norm"):
        assert dist_stats[k] == pytest.approx(ref_stats[k], rel=1e-4, abs=1e-6), k

    got = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    ref.save_adapter(tmp_path / "ref_adapter")
    want = load_file(str(tmp_path / "ref_adapter" / "adapter_model.safetensors"))
    assert got.keys() == want.keys() and any("mlp.down_proj" in k for k in got)
    init = Learner(cfg, base).model.state_dict()
    moved = 0
    for k in want:
        assert torch.allclose(got[k], want[k], atol=1e-5, rtol=1e-4), k
        # saved in the published layout (lora.save_adapter): the module path without Miles' wrapper
        full = next(n for n in init if n.endswith("." + k.removeprefix("base_model.model.").replace(".weight", ".default.weight")))
        moved += int(not torch.equal(init[full], want[k]))
    assert moved > len(want) // 2  # the update really moved the adapter (A and B alike)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["backend"] == "gloo" and summary["published_version"] == 1
    assert AdapterRegistry(tmp_path / "registry").latest_version() == 1


def test_remote_base_is_downloaded_once_and_torchrun_command(tmp_path):
    import fsspec

    from miles_core.distributed import local_base, torchrun_command

    fs = fsspec.filesystem("memory")
    fs.pipe_file("/ckpt/base/config.json", b'{"model_type": "llama"}')
    fs.pipe_file("/ckpt/base/sub/tokenizer.json", b"{}")
    got = Path(local_base("memory://ckpt/base", tmp_path, World()))
    assert json.loads((got / "config.json").read_text()) == {"model_type": "llama"} and (got / "sub" / "tokenizer.json").exists()
    fs.pipe_file("/ckpt/base/config.json", b"changed")
    assert local_base("memory://ckpt/base", tmp_path, World()) == str(got)  # cached: not fetched again
    assert (got / "config.json").read_bytes() != b"changed"
    with pytest.raises(FileNotFoundError, match="no config.json"):
        local_base("memory://nothing/here", tmp_path / "other", World())
    assert local_base(str(tmp_path), tmp_path, World()) == str(tmp_path)
    cmd = torchrun_command(4, "llama_tiny", "s3://b/base", "s3://b/traj", "/out", registry="s3://b/ad",
                           overrides=["adpo.lr=0.01"], batches=["x"])
    assert cmd[1:4] == ["-m", "torch.distributed.run", "--standalone"] and cmd[cmd.index("--nproc-per-node") + 1] == "4"
    assert cmd[-2:] == ["--set", "adpo.lr=0.01"] and cmd[cmd.index("--batch") + 1] == "x"
