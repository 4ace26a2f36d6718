"""The prepared check for a lent GPU: rollouts and one ADPO update at real-model shapes,
written to one JSON. Run it through ``benchmarks/gpu_check.sh`` (under 8 minutes on an H200).

Models, random-init in bf16 directly on the device (nothing is downloaded):
* LLaDA-8B's shape (32 layers, hidden 4096, 32 heads, MLP 12288, vocab 126,464), bidirectional;
* SDAR-4B's shape (36 layers, hidden 2560, 32 heads / 8 KV heads, head 128, MLP 9728, vocab
  151,936), block-causal with blocks of 4.
For each, at batch 1 and ``--batch``: the LLaDA-style reference (benchmarks/speed/rollout.py: a full
forward and the whole sequence's logits every step, timed over its first steps, each of which costs
the same) against Miles' sampler (NSD + dual cache for LLaDA, NSD + prefix cache for SDAR, where
block-causal attention makes it exact in principle when the prefix ends on a model block boundary),
whole rollouts, completion 256, block 32.
Random weights are never confident, so NSD commits one token per step here: the figures are the
engine's, at the reference's number of steps. Host reads in Miles' rollout are counted on the
device (HostReads sees the real device-to-host copies there).
One ADPO update on the LLaDA shape: ``--batch`` completions of 256 tokens over 16 steps, LoRA
r=64 (fp32 adapters on the bf16 base), ``update.chunk_tokens`` 32768: seconds and peak memory; then
the same update with ``update.grad_checkpointing`` (every layer recomputed in backward).
One ADPO update on a random-init DiffusionGemma at the published text sizes (``dgemma_update``).
``--async-8b``, a second command (each stays under the device tool's 10 minutes): asynchronous
against synchronous ADPO at the LLaDA-8B shape on the one GPU. A random-init checkpoint in LLaDA's
published layout (bf16) is written once, then ``benchmarks.async_vs_sync`` runs on it: the arith
recipe's prompts through the family's tokenizer, a sampler and the learner as separate processes
sharing the GPU, against one process doing rollout -> update in turn. Random weights earn no reward,
so ``update.skip_zero_variance=false`` makes every batch cost a full update and the collapse guard
is off (the throughput is real; the pass@1 is not a result).

``--cpu`` runs the same code at toy sizes (a test does, so the script cannot rot unseen);
``--smoke`` is ``--cpu`` at smaller ones still (batch 2, prompt 16, one block of 8, 2 reference steps),
on the CPU whatever the machine has, writing gpu_check_smoke.json unless ``--out`` names a file.
Run: python -m benchmarks.gpu_check [--cpu] [--smoke] [--batch 64] [--out FILE] [--async-8b]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks.harness import add_smoke, check_measured, synthetic_batch, write_result
from tools.llada_reference import reference_generate
from miles_core.config import AdpoSettings, SamplerConfig, UpdateConfig
from miles_core.models.families import SPECS
from miles_core.models.hf import HFDiffusion, native_classes, tiny_tokenizer
from miles_core.models.hf_tokenizer import HFTokenizer
from miles_core.samplers.hostreads import HostReads
from miles_core.samplers.sampler import sample
from miles_core.models.window import attention_grid

SHAPES = {
    "llada_8b": ("llada", {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                           "num_key_value_heads": 32, "intermediate_size": 12288, "vocab_size": 126464}),
    "sdar_4b": ("sdar", {"hidden_size": 2560, "num_hidden_layers": 36, "num_attention_heads": 32,
                         "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 9728, "vocab_size": 151936}),
}
TOY = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
       "intermediate_size": 128, "head_dim": 16}
# (batch, completion, block, reference steps timed at batch 1, at ``batch``, prompt tokens): --smoke's
# (one block; --cpu's are 4, 64, --block, 8, 4, 64)
SMOKE_SIZES = (2, 8, 8, 2, 2, 16)


def build(name: str, device: torch.device, dtype: torch.dtype, toy: bool) -> tuple[HFDiffusion, HFTokenizer]:
    """A random-init model of ``name``'s shape, built on the device in ``dtype``."""
    family, dims = SHAPES[name]
    spec = SPECS[family]
    cfg_cls, lm_cls = native_classes(spec)
    dims = {**dims, **(TOY if toy else {})}
    if spec.native == "llama":
        dims.pop("head_dim", None)
    config = cfg_cls(**dims, max_position_embeddings=1024, tie_word_embeddings=False, eos_token_id=spec.eos_id,
                     pad_token_id=spec.eos_id, bos_token_id=None)
    config._attn_implementation = "sdpa"
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            torch.manual_seed(0)
            lm = lm_cls(config)
    finally:
        torch.set_default_dtype(old)
    model = HFDiffusion(lm.eval(), spec, block_size=4)
    return model, HFTokenizer(tiny_tokenizer(spec, dims["vocab_size"]))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def rollouts(model, tok, device, batch: int, completion: int, block: int, cache: str, ref_steps: int,
             prompt_len: int = 64) -> dict:
    """Reference tokens/s over its first steps against a whole Miles rollout (NSD + ``cache``) after
    ``prompt_len`` prompt tokens; a block-causal model (SDAR) decodes on its own attention blocks, in both."""
    grid = attention_grid(model)
    block = grid or block
    prompt = torch.randint(200, 100_000, (batch, prompt_len), generator=torch.Generator().manual_seed(batch)).to(device)
    with torch.no_grad():
        sync(device)
        t0 = time.perf_counter()
        _, ran = reference_generate(model, prompt, tok.mask_id, tok.forbidden_ids, completion, block, completion,
                                    max_steps=ref_steps, grid=grid)
        sync(device)
        ref_s = time.perf_counter() - t0
    cfg = SamplerConfig(kind="nsd", threshold=0.9, max_per_step=block, block_size=block, temperature=0.0, cache=cache)
    with HostReads() as reads:
        sync(device)
        t0 = time.perf_counter()
        out = sample(model, tok, prompt.tolist(), cfg, completion, torch.Generator().manual_seed(0))
        sync(device)
        sec = time.perf_counter() - t0
    return {"batch": batch, "reference_tokens_per_s": batch * ran / ref_s, "reference_steps_timed": ran,
            "miles_tokens_per_s": batch * completion / sec, "miles_seconds": sec,
            "miles_nfe_mean": float(out.nfe.float().mean()), "speedup": (batch * completion / sec) / (batch * ran / ref_s),
            "miles_host_reads": reads.count, "miles_host_bytes": reads.bytes, "cache": cache}


