"""An asynchronous run at cluster shape on this machine: the real sampler and learner code, real
processes, the real store protocol on a real S3 server (SeaweedFS) and real torch.distributed
collectives (gloo), with the model's compute replaced by a calibrated stand-in
(benchmarks/scale/standin.py: LLaDA-8B's rollout and update times and adapter bytes x ``SCALE``).

    python -m benchmarks.emulate [--processes 4 16 64] [--batches 4] [--chaos] [--smoke]
    python -m benchmarks.emulate --processes 16 --prompts 32 --slow-rank 1.1 --deal speed   # one GPU 10% slower

Per size P: placement.py splits P into samplers and learner ranks from the stand-in's seconds per
completion (LLaDA-8B's ratio) and sizes the global batch; samplers are forked from this process
(the stand-in installed, torch imported once: copy-on-write keeps 64 processes in 24 GiB), the
learner runs under torchrun as D gloo ranks. Reported per run: efficiency (completions/s consumed
after the first two updates, over the stand-in's ideal N x completions / (rollout + update)),
learner and sampler idle, dropped batches, the largest staleness, and store requests per
committed batch (every process's S3 requests, counted by botocore). ``--chaos`` SIGKILLs three
random samplers (restarted) and one learner rank (torchrun restarts the group) mid-run, then checks
that every batch was consumed exactly once within the staleness bound. ``--slow-rank X`` makes
the last learner rank X times slower all run long, ``--rank-spread CV`` each rank slower or faster
by a normal draw of that CV (seeded by the process count, so two runs compare like with like);
``--deal`` sets ``async_rl.deal`` (even blocks, or dealt by the ranks' measured speed);
``--rollout-tail P:X`` makes a share P of the rollouts take X times as long (drawn per batch);
``--global-batch B`` fixes the global batch at B sampler batches (strong scaling: admission then
holds samplers back), ``--refresh J`` turns on in-flight refresh every J steps and ``--staleness``
sets S; each run reports its steps' mean age and the adapters swapped in mid-rollout.
Writes benchmarks/results/emulate.json; benchmarks/scale/scale_model.py validates against it.
``--smoke``: one run of 2 processes (1 sampler, 1 learner rank), 5 batches, LLaDA-8B's seconds x 0.002
and bytes x 1e-4 (emulate_smoke.json).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from unittest import mock

from benchmarks.harness import MeasuredNothing, bench_args, finish, seaweed, usable_cpus
from benchmarks.standin import SCALE, settings
from benchmarks.update_pace import draw_slowness
from miles_core.asyncrl.launch import WarmProcess
from miles_core.asyncrl.launch import summarize as run_summary
from miles_core.config import load_recipe
from miles_core.learner.shares import deal_unit

REPO = Path(__file__).resolve().parents[2]
STALENESS = 6
MAX_SAMPLER_RESTARTS = 5  # chaos kills a sampler once; one that keeps exiting is broken, not unlucky
OVERRIDES = ["task.completion_len=16", "train.prompts_per_iter=4", "train.group_size=2", "sampler.steps=4",
             "estimators.adpo.step_fraction=0.5", "update.num_minibatches=4", "update.kl_coef=0.0", f"async_rl.max_staleness={STALENESS}",
             "lora.r=4", "lora.targets=q_proj,v_proj,ballast", "async_rl.sync_dtype=bfloat16",
             "async_rl.checkpoint_every=10", "async_rl.poll_interval=0.05", "async_rl.poll_backoff=2.0",
             "async_rl.poll_max_interval=1.0", "async_rl.retain_heap_mb=0", "guard.enabled=false",
             "update.skip_zero_variance=false"]  # every trajectory is learned on, as at scale (an untrained model scores 0)
# --smoke: one small run on the same path in seconds; 5 updates, so two count as steady (summarize)
SMOKE = {"processes": [2], "batches": 5, "scale": 0.002, "bytes_scale": 1e-4, "chaos": False}
SMOKE_STORE_PROBES = 3


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _kill_group(agent: subprocess.Popen) -> None:
    """SIGKILL torchrun's agent and the ranks it forked (killed alone, the agent leaves them running)."""
    for pid in _children(agent.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    agent.kill()
    agent.wait()


def stand_in(cfg: Any, scale: float = SCALE, bytes_scale: float | None = None) -> dict[str, Any]:
    """The stand-in's settings for the emulation recipe's batches (benchmarks/scale/standin.py)."""
    c = cfg.train.prompts_per_iter * cfg.train.group_size
    return {**settings(c, cfg.sampler.steps, cfg.estimators.adpo.step_fraction, scale, cfg.update.num_minibatches, bytes_scale),
            "lora_r": cfg.lora.r}


def cpu_times() -> tuple[float, float]:
    """(busy, total) jiffies of this machine so far (/proc/stat): how busy the run kept the CPUs."""
    fields = [float(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def trained_bytes(cfg: Any, base: Path) -> float:
    """float32 gradient bytes each optimizer step all-reduces: the tiny model's own LoRA (the
    stand-in's ballast is not trained, benchmarks/scale/standin.py says why)."""
    from miles_core.models.base import load_base
    from miles_core.models.lora import add_lora_from

    from benchmarks.standin import _ballast_frozen, fit

    model, _ = load_base(cfg, base)
    lora = _ballast_frozen(add_lora_from(fit(model, stand_in(cfg)), cfg.lora))  # fit: the ballast LoRA targets
    return 4.0 * sum(p.numel() for p in lora.parameters() if p.requires_grad)


def measure_store(server: Any, n: int = 30) -> dict[str, float]:
    """This SeaweedFS's cost per small request and bytes/s for a 4 MB object (the scale model's
    store inputs; its rate limit is not reached at these sizes and is set high: an assumption)."""
    from miles_core.storage import uri as U

    fs, root = U.resolve(f"s3://{server.bucket}/probe")
    t0 = time.perf_counter()
    for i in range(n):
        fs.pipe_file(f"{root}/k{i}", b"x")
        fs.cat_file(f"{root}/k{i}")
    latency = (time.perf_counter() - t0) / (2 * n)
    blob = os.urandom(4 << 20)
    t0 = time.perf_counter()
    fs.pipe_file(f"{root}/big", blob)
    fs.cat_file(f"{root}/big")
    bw = 2 * len(blob) / max(time.perf_counter() - t0 - 2 * latency, 1e-6)
    return {"store_latency_s": latency, "store_bytes_s": bw, "store_rate": 1e6, "batch_bytes": 30e3}


def slowness(ranks: int, spread: float, slow_rank: float, seed: int) -> list[float]:
    """[D] each learner rank's persistent time factor: the scale model's draw of CV ``spread``
    (update_pace.draw_slowness, seeded), the last rank times ``slow_rank``."""
    out = draw_slowness(ranks, spread, random.Random(seed))
    out[-1] *= slow_rank
    return out


def one_run(procs: int, batches: int, server: Any, work: Path, base: Path, chaos: bool, deal: str = "even",
            spread: float = 0.0, slow_rank: float = 1.0, prompts: int = 4, global_batch: int = 0,
            refresh: int = 0, staleness: int = STALENESS) -> dict[str, Any]:
    from miles_core.asyncrl.launch import command
    from miles_core.asyncrl.placement import admitting_batch, place
    from miles_core.storage.run import RunStore, prepare_run

    probe = load_recipe("tiny", [*OVERRIDES, f"train.prompts_per_iter={prompts}"])
    c = probe.train.prompts_per_iter * probe.train.group_size
    st = json.loads(os.environ["MILES_STANDIN"])
    # weak scaling, as at 4,096 GPUs (benchmarks/scale/scale_model.py): the global batch that admits the
    # balanced split's samplers, lowered by at most 10% so the ranks' shares are equal
    # (or a fixed global batch of ``global_batch`` sampler batches, as a strong-scaling run)
    balanced = place(procs, st["rollout_s"] / c, st["update_s"] / c, staleness, procs)
    pl = place(procs, st["rollout_s"] / c, st["update_s"] / c, staleness,
               global_batch or admitting_batch(balanced.samplers, staleness), probe.train.prompts_per_iter,
               0.0 if global_batch else 0.1)
    cfg = load_recipe("tiny", [*OVERRIDES, f"train.prompts_per_iter={prompts}", f"async_rl.num_samplers={pl.samplers}",
                               f"async_rl.deal={deal}", f"async_rl.max_staleness={staleness}",
                               f"async_rl.refresh_every={refresh}",
                               f"async_rl.batches_per_sampler={batches}", f"async_rl.global_batch={pl.batches_per_update * c}"])
    st = {**st, "rank_slowness": slowness(pl.learner_ranks, spread, slow_rank, procs)}
    run = f"s3://{server.bucket}/emulate/{procs}-{int(time.time())}"
    prepare_run(run, cfg, base)
    # lazy gloo connections: a group of dozens of ranks restarted on 2 busy cores timed out building
    # its full mesh of connections at once (gloo's connectFullMesh, 3 retries)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "MILES_STANDIN": json.dumps(st),
           "TORCH_GLOO_LAZY_INIT": "1"}
    logs = work / f"logs-{procs}"
    logs.mkdir(parents=True, exist_ok=True)
    t0, cpu0 = time.time(), cpu_times()
    nproc = ["--standalone", "--nnodes", "1", "--nproc-per-node", str(pl.learner_ranks), "--max-restarts", "3"]
    learner = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *nproc, "-m", "benchmarks.standin",
                                "learner", run, "--backend", "gloo", "--cache-dir", str(work / "cache")],
                               env=env, cwd=REPO, stdout=open(logs / "learner.log", "wb"), stderr=subprocess.STDOUT)
    samplers: dict[str, WarmProcess] = {}
    rs, killed = RunStore(run), {"samplers": 0, "learner_ranks": 0}
    chaos_at = pl.samplers * batches // 3
    try:  # whatever fails here, no process of this run outlives it
        samplers = {f"w{i}": WarmProcess(command("sampler", run, f"w{i}", i, work / "cache" / f"w{i}")[3:],
                                         logs / f"w{i}.log", env) for i in range(pl.samplers)}
        restarts = dict.fromkeys(samplers, 0)
        while learner.poll() is None:
            time.sleep(0.5)
            for name, p in list(samplers.items()):
                if p.poll() not in (None, 0):  # killed by chaos: a new process resumes it from the store
                    restarts[name] += 1
                    if restarts[name] > MAX_SAMPLER_RESTARTS:  # not chaos: it fails at start (the log says why)
                        raise RuntimeError(f"sampler {name} exited with {p.poll()} {restarts[name]} times:\n"
                                           + (logs / f"{name}.log").read_text()[-3000:])
                    samplers[name] = WarmProcess(command("sampler", run, name, int(name[1:]), work / "cache" / name)[3:],
                                                 logs / f"{name}.log", env)
            if chaos and not killed["samplers"] and len(rs.trajectories.list_batches()) >= chaos_at:
                for name in random.Random(procs).sample(sorted(samplers), min(3, len(samplers))):
                    os.kill(samplers[name].pid, signal.SIGKILL)
                    killed["samplers"] += 1
                ranks = _children(learner.pid)  # torchrun's agent forks the ranks
                if ranks:
                    os.kill(ranks[-1], signal.SIGKILL)  # one rank: torchrun restarts the group from the checkpoint
                    killed["learner_ranks"] += 1
            if time.time() - t0 > 1800:
                raise TimeoutError(f"emulated run of {procs} processes did not finish in 30 minutes; logs in {logs}")
        if learner.returncode != 0:  # the samplers would wait for versions that never come
            raise RuntimeError(f"learner exited with {learner.returncode}:\n" + (logs / "learner.log").read_text()[-3000:])
    except BaseException:
        _kill_group(learner)
        for p in samplers.values():
            p.kill()
        raise
    cpu1 = cpu_times()
    for p in samplers.values():
        p.wait(60)
    return {**summarize(rs, cfg, pl, st, c, procs, killed, t0), "scale": st["scale"],
            "cpu_busy": (cpu1[0] - cpu0[0]) / max(cpu1[1] - cpu0[1], 1.0), "deal": deal, "rank_spread": spread,
            "slow_rank": slow_rank, "rank_slowness": st["rank_slowness"], "rollout_tail": list(st["rollout_tail"]),
            "global_batch": global_batch, "refresh": refresh}


