"""A Miles policy through lm-evaluation-harness: the ELBO estimator by hand and by enumeration,
and lm-eval end to end in a fresh process (no Miles import in the test's own checks of lm-eval's
output) on a checkpoint whose every log-prob is known in closed form."""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")

from miles_core.eval.lm_harness import cut_at_stops, elbo_loglikelihood, masked_counts, request_seed  # noqa: E402
from miles_core.eval.lm_tasks import write_task_folder  # noqa: E402
from miles_core.models.base import save_checkpoint  # noqa: E402
from miles_core.models.tiny import TinyConfig, TinyDenoiser  # noqa: E402
from miles_core.tokenizer import CharTokenizer  # noqa: E402

TOK = CharTokenizer()
ROOT = Path(__file__).resolve().parents[1]


def random_model(seed: int = 0) -> TinyDenoiser:
    torch.manual_seed(seed)
    m = TinyDenoiser(TinyConfig(TOK.vocab_size, d_model=32, n_layers=2, n_heads=2, d_ff=64, max_len=48))
    for p in m.parameters():
        p.data.mul_(4)
    return m.eval()


def exact_logp(model, context: list[int], seq: list[int], masked: set[int]) -> list[float]:
    """log p of each masked target position, by a plain forward and log_softmax (forbidden ids out)."""
    ids = context + [TOK.mask_id if i in masked else t for i, t in enumerate(seq)]
    with torch.no_grad():
        logits = model(torch.tensor([ids]))[0, len(context):].double()
    logits[:, TOK.forbidden_ids] = float("-inf")
    lp = logits.log_softmax(-1)
    return [float(lp[i, seq[i]]) for i in range(len(seq))]


def test_masked_counts_are_stratified_over_one_to_l() -> None:
    for seed in range(5):  # L draws of L tokens: every count once, from wherever the start falls
        assert sorted(masked_counts(6, 6, torch.Generator().manual_seed(seed)).tolist()) == [1, 2, 3, 4, 5, 6]
        c = masked_counts(4, 9, torch.Generator().manual_seed(seed)).tolist()
        assert min(c) >= 1 and max(c) <= 4 and len(set(c)) == 4
    assert masked_counts(1, 5, torch.Generator().manual_seed(3)).tolist() == [1] * 5


def test_a_one_token_continuation_is_exact() -> None:
    m, ctx, tgt = random_model(), TOK.encode("3+4"), TOK.encode("7")
    ll, se = elbo_loglikelihood(m, TOK, ctx, tgt, 6, torch.Generator().manual_seed(1))
    assert ll == pytest.approx(exact_logp(m, ctx, tgt, {0})[0], abs=1e-5) and se == pytest.approx(0.0, abs=1e-6)


def test_the_estimate_converges_to_the_elbo_by_enumeration() -> None:
    """E over l ~ U{1..L} and l masked positions of (L / l) sum log p: enumerated for L = 3."""
    m, ctx, tgt = random_model(1), TOK.encode("12"), TOK.encode("4*5")
    n = len(tgt)
    want = 0.0
    for l in range(1, n + 1):
        subsets = list(itertools.combinations(range(n), l))
        for s in subsets:
            lp = exact_logp(m, ctx, tgt, set(s))
            want += (1 / n) * (1 / len(subsets)) * (n / l) * sum(lp[i] for i in s)
    ll, se = elbo_loglikelihood(m, TOK, ctx, tgt, 3000, torch.Generator().manual_seed(2), batch=500)
    assert abs(ll - want) < 4 * se + 1e-6 and se < 0.2 * abs(want)


def test_a_misspelt_model_argument_is_refused_by_name(tmp_path: Path) -> None:
    from miles_core.eval.lm_harness import MilesLM

    save_checkpoint(random_model(), TOK, tmp_path / "ck")
    with pytest.raises(TypeError, match="mc_nm"):
        MilesLM.create_from_arg_string(f"pretrained={tmp_path / 'ck'},recipe=arith,mc_nm=8", {"batch_size": 4})
    lm = MilesLM.create_from_arg_string(f"pretrained={tmp_path / 'ck'},recipe=arith,mc_num=8",
                                        {"batch_size": 4, "device": "cpu"})
    assert lm.settings()["mc_num"] == 8 and lm.settings()["batch_size"] == 4


