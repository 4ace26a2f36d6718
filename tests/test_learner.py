"""Recipe-level behaviour: SFT checkpoint round trip, RL iterations, bit-exact resume."""

from __future__ import annotations

import torch

from miles_core.config import load_recipe
from miles_core.models.base import load_checkpoint
from miles_core.data.registry import build_task
from miles_core.learner.baseline import train_baseline
from miles_core.learner.policy import Learner


def test_sft_checkpoint_roundtrip_and_bit_exact_resume(tmp_path):
    torch.set_num_threads(1)
    # a decaying LR: resume must also restore where on its schedule the optimizer was
    cfg_overrides = ["train.prompts_per_iter=3", "update.num_minibatches=2", "optim.lr_schedule=linear",
                     "optim.warmup=2", "train.iterations=4"]
    cfg = load_recipe("tiny", cfg_overrides)
    data = build_task(cfg)
    model, tok = train_baseline(cfg, data, tmp_path / "sft")
    loaded, tok2 = load_checkpoint(tmp_path / "sft")
    x = torch.randint(4, 20, (2, 9))
    assert torch.equal(model.eval()(x), loaded.eval()(x)) and tok2.itos == tok.itos

    def run(learner: Learner, n: int) -> list[dict]:
        out = []
        for _ in range(n):
            b = learner.sample(data, learner.version)  # batch seq = updates so far, as in a run
            b.reward = torch.arange(len(b), dtype=torch.float32) % 2  # guarantee signal on a toy model
            from miles_core.algo.rl import assign_advantages
            assign_advantages(b)
            out.append(learner.update(b))
        return out

    straight = Learner(cfg, tmp_path / "sft")
    run(straight, 3)
    first = Learner(cfg, tmp_path / "sft")
    run(first, 1)
    torch.save(first.state(), tmp_path / "learner.pt")
    resumed = Learner(cfg, tmp_path / "sft")
    with torch.no_grad():  # another adapter and row-draw stream: all must come from the checkpoint
        for p in resumed.params:
            p.normal_(0, 0.5)
    resumed.gen.manual_seed(999)
    resumed.load_state(torch.load(tmp_path / "learner.pt", weights_only=False))
    run(resumed, 2)
    a, b = straight.model.state_dict(), resumed.model.state_dict()
    lora = [k for k in a if "lora_" in k]
    assert lora and all(torch.equal(a[k], b[k]) for k in lora)
    assert resumed.version == straight.version == 3
    # the schedule spans train.iterations x num_minibatches = 8 optimizer steps: after 2 warm-up steps
    # the factor falls 1/7 per step (0 just after step 8), so after 3 updates (6 steps) the LR is 2/7
    for learner in (straight, resumed):
        assert abs(learner.opt.param_groups[0]["lr"] - cfg.optim.lr * 2 / 7) < 1e-12
    # the base never moved
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_sft_stops_when_the_validation_callback_reports_a_plateau(tmp_path):
    # the learning benchmark's "SFT to plateau": on_eval returning True ends SFT at that step
    cfg = load_recipe("tiny", ["sft.steps=200", "sft.eval_every=10", "eval.num_problems=4", "task.num_val=8"])
    seen: list[int] = []

    def on_eval(step: int, pass1: float, stats: dict) -> bool:
        seen.append(step)
        assert 0.0 <= pass1 <= 1.0 and "loss" in stats
        return step >= 20

    train_baseline(cfg, build_task(cfg), tmp_path / "sft", on_eval=on_eval)
    assert seen == [10, 20]
    assert (tmp_path / "sft" / "config.json").exists()


def test_sft_saves_the_weights_of_its_best_validation_score(tmp_path, monkeypatch):
    # early stopping restores the best checkpoint. Validation scores are scripted (0.1, 0.5, 0.2)
    # and the weights seen at each evaluation recorded: the saved model must be the second's.
    import types

    import miles_core.learner.baseline as session

    cfg = load_recipe("tiny", ["sft.steps=30", "sft.eval_every=10"])
    scores, snapshots = iter([0.1, 0.5, 0.2]), []

    def scripted_eval(model, *args, **kwargs):
        snapshots.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        return types.SimpleNamespace(pass_at={"pass@1": next(scores)})

    monkeypatch.setattr(session, "run_eval", scripted_eval)
    train_baseline(cfg, build_task(cfg), tmp_path / "sft", on_eval=lambda step, pass1, stats: False)
    saved = load_checkpoint(tmp_path / "sft")[0].state_dict()
    assert len(snapshots) == 3
    assert all(torch.equal(saved[k], snapshots[1][k]) for k in snapshots[1])
    assert not all(torch.equal(saved[k], snapshots[2][k]) for k in snapshots[2])  # not the last weights


def test_sft_patience_stops_after_evaluations_without_a_strict_gain(tmp_path, monkeypatch):
    # scores 0.1, 0.5, 0.5, 0.4 with patience 2: the last strict gain is at step 20, so the tie at 30
    # does not reset it and SFT stops at step 40; the saved weights are the tie's (step 30)
    import types

    import miles_core.learner.baseline as session

    cfg = load_recipe("tiny", ["sft.steps=100", "sft.eval_every=10"])
    scores, snapshots, seen = iter([0.1, 0.5, 0.5, 0.4, 0.9, 0.9]), [], []

    def scripted_eval(model, *args, **kwargs):
        snapshots.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        return types.SimpleNamespace(pass_at={"pass@1": next(scores)})

    monkeypatch.setattr(session, "run_eval", scripted_eval)
    train_baseline(cfg, build_task(cfg), tmp_path / "sft", patience=2,
                   on_eval=lambda step, pass1, stats: seen.append(step))
    assert seen == [10, 20, 30, 40]
    saved = load_checkpoint(tmp_path / "sft")[0].state_dict()
    assert all(torch.equal(saved[k], snapshots[2][k]) for k in snapshots[2])


def test_building_a_policy_seeds_lora_from_the_recipe_and_leaves_the_process_generator_alone(tmp_path):
    """LoRA's init draws from torch's global generator (peft takes none): build_policy seeds it from
    ``train.seed`` in a fork, so the adapter is the recipe's whatever the process's state, and the
    process's generator is where the caller left it."""
    from miles_core.learner.policy import build_policy

    torch.set_num_threads(1)
    cfg = load_recipe("tiny", ["sft.steps=1"])
    train_baseline(cfg, build_task(cfg), tmp_path / "sft")

    def lora(model) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in model.state_dict().items() if "lora_A" in k}

    torch.manual_seed(7)
    before = torch.get_rng_state()
    first = lora(build_policy(cfg, tmp_path / "sft")[0])
    assert torch.equal(torch.get_rng_state(), before)
    torch.manual_seed(99)
    again = lora(build_policy(cfg, tmp_path / "sft")[0])
    other = lora(build_policy(load_recipe("tiny", ["sft.steps=1", "train.seed=1"]), tmp_path / "sft")[0])
    assert first and all(torch.equal(first[k], again[k]) for k in first)
    assert any(not torch.equal(first[k], other[k]) for k in first)