def wire_costs(samp: list[dict], lead: dict, others: list[dict]) -> dict[str, float]:
    """S3 requests per protocol step as the run's processes counted them on the wire (the status
    files of the samplers, rank 0 and the other ranks: ``request_steps``, storage/requests.py):
    what benchmarks/scale/sim.py charges each step."""

    def per(docs: list[dict], step: str, times_key: str | None = None) -> float:
        n = sum(d.get("request_steps", {}).get(step, {}).get("requests", 0) for d in docs)
        t = sum(d.get(times_key, 0) if times_key else d.get("request_steps", {}).get(step, {}).get("times", 0)
                for d in docs)
        return n / t if t else 0.0

    waited = sum(d.get("request_steps", {}).get("startup_wait", {}).get("requests", 0) for d in samp)
    return {"sampler_start": (sum(d.get("requests_at_start", 0) for d in samp) - waited) / max(len(samp), 1),
            "poll": per(samp, "wait", "admission_polls"), "claim": per(samp, "claim"), "sync": per(samp, "sync"),
            "commit": per(samp, "commit"), "sampler_status": per(samp, "status"),
            "learner_start": float(lead.get("requests_at_start", 0)),
            "rank_start": sum(d.get("requests_at_start", 0) for d in others) / max(len(others), 1),
            "learner_poll": per([lead], "list") + per([lead], "stop_check"), "read": per([lead, *others], "read"),
            "publish": per([lead], "publish"), "checkpoint": per([lead], "checkpoint"),
            "learner_status": per([lead], "status")}