def updates(model, tok, device, batch: int, completion: int, prompt_len: int = 64) -> tuple[dict, dict]:
    """One ADPO update (LoRA r=64) on synthetic trajectories of 16 steps, then the same update with
    every layer recomputed in backward (``update.grad_checkpointing``): seconds and peak memory of each."""
    from miles_core.models.activations import checkpoint_layers
    from miles_core.models.lora import add_lora

    for p in model.parameters():
        p.requires_grad_(False)
    torch.manual_seed(0)
    policy = add_lora(model, r=64, alpha=128)
    params = [p for p in policy.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    trajs = synthetic_batch(tok, batch, prompt_len, completion, 16, seed=0)
    plain = one_update(policy, params, opt, tok, device, trajs, completion)
    layers = checkpoint_layers(policy)
    return plain, {**one_update(policy, params, opt, tok, device, trajs, completion), "checkpointed_layers": layers}


def one_update(policy, params, opt, tok, device, trajs, completion: int) -> dict:
    """One ADPO update of ``policy`` on ``trajs`` (memory budget 32768 positions per chunk), every
    recorded step a row (step fraction 1: the largest update; the recipes' default scores half as many)."""
    from miles_core.algo.update import update_policy

    batch = len(trajs)
    cfg = UpdateConfig(estimator="adpo", chunk_tokens=32768, num_minibatches=1, epochs=1, skip_zero_variance=False)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base_mem = torch.cuda.memory_allocated()
    sync(device)
    t0 = time.perf_counter()
    stats = update_policy(policy, opt, trajs, cfg, tok, 1.0, torch.Generator().manual_seed(0),
                          own=AdpoSettings(step_fraction=1.0))
    sync(device)
    sec = time.perf_counter() - t0
    peak = (torch.cuda.max_memory_allocated() - base_mem) / 2**30 if device.type == "cuda" else float("nan")
    return {"completions": batch, "tokens": batch * completion, "rows": int(stats.get("rows", 0)), "seconds": sec,
            "tokens_per_s": batch * completion / sec, "peak_gib_above_weights": peak,
            "lora_parameters": sum(p.numel() for p in params), "adapter_dtype": str(params[0].dtype)}


def dgemma_update(device: torch.device, dtype: torch.dtype, toy: bool, batch: int, completion: int) -> dict:
    """One ADPO update on a random-init DiffusionGemma at the published text sizes (hidden 2304,
    30 layers, 8 heads of 256, MLP 9216, vocab 262,144, 5 sliding : 1 full; 4 experts of 1152
    where the 26B-A4B has more): ``batch`` canvases of ``completion`` over 8 recorded steps, a
    quarter of each canvas accepted per step, LoRA r=64 on the decoder, 8 rows per chunk."""
    import dataclasses

    from transformers import DiffusionGemmaForBlockDiffusion

    from miles_core.algo.update import update_policy
    from miles_core.config import RenoiseConfig
    from miles_core.models.diffusion_gemma import text_only_config
    from miles_core.models.lora import add_lora
    from miles_core.tokenizer import CharTokenizer
    from miles_core.types import RenoiseBatch

    size = dict(hidden=64, layers=2, heads=4) if toy else dict(hidden=2304, layers=30, heads=8, head_dim=256,
                                                               intermediate=9216, full_every=6, sliding_window=512)
    vocab = 512 if toy else 262_144
    cfg = text_only_config(vocab, pad_id=0, eos_id=2, canvas_length=completion, **size)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            torch.manual_seed(0)
            model = DiffusionGemmaForBlockDiffusion(cfg).eval()
    finally:
        torch.set_default_dtype(old)
    n_params = sum(p.numel() for p in model.parameters())
    for p in model.parameters():
        p.requires_grad_(False)
    policy = add_lora(model, r=64, alpha=128)
    params = [p for p in policy.parameters() if p.requires_grad]
    g, k = torch.Generator().manual_seed(0), 8
    acc = torch.rand(batch, k, completion, generator=g) < 0.25
    trajs = RenoiseBatch(
        prompt_ids=[[5] * 32] * batch, completion_ids=torch.randint(3, vocab, (batch, completion), generator=g),
        accepted=acc, tokens=torch.randint(3, vocab, acc.shape, generator=g) * acc, logp=torch.full(acc.shape, -2.0) * acc,
        num_steps=torch.full((batch,), k), seed=torch.arange(batch), group_id=torch.arange(batch) // 8,
        policy_version=torch.zeros(batch, dtype=torch.long), advantage=torch.randn(batch, generator=g),
        sampler=dataclasses.asdict(RenoiseConfig(max_steps=k)))
    acfg = UpdateConfig(row_chunk=8, num_minibatches=1, epochs=1, skip_zero_variance=False)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base_mem = torch.cuda.memory_allocated()
    sync(device)
    t0 = time.perf_counter()
    stats = update_policy(policy, torch.optim.AdamW(params, lr=1e-5), trajs, acfg, CharTokenizer(), 1.0,
                        torch.Generator().manual_seed(0))
    sync(device)
    sec = time.perf_counter() - t0
    peak = (torch.cuda.max_memory_allocated() - base_mem) / 2**30 if device.type == "cuda" else float("nan")
    return {"parameters": n_params, "completions": batch, "canvas": completion, "steps": k,
            "rows": int(stats.get("rows", 0)), "seconds": sec, "peak_gib_above_weights": peak,
            "lora_parameters": sum(p.numel() for p in params)}


# async_vs_sync at 8B: 12 batches of 8 prompts x 8 completions (64 per batch, as the update above)
ASYNC_SETTINGS = ["async_rl.batches_per_sampler=12", "train.prompts_per_iter=8", "train.group_size=8",
                  "update.skip_zero_variance=false", "guard.enabled=false", "eval.num_problems=64", "model.backend=hf"]


def async_at_scale(device: torch.device, toy: bool, out: Path, workdir: Path) -> dict:
    """Write the LLaDA-8B-shaped checkpoint (toy sizes with ``toy``) and run benchmarks.async_vs_sync
    on it in a child process -> its JSON, also written to ``out``."""
    import subprocess
    import sys

    from miles_core.models.hf import init_tiny

    ckpt = workdir / "llada_8b"
    dims = {k: v for k, v in SHAPES["llada_8b"][1].items() if k != "vocab_size"}
    toy_dims = {k: v for k, v in TOY.items() if k != "head_dim"} if toy else {}   # Llama derives its head_dim
    dims = {**dims, **toy_dims, "max_position_embeddings": 4096}
    t0 = time.perf_counter()
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32 if toy else torch.bfloat16)
    try:
        with torch.device(device):  # built where it runs (seconds on a GPU), saved in the published layout
            init_tiny("llada", ckpt, size=dims, dtype=torch.get_default_dtype())
    finally:
        torch.set_default_dtype(old)
    write_s = time.perf_counter() - t0
    settings = [*ASYNC_SETTINGS, f"model.path={ckpt}", f"model.device={device.type}",
                f"model.dtype={'float32' if toy else 'bfloat16'}"]
    if toy:
        settings += ["async_rl.batches_per_sampler=3", "train.prompts_per_iter=2", "train.group_size=4",
                     "eval.num_problems=4", "eval.batch_size=4"]
    cmd = [sys.executable, "-u", "-m", "benchmarks.async_vs_sync", "--checkpoint", str(ckpt), "--no-ceiling", "--cold",
           "--workdir", str(workdir / "run"), "--out", str(out.resolve())]
    cmd += [a for kv in settings for a in ("--set", kv)]
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=Path(__file__).resolve().parents[2])
    result = {**json.loads(out.read_text()), "checkpoint_write_s": write_s, "command": " ".join(cmd[2:])}
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return result


