"""Peak memory of ONE policy update versus the number of denoising steps K.

ADPO scores every recorded step as its own row, in chunks of a fixed ``row_chunk``, so the graph
alive at any moment covers one chunk of single-step rows, whatever K is. The baseline
backpropagates through the whole sampling chain (K denoiser calls with autograd on, one backward
at the end), so everything the K calls saved is alive at once. Both are measured for the
continuous diffusion policy and for the discrete masked-diffusion transformer.

What is measured: the peak over the update of the bytes held by tensors that autograd saved for
backward, counted through ``torch.autograd.graph.saved_tensors_hooks``: each distinct storage
once, freed when the graph that saved it is freed, parameters excluded (they are resident
whatever the method). This is the activation memory that differs between the methods, and it is
deterministic, unlike RSS on a shared machine. Writes benchmarks/results/memory.json.
Run: python -m benchmarks.memory [--ks 8 16 32 64] [--smoke]
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.harness import add_smoke, table, write_result
from miles_core.memory import SavedTensorMeter

KS = (8, 16, 32, 64)
# --smoke: the same two measurements at two small K and a handful of trajectories (seconds)
SMOKE = {"ks": [4, 8], "continuous_trajectories": 16, "discrete_sequences": 2}


def continuous_peaks(ks: tuple[int, ...], n_traj: int, row_chunk: int, seed: int) -> dict[str, dict[int, int]]:
    from miles_core.config import AdpoSettings, UpdateConfig
    from miles_core.continuous.policy import LORA_TARGETS, ContinuousDenoiser, DenoiserConfig, encode_prompts
    from miles_core.continuous.sde import DEFAULT_SCHEDULE, ddim_step
    from miles_core.continuous.task import ConstraintTask
    from miles_core.continuous.train import update_policy, rollout
    from miles_core.models.lora import add_lora, trainable_parameters
    from miles_core.tokenizer import CharTokenizer

    tok, task = CharTokenizer(), ConstraintTask()
    torch.manual_seed(seed)
    model = add_lora(ContinuousDenoiser(DenoiserConfig(4, tok.vocab_size, hidden=256)), r=8, alpha=16, targets=LORA_TARGETS)
    prompts = task.split("train")[: n_traj // 8]
    ids = encode_prompts(tok, prompts, model.config.prompt_len)
    params = trainable_parameters(model)
    out: dict[str, dict[int, int]] = {"adpo": {}, "chain": {}}
    for k in ks:
        g = torch.Generator().manual_seed(seed + k)
        batch = rollout(model, task, prompts, ids, 8, k, 1.0, g, schedule=DEFAULT_SCHEDULE)
        opt = torch.optim.SGD(params, lr=0.0)
        cfg = UpdateConfig(row_chunk=row_chunk, num_minibatches=1, epochs=1, skip_zero_variance=False)
        out["adpo"][k] = SavedTensorMeter(params).measure(
            lambda: update_policy(model, opt, batch, cfg, g, own=AdpoSettings(step_fraction=1.0)))

        def chain() -> None:  # the same K sampler steps (ddim_step) with grad, log-probs summed, one backward
            x = torch.randn(len(batch), 4, generator=g)
            total = torch.zeros(len(batch))
            for j in range(k):
                x, lp, _, _ = ddim_step(model, x, batch.timesteps[j], batch.timesteps[j + 1], batch.prompt_ids, 1.0, g)
                total = total + lp
            loss = -(batch.advantage * total).mean()
            opt.zero_grad()
            loss.backward()

        out["chain"][k] = SavedTensorMeter(params).measure(chain)
    return out


def discrete_peaks(ks: tuple[int, ...], n_seq: int, row_chunk: int, seed: int) -> dict[str, dict[int, int]]:
    from miles_core.config import AdpoSettings, SamplerConfig, UpdateConfig
    from miles_core.algo.update import update_policy
    from miles_core.models.lora import add_lora, trainable_parameters
    from miles_core.models.tiny import TinyConfig, TinyDenoiser
    from miles_core.samplers.sampler import sample, static_counts, topk_commit
    from miles_core.samplers.step import denoise_step, left_pad
    from miles_core.tokenizer import CharTokenizer

    tok = CharTokenizer()
    length = max(ks)
    torch.manual_seed(seed)
    model = add_lora(TinyDenoiser(TinyConfig(tok.vocab_size, d_model=64, n_layers=2, n_heads=4, d_ff=256, max_len=96)),
                     r=8, alpha=16)
    params = trainable_parameters(model)
    prompt_ids = [tok.encode(f"{11 * i + 3}+{7 * i}*{i % 9}=") for i in range(n_seq)]
    out: dict[str, dict[int, int]] = {"adpo": {}, "chain": {}}
    for k in ks:
        g = torch.Generator().manual_seed(seed + k)
        scfg = SamplerConfig(kind="static", steps=k, temperature=1.0)
        batch = sample(model, tok, prompt_ids, scfg, length, g)
        batch.advantage = torch.linspace(-1, 1, n_seq)
        opt = torch.optim.SGD(params, lr=0.0)
        cfg = UpdateConfig(row_chunk=row_chunk, num_minibatches=1, epochs=1, skip_zero_variance=False)
        out["adpo"][k] = SavedTensorMeter(params).measure(
            lambda: update_policy(model, opt, batch, cfg, tok, 1.0, g, own=AdpoSettings(step_fraction=1.0)))

        def chain() -> None:  # the same K sampler steps (denoise_step), with grad, summed log-probs
            prompt, real = left_pad(prompt_ids, tok.pad_id)
            width = prompt.shape[1]
            x = torch.cat([prompt, torch.full((n_seq, length), tok.mask_id, dtype=torch.long)], dim=1)
            attn = torch.cat([real, torch.ones(n_seq, length, dtype=torch.bool)], dim=1)
            total = torch.zeros(n_seq)
            for n in static_counts(length, k):
                step = denoise_step(model, x, attn, width, temperature=1.0, forbidden=tok.forbidden_ids, generator=g)
                eligible = x[:, width:] == tok.mask_id
                commit = topk_commit(step.confidence.detach(), eligible, torch.full((n_seq,), n))
                total = total + (step.logp * commit).sum(1)
                x = x.clone()
                x[:, width:] = torch.where(commit, step.tokens, x[:, width:])
            loss = -(batch.advantage * total).mean()
            opt.zero_grad()
            loss.backward()

        out["chain"][k] = SavedTensorMeter(params).measure(chain)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = add_smoke(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ks", type=int, nargs="+", default=list(KS), help="denoising steps K (the ratios: last / first)")
    ap.add_argument("--continuous-trajectories", type=int, default=64)
    ap.add_argument("--continuous-row-chunk", type=int, default=256)
    ap.add_argument("--discrete-sequences", type=int, default=8)
    ap.add_argument("--discrete-row-chunk", type=int, default=16)
    ap.add_argument("--out", default=None, metavar="FILE", help="the result JSON (default: benchmarks/results/memory.json)")
    args = ap.parse_args(argv)
    if args.smoke:
        vars(args).update(SMOKE)
    ks = tuple(args.ks)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    cont = continuous_peaks(ks, args.continuous_trajectories, args.continuous_row_chunk, args.seed)
    disc = discrete_peaks(ks, args.discrete_sequences, args.discrete_row_chunk, args.seed)
    mib = lambda b: b / 2**20  # noqa: E731
    rows = [[name, k, mib(res["adpo"][k]), mib(res["chain"][k]), res["chain"][k] / res["adpo"][k]]
            for name, res in (("continuous", cont), ("discrete", disc)) for k in ks]
    print(table(rows, ["model", "K", "adpo_MiB", "chain_MiB", "chain/adpo"]))
    ratio = lambda res, m: res[m][ks[-1]] / res[m][ks[0]]  # noqa: E731
    tag = f"{ks[-1]}_{ks[0]}"  # 64_8 at the default K
    payload = {
        "metric": "peak bytes of autograd-saved tensors during one policy update (storage-deduplicated, params excluded)",
        "ks": list(ks),
        f"adpo_ratio_{tag}": ratio(disc, "adpo"),
        f"chain_ratio_{tag}": ratio(disc, "chain"),
        f"continuous_adpo_ratio_{tag}": ratio(cont, "adpo"),
        f"continuous_chain_ratio_{tag}": ratio(cont, "chain"),
        "discrete": {"adpo_bytes": disc["adpo"], "chain_bytes": disc["chain"], f"adpo_ratio_{tag}": ratio(disc, "adpo"),
                     f"chain_ratio_{tag}": ratio(disc, "chain"), "sequences": args.discrete_sequences,
                     "row_chunk": args.discrete_row_chunk, "completion_len": max(ks)},
        "continuous": {"adpo_bytes": cont["adpo"], "chain_bytes": cont["chain"], f"adpo_ratio_{tag}": ratio(cont, "adpo"),
                       f"chain_ratio_{tag}": ratio(cont, "chain"), "trajectories": args.continuous_trajectories,
                       "row_chunk": args.continuous_row_chunk},
        "seed": args.seed,
        "seconds": time.perf_counter() - t0,
        "smoke": args.smoke,
    }
    print(f"ADPO peak K={ks[-1]}/K={ks[0]}: discrete {payload[f'adpo_ratio_{tag}']:.3f}, continuous "
          f"{payload[f'continuous_adpo_ratio_{tag}']:.3f}; chain baseline: discrete {payload[f'chain_ratio_{tag}']:.2f}, "
          f"continuous {payload[f'continuous_chain_ratio_{tag}']:.2f}")
    # every peak is a measurement: a 0 means the meter saw no saved tensor (the update or chain never ran)
    path = write_result("memory", payload, args.out, positive=[f"{m}.{k}_bytes.*" for m in ("discrete", "continuous")
                                                              for k in ("adpo", "chain")])
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