def summarize(rs: Any, cfg: Any, pl: Any, st: dict[str, Any], c: int, procs: int, killed: dict[str, int],
              started: float) -> dict:
    """The run's figures: steady efficiency (after the first two updates, what the model's
    ``after_two_updates`` rate predicts) and over the whole run (from the launch to the last
    update: start-up and fill included), and the inputs the scale model takes."""
    status = rs.read_json("learner", "status.json")
    hist = rs.read_json("learner", "history.json")
    history, ledger = hist["history"], hist["ledger"]
    steady = [h for h in history if h["update"] > 2]
    span = steady[-1]["at"] - history[1]["at"] if len(steady) >= 2 else float("nan")
    done = sum(h["batches"] for h in steady) * c
    ideal = procs * c / (st["rollout_s"] + st["update_s"])
    samp = [rs.read_json("samplers", f"w{i}.json") or {} for i in range(pl.samplers)]
    ranks = [rs.read_json("learner", f"rank{r}.json") or {} for r in range(1, pl.learner_ranks)]
    requests = run_summary(rs.uri)["store_requests"]  # every process's S3 requests, as runs report them
    committed = len(rs.trajectories.list_batches())
    ids = [e["id"] for e in ledger["consumed"]]
    wait = sum(s.get("wait_s", 0.0) for s in samp)
    busy = sum(s.get("busy_s", 0.0) for s in samp)
    sample_s = sum(s.get("sample_s", 0.0) for s in samp) / max(sum(s.get("committed", 0) for s in samp), 1)
    update_s = sum(h["update_s"] for h in history) / max(sum(h["batches"] for h in history), 1) * pl.learner_ranks
    # host seconds beyond the stand-in's compute: per update (read + agree, checkpoint, publish) and
    # per sampler batch (adapter sync + commit), what the scale model is given for this machine
    learner_host = sum(h.get("read_s", 0) + h.get("checkpoint_s", 0) + h.get("publish_s", 0) for h in history)
    sampler_host = sum(s.get("busy_s", 0.0) - s.get("sample_s", 0.0) for s in samp)
    exactly_once = len(ids) == len(set(ids)) == committed - len(ledger["dropped"]) - len(ledger["quarantined"])
    aged = [h["step_age"] for h in history if "step_age" in h]
    return {"processes": procs, "samplers": pl.samplers, "learner_ranks": pl.learner_ranks,
            "batches_per_update": pl.batches_per_update, "batches": committed, "completions_per_batch": c,
            "group_size": cfg.train.group_size, "minibatches": cfg.update.num_minibatches,
            "deal_unit": deal_unit(cfg.train.group_size, cfg.update.estimator),
            "efficiency": done / span / ideal if span > 0 else float("nan"),
            "whole_run_efficiency": sum(h["batches"] for h in history) * c / (history[-1]["at"] - started) / ideal,
            "completions_per_s": done / span if span > 0 else float("nan"), "ideal_completions_per_s": ideal,
            "learner_idle": status["idle_fraction_steady"], "sampler_idle": wait / max(wait + busy, 1e-9),
            "dropped": status["dropped"], "staleness_max": status["max_staleness_seen"],
            "step_age_mean": sum(aged) / max(len(aged), 1), "stale_rows": sum(h.get("stale_rows", 0) for h in history),
            "refreshes": sum(s.get("refreshes", 0) for s in samp),
            "staleness_bound": status["staleness_bound"], "requests_per_batch": requests / max(committed, 1),
            "updates": status["updates"], "exactly_once": exactly_once, "killed": killed,
            "learner_resumes": status["resumes"], "store": "seaweedfs", "wire": wire_costs(samp, status, ranks),
            # the stand-in, planned and as measured (a calibration check), and what the scale model needs
            "rollout_s": st["rollout_s"], "update_s": st["update_s"], "measured_rollout_s": sample_s,
            "measured_update_s": update_s, "learner_host_s": learner_host / max(len(history), 1),
            "sampler_host_s": sampler_host / max(sum(s.get("committed", 0) for s in samp), 1),
            "learner_start_s": sum(s.get("startup_wait_s", 0.0) for s in samp) / max(len(samp), 1),
            # a sampler polls for version 0 (startup) and for admission, nothing else
            "startup_polls": sum(s.get("polls", 0) - s.get("admission_polls", 0) for s in samp) / max(len(samp), 1),
            "adapter_bytes": st["adapter_bytes"],
            "allreduce_bytes": st["allreduce_bytes"], "link_bytes_s": 1e9,
            "poll_s": cfg.async_rl.poll_interval, "poll_backoff": cfg.async_rl.poll_backoff,
            "poll_max_s": cfg.async_rl.poll_max_interval, "max_staleness": cfg.async_rl.max_staleness}