def main(argv: list[str] | None = None) -> dict:
    ap = add_smoke(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    ap.add_argument("--cpu", action="store_true", help="toy sizes on the CPU (the code path, not the figures)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--completion", type=int, default=256)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--out", default=None, metavar="FILE",
                    help="the result JSON (default: benchmarks/results/gpu_check.json, _smoke with --smoke)")
    ap.add_argument("--async-8b", action="store_true", help="instead: async vs sync ADPO at the LLaDA-8B shape "
                    "(writes OUT with _async before .json)")
    ap.add_argument("--workdir", default=None, help="--async-8b: where the checkpoint and the run go (default: a temp dir)")
    args = ap.parse_args(argv)
    args.cpu = args.cpu or args.smoke   # --smoke: the --cpu path at smaller sizes, CUDA or not
    device = torch.device("cpu" if args.cpu else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check: torch sees no CUDA device (use --cpu for the code path)")
    if args.async_8b:
        import tempfile

        out = Path(args.out or "benchmarks/results/gpu_check.json")
        work = Path(args.workdir or tempfile.mkdtemp(prefix="miles-gpu-async-"))
        return async_at_scale(device, args.cpu, out.with_name(out.stem + "_async.json"), work)
    dtype = torch.float32 if args.cpu else torch.bfloat16
    if args.smoke:
        batch, completion, block, ref1, refb, prompt_len = SMOKE_SIZES
    elif args.cpu:
        batch, completion, block, ref1, refb, prompt_len = 4, 64, args.block, 8, 4, 64
    else:
        batch, completion, block, ref1, refb, prompt_len = args.batch, args.completion, args.block, 8, 4, 64
    t_all = time.perf_counter()
    result: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "dtype": str(dtype),
                    "torch": torch.__version__, "models": {}}
    for name, cache in (("llada_8b", "dual"), ("sdar_4b", "prefix")):
        t0 = time.perf_counter()
        model, tok = build(name, device, dtype, args.cpu)
        entry = {"parameters": sum(p.numel() for p in model.parameters()), "build_s": time.perf_counter() - t0,
                 "rollouts": [rollouts(model, tok, device, b, completion, block, cache, ref1 if b == 1 else refb,
                                       prompt_len) for b in (1, batch)]}
        if name == "llada_8b":
            entry["update"], entry["update_checkpointed"] = updates(model, tok, device, batch, completion, prompt_len)
        result["models"][name] = entry
        for r in entry["rollouts"]:
            print(f"{name} batch {r['batch']}: reference {r['reference_tokens_per_s']:.1f} tok/s, Miles "
                  f"(nsd+{cache}) {r['miles_tokens_per_s']:.1f} tok/s ({r['speedup']:.1f}x), "
                  f"{r['miles_host_reads']} host reads", flush=True)
        for key, what in (("update", "ADPO update"), ("update_checkpointed", "ADPO update, grad checkpointing")):
            if key in entry:
                u = entry[key]
                print(f"{name} {what}: {u['completions']} x {completion} tokens, {u['rows']} rows, "
                      f"{u['seconds']:.1f}s, peak {u['peak_gib_above_weights']:.1f} GiB above the weights", flush=True)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    d = dgemma_update(device, dtype, args.cpu, batch, completion)
    result["models"]["diffusion_gemma_5b"] = {"parameters": d["parameters"], "update": d}
    print(f"diffusion_gemma ({d['parameters'] / 1e9:.1f}B) ADPO update: {d['completions']} x {d['canvas']} canvas, "
          f"{d['steps']} steps, {d['rows']} rows, {d['seconds']:.1f}s, peak {d['peak_gib_above_weights']:.1f} GiB "
          "above the weights", flush=True)
    result["seconds"], result["smoke"] = time.perf_counter() - t_all, args.smoke
    # each rollout must have timed tokens from both decoders (a list per model: checked keyed)
    check_measured("gpu_check", {"rollouts": {f"{m} batch {r['batch']}": r for m, e in result["models"].items()
                                              for r in e.get("rollouts", [])}},
                   positive=["rollouts.*.reference_tokens_per_s", "rollouts.*.reference_steps_timed",
                             "rollouts.*.miles_tokens_per_s", "rollouts.*.miles_seconds", "rollouts.*.miles_nfe_mean"])
    out = write_result("gpu_check", result, args.out, positive=[
        "seconds", "models.*.parameters", *(f"models.{k}.{m}" for k in ("llada_8b.update", "llada_8b.update_checkpointed",
                                                                        "diffusion_gemma_5b.update")
                                            for m in ("rows", "seconds", "lora_parameters")),
        "models.llada_8b.update.tokens_per_s", "models.llada_8b.update_checkpointed.checkpointed_layers"],
        present=["device", "models.llada_8b.rollouts", "models.sdar_4b.rollouts"])
    print(f"wrote {out} in {result['seconds']:.0f}s")
    return result


if __name__ == "__main__":
    main()