def test_request_seeds_and_stop_strings() -> None:
    assert request_seed(1, "a", "b") == request_seed(1, "a", "b") != request_seed(1, "ab", "")
    assert cut_at_stops("12;34\n56", [";", "\n"]) == "12" and cut_at_stops("1234", []) == "1234"


def closed_form_checkpoint(path: Path) -> dict[str, float]:
    """A checkpoint whose logits ignore the input (LM head weight 0, bias b): greedy writes '7' at
    every position, and log p(c) = log_softmax(b)[c] over the allowed ids, whatever is masked."""
    m = random_model()
    b = torch.zeros(TOK.vocab_size)
    b[TOK.encode("7")[0]], b[TOK.encode("8")[0]], b[TOK.eos_id] = 6.0, 2.0, 1.0
    with torch.no_grad():
        m.lm_head.weight.zero_()
        m.lm_head.bias.copy_(b)
    save_checkpoint(m, TOK, path)
    allowed = [i for i in range(TOK.vocab_size) if i not in TOK.forbidden_ids]
    lse = math.log(sum(math.exp(float(b[i])) for i in allowed))
    return {c: float(b[TOK.encode(c)[0]]) - lse for c in "78"}


@pytest.mark.e2e
def test_lm_eval_end_to_end_in_a_fresh_process(tmp_path: Path) -> None:
    logp = closed_form_checkpoint(tmp_path / "ck")
    L = 16  # the arith recipe's completion window
    gen = tmp_path / "gen.jsonl"
    rows = [{"prompt": "3+4", "answer": "7" * L}, {"prompt": "9-1", "answer": "8"}, {"prompt": "2*2", "answer": "7" * L}]
    gen.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ll = tmp_path / "ll.jsonl"
    ll.write_text("".join(json.dumps({"prompt": p, "answer": t, "target": t}) + "\n"
                          for p, t in (("3+4", "7" * L), ("5-2", "8" * L))))
    names = write_task_folder(tmp_path / "lltask", {"problems": ll}, kind="loglikelihood", prefix="lik")
    out = tmp_path / "res.json"
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "miles.cli", "lm-eval", "--model", str(tmp_path / "ck"), "--recipe", "arith",
           "--data", f"problems={gen}", "--reward", "math_exact", "--include-path", str(tmp_path / "lltask"),
           "--tasks", names[0], "--mc-num", "8", "--output", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["results"]["miles_problems"]["exact_match,none"] == pytest.approx(2 / 3)   # greedy: sixteen 7s
    lik = res["results"]["lik_problems"]
    assert lik["acc,none"] == pytest.approx(0.5)                      # is_greedy: the 7s yes, the 8s no
    # lm-eval's perplexity aggregate is exp(-mean log-likelihood) over the rows
    assert lik["perplexity,none"] == pytest.approx(math.exp(-(L * logp["7"] + L * logp["8"]) / 2), rel=1e-4)
    s = res["miles"]
    assert s["batch_size"] == 8 and s["mc_num"] == 8 and s["dtype"] == "float32" and s["device"] == "cpu"
    assert s["sampler"]["temperature"] == 0.0 and s["completion_len"] == L


def test_greedy_generation_does_not_depend_on_the_batch(tmp_path: Path) -> None:
    """A prompt alone and inside a batch of 8 (left padding, prompts of 1 to 12 characters) gives
    the same output, through lm-eval's generate_until. Weights scaled x15: logit gaps are large,
    so float summation order over different batch shapes cannot flip a decision."""
    from lm_eval.api.instance import Instance

    from miles_core.eval.lm_harness import MilesLM

    m = random_model(4)
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(15 / 4)
    save_checkpoint(m, TOK, tmp_path / "ck")
    prompts = ["3", "12+4", "7*8-1", "9-9", "44*2+10", "5*5", "1+2+3+4+5+6", "8"]
    reqs = [Instance("generate_until", {}, (p, {"until": []}), i) for i, p in enumerate(prompts)]
    together = MilesLM(str(tmp_path / "ck"), "arith", batch_size=8).generate_until(reqs)
    alone = MilesLM(str(tmp_path / "ck"), "arith", batch_size=1).generate_until(reqs)
    assert together == alone and len(set(together)) > 1      # the outputs differ between prompts