CHECKED = ("efficiency", "whole_run_efficiency", "completions_per_s", "updates", "batches", "requests_per_batch",
           "measured_rollout_s", "measured_update_s", "store_latency_s", "store_bytes_s", "exactly_once")


def _fresh_forkserver() -> None:
    """Stop this process's fork server if one runs. Its preloaded modules are fixed when it starts:
    one started before (another benchmark's warm run, in the same test process) would fork samplers
    without the stand-in, and one started here must not fork later runs' workers with it."""
    from multiprocessing import forkserver

    forkserver._forkserver._stop()  # private, but the only way; a no-op when none runs


def main(argv: list[str] | None = None) -> None:
    ap = bench_args(__doc__, seeds=None, checkpoint=False, workdir=True, sets=False)
    ap.add_argument("--processes", type=int, nargs="+", default=[4, 16, 64])
    ap.add_argument("--batches", type=int, default=4, help="batches per sampler (each a stand-in rollout)")
    ap.add_argument("--chaos", action="store_true", help="SIGKILL 3 samplers and 1 learner rank in the largest run")
    ap.add_argument("--deal", choices=["even", "speed"], default="even", help="async_rl.deal of the runs")
    ap.add_argument("--rank-spread", type=float, default=0.0, help="each learner rank's persistent slowness, a normal CV")
    ap.add_argument("--slow-rank", type=float, default=1.0, help="the last learner rank this many times slower")
    ap.add_argument("--prompts", type=int, default=4,
                    help="prompts per sampler batch (groups of 2): a rank's share is 2 B x prompts / D trajectories "
                         "(whole groups for an estimator that reads them), what a deal by speed moves")
    ap.add_argument("--rollout-tail", default="0:1", metavar="P:X",
                    help="a share P of the rollouts takes X times as long (the scale model assumes 0.02:3)")
    ap.add_argument("--global-batch", type=int, default=0, metavar="B",
                    help="a fixed global batch of B sampler batches (strong scaling) instead of the admitting one")
    ap.add_argument("--refresh", type=int, default=0, metavar="J", help="async_rl.refresh_every (in-flight refresh)")
    ap.add_argument("--staleness", type=int, default=STALENESS, help="async_rl.max_staleness")
    ap.add_argument("--scale", type=float, default=SCALE, help="LLaDA-8B's seconds and bytes times this")
    ap.add_argument("--bytes-scale", type=float, default=None,
                    help="LLaDA-8B's bytes times this instead (default: --scale): 64 processes at --scale 0.5 hold "
                         "an adapter-sized ballast each, more than 24 GiB")
    args = ap.parse_args(argv)
    if args.smoke:
        vars(args).update(SMOKE)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="miles-emulate-"))
    from multiprocessing import forkserver

    from miles_core.models.tiny import init_checkpoint

    base = init_checkpoint(work / "base", seed=0)
    probe = load_recipe("tiny", [*OVERRIDES, f"train.prompts_per_iter={args.prompts}"])
    tail = tuple(float(v) for v in args.rollout_tail.split(":"))
    standin = json.dumps({**stand_in(probe, args.scale, args.bytes_scale), "allreduce_bytes": trained_bytes(probe, base),
                          "rollout_tail": tail})
    server = seaweed().start(work / "s3", bucket="miles")
    # the environment, fork server and launcher context this run sets, restored after (main runs in tests too)
    environ = mock.patch.dict(os.environ, {
        "MILES_S3_ENDPOINT_URL": server.endpoint_url, "AWS_ACCESS_KEY_ID": server.key,
        "AWS_SECRET_ACCESS_KEY": server.secret, "AWS_DEFAULT_REGION": "us-east-1", "MILES_STANDIN": standin,
        "MILES_STANDIN_INSTALL": "1"})  # the forkserver installs it once; forked samplers inherit it
    preload, warm_ctx = list(forkserver._forkserver._preload_modules), WarmProcess._ctx
    runs = []
    try:
        environ.start()
        _fresh_forkserver()
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["miles_core.asyncrl.warm", "benchmarks.standin"])
        WarmProcess._ctx = ctx
        store_cost = measure_store(server, SMOKE_STORE_PROBES if args.smoke else 30)
        for procs in args.processes:
            chaos = args.chaos and procs == max(args.processes)
            print(f"emulating {procs} processes{' with chaos' if chaos else ''} ...", flush=True)
            runs.append({**one_run(procs, args.batches, server, work, base, chaos, args.deal, args.rank_spread,
                                   args.slow_rank, args.prompts, args.global_batch, args.refresh, args.staleness),
                         **store_cost})
            r = runs[-1]
            print(f"  {r['samplers']}:{r['learner_ranks']} B={r['batches_per_update']} eff {r['efficiency']:.3f} "
                  f"req/batch {r['requests_per_batch']:.1f} dropped {r['dropped']} step age {r['step_age_mean']:.2f} "
                  f"swaps {r['refreshes']}", flush=True)
            if not r["measured_rollout_s"] >= 0.9 * r["rollout_s"]:  # a sampler's passes last their waits at least
                raise MeasuredNothing(f"benchmarks.emulate: rollouts took {r['measured_rollout_s']:.3f}s, the stand-in "
                                      f"plans {r['rollout_s']:.3f}s: the samplers ran without it")
    finally:
        _fresh_forkserver()
        forkserver._forkserver._preload_modules, WarmProcess._ctx = preload, warm_ctx
        environ.stop()
        server.stop()
    rows = [[r["processes"], f"{r['samplers']}:{r['learner_ranks']}", r["batches_per_update"], f"{r['efficiency']:.3f}",
             f"{r['learner_idle']:.2f}", f"{r['sampler_idle']:.2f}", r["dropped"], r["staleness_max"],
             f"{r['requests_per_batch']:.1f}", r["exactly_once"], f"{r['measured_rollout_s']:.2f}/{r['rollout_s']:.2f}",
             f"{r['measured_update_s']:.2f}/{r['update_s']:.2f}", f"{r['cpu_busy']:.2f}",
             f"{r['whole_run_efficiency']:.3f}"] for r in runs]
    finish("emulate", {"runs": runs, "scale": args.scale,
                       "bytes_scale": args.scale if args.bytes_scale is None else args.bytes_scale,
                       "cpus": usable_cpus(), "staleness_bound": args.staleness,
                       "smoke": args.smoke}, rows,
           ["procs", "S:D", "B", "eff", "L idle", "S idle", "dropped", "max stale", "req/batch", "once",
            "rollout s meas/plan", "update s meas/plan", "CPU busy", "whole run"], out=args.out,
           positive=[f"runs.*.{k}" for k in CHECKED if k != "exactly_once"], present=["runs.*.exactly_once"])


if __name__ == "__main__":
    main()
