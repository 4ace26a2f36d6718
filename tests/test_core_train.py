"""Learning components: SFT objective, LoRA-only updates, per-step autograd, meanfield, config."""

from __future__ import annotations

import pytest
import torch

from miles_core.algo.advantages import group_advantages
from miles_core.algo.sft import make_batch, sft_loss, train_sft
from miles_core.algo.update import update_policy
from miles_core.config import ConfigError, SamplerConfig, UpdateConfig, load_recipe
from miles_core.models.lora import add_lora, add_lora_from, load_adapter, reference_policy, save_adapter
from miles_core.models.tiny import TinyConfig, TinyDenoiser
from miles_core.samplers.sampler import sample
from miles_core.tokenizer import CharTokenizer

TOK = CharTokenizer()


def base_model(seed: int = 0) -> TinyDenoiser:
    torch.manual_seed(seed)
    return TinyDenoiser(TinyConfig(TOK.vocab_size, d_model=32, n_layers=2, n_heads=2, d_ff=64, max_len=48))


def scored_batch(model, n_prompts: int = 3, g: int = 4, steps: int = 4, length: int = 8):
    prompts = [TOK.encode(p) for p in ["1+2", "3*4", "5-6", "7+8*9"][:n_prompts] for _ in range(g)]
    gid = torch.arange(n_prompts).repeat_interleave(g)
    batch = sample(model, TOK, prompts, SamplerConfig(steps=steps), length, torch.Generator().manual_seed(0), gid)
    batch.reward = torch.arange(len(batch), dtype=torch.float32) % 3  # varied rewards within groups
    batch.advantage = group_advantages(batch.reward, batch.group_id)
    return batch


def test_sft_loss_only_masks_and_scores_answer_positions():
    model = base_model()
    batch = make_batch(TOK, ["12+3", "4*5"], ["12+3=15", "4*5=20"], 10)
    seen = []
    orig = model.forward
    model.forward = lambda x, a=None: (seen.append(x.clone()), orig(x, a))[1]
    loss, stats = sft_loss(model, batch, TOK.mask_id, torch.Generator().manual_seed(0))
    x = seen[0]
    assert torch.equal(x[:, :batch.width], batch.x[:, :batch.width])  # prompt never masked
    assert (x[:, batch.width:] == TOK.mask_id).any()
    # gradient of the loss w.r.t. logits is zero at every prompt position and unmasked answer position
    logits = orig(x, batch.attn).detach().requires_grad_(True)
    comp = batch.x[:, batch.width:]
    masked = x[:, batch.width:] == TOK.mask_id
    ce = torch.nn.functional.cross_entropy(logits[:, batch.width:].reshape(-1, TOK.vocab_size), comp.reshape(-1),
                                           reduction="none").view(comp.shape)
    (ce * masked).sum().backward()
    assert logits.grad[:, :batch.width].abs().sum() == 0
    assert logits.grad[:, batch.width:][~masked].abs().sum() == 0
    assert torch.isfinite(loss) and stats["masked_frac"] > 0


def test_sft_loss_weight_is_one_over_t():
    """With every answer token masked (t -> 1 region), loss equals mean CE / t; check on a fixed t."""
    model = base_model()
    batch = make_batch(TOK, ["1+1"], ["1+1=2"], 6)
    gen = torch.Generator().manual_seed(0)
    t = torch.rand(1, 1, generator=gen) * (1 - 1e-3) + 1e-3
    masked = torch.rand(1, 6, generator=gen) < t
    loss, _ = sft_loss(model, batch, TOK.mask_id, torch.Generator().manual_seed(0))
    x = batch.x.clone()
    x[:, batch.width:] = batch.x[:, batch.width:].masked_fill(masked, TOK.mask_id)
    logits = model(x, batch.attn)[:, batch.width:]
    ce = torch.nn.functional.cross_entropy(logits[0], batch.x[0, batch.width:], reduction="none")
    assert loss.item() == pytest.approx(float((ce * masked[0]).sum() / t / 6), rel=1e-5)


def test_sft_lr_schedule_warms_up_then_decays_to_zero_at_sft_steps():
    """Each step's stats carry the LR it used: warm-up 2 steps, then the cosine of algo/schedule.py
    over the remaining 8 of 10 steps; constant stays at lr; an unknown schedule is an error naming it."""
    import math

    data = (["1+1", "2+2"], ["1+1=2", "2+2=4"])
    kw = dict(completion_len=6, steps=10, batch_size=2, lr=0.01, warmup=2)
    cos = [h["lr"] for h in train_sft(base_model(), TOK, *data, lr_schedule="cosine", **kw)]
    frac = [(s - 1) / 9 for s in range(2, 10)]
    assert cos == pytest.approx([0.005, 0.01] + [0.005 * (1 + math.cos(math.pi * f)) for f in frac])
    assert cos[-1] == pytest.approx(0.01 * 0.5 * (1 + math.cos(math.pi * 8 / 9))) and cos[-1] < 0.0004
    const = [h["lr"] for h in train_sft(base_model(), TOK, *data, **kw)]
    assert const == pytest.approx([0.005] + [0.01] * 9)
    with pytest.raises(ValueError, match="lr_schedule"):
        train_sft(base_model(), TOK, *data, lr_schedule="step", **kw)


@pytest.mark.parametrize("estimator", ["adpo", "meanfield", "coupled", "wd1"])
def test_update_changes_only_lora_parameters(estimator):
    model = add_lora(base_model(), r=4, alpha=8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():  # make B non-zero so A also receives gradient
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batch = scored_batch(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    stats = update_policy(model, opt, batch, UpdateConfig(estimator=estimator, row_chunk=5), TOK, 1.0,
                        torch.Generator().manual_seed(0))
    after = model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all("lora_" in k for k in changed)
    assert stats["rows"] > 0 and "clip_frac" in stats and "iw_max" in stats


def test_batch_loss_norm_scales_the_gradient_by_the_informative_share():
    """Group 0 has one reward for all its samples (A = 0, skipped). loss_norm="batch" divides by
    the whole batch's tokens, "informative" by the kept rows' only, so with plain SGD (lr 1, no
    clipping) the two weight changes differ by exactly kept / total = 8 / 12."""
    deltas = {}
    for norm in ("informative", "batch"):
        model = add_lora(base_model(), r=4, alpha=8)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.1, generator=torch.Generator().manual_seed(1))
        batch = scored_batch(model)
        batch.reward = (torch.arange(len(batch)) % 2).float()  # groups 1, 2: A = +-0.5, none zero
        batch.reward[:4] = 1.0
        batch.advantage = group_advantages(batch.reward, batch.group_id)
        params = [p for p in model.parameters() if p.requires_grad]
        before = [p.detach().clone() for p in params]
        cfg = UpdateConfig(loss_norm=norm, max_grad_norm=1e9, row_chunk=5)
        stats = update_policy(model, torch.optim.SGD(params, lr=1.0), batch, cfg, TOK, 1.0, torch.Generator().manual_seed(0))
        assert stats["skipped_trajectories"] == 4
        deltas[norm] = torch.cat([(p.detach() - b).flatten() for p, b in zip(params, before)])
    assert deltas["informative"].abs().sum() > 0
    torch.testing.assert_close(deltas["batch"], deltas["informative"] * 8 / 12, rtol=1e-4, atol=1e-7)


def test_update_graph_covers_one_step_per_row():
    """Chunked per-row backward == full-batch gradient, and every backward sees one forward."""
    model = add_lora(base_model(), r=4, alpha=8)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    params = [p for p in model.parameters() if p.requires_grad]
    batch = scored_batch(model)
    grads = {}
    for chunk in (1, 10_000):
        forwards, backwards = [], []
        head = model.base_model.model.lm_head  # every pass ends here (the engine calls window(), not forward())
        h1 = head.register_forward_hook(lambda m, i, o: forwards.append(i[0].shape[0]))
        h2 = head.register_full_backward_hook(lambda m, gi, go: backwards.append(len(forwards)))
        opt = torch.optim.SGD(params, lr=0.0)  # lr 0: keep weights, read accumulated grads
        update_policy(model, opt, batch, UpdateConfig(row_chunk=chunk, max_grad_norm=1e9), TOK, 1.0,
                    torch.Generator().manual_seed(0))
        h1.remove(), h2.remove()
        grads[chunk] = torch.cat([p.grad.flatten() for p in params]).clone()
        if chunk == 1:
            # each forward covers exactly one (trajectory, step) row and is followed by its own backward
            assert set(forwards) == {1} and backwards == list(range(1, len(forwards) + 1))
    assert torch.allclose(grads[1], grads[10_000], atol=1e-6, rtol=1e-4)


def test_reference_policy_is_adapter_disabled():
    base = base_model()
    x = torch.randint(4, 20, (2, 6))
    ref_out = base(x)
    model = add_lora(base, r=4, alpha=8)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    assert not torch.allclose(model(x), ref_out)
    with reference_policy(model) as ref:
        assert torch.allclose(ref(x), ref_out)


def test_adapter_roundtrip_peft_format(tmp_path):
    model = add_lora(base_model(), r=4, alpha=8)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    model.save_pretrained(str(tmp_path / "ad"))
    assert (tmp_path / "ad" / "adapter_model.safetensors").exists()
    x = torch.randint(4, 20, (2, 6))
    loaded = load_adapter(base_model(), tmp_path / "ad")
    assert torch.allclose(loaded(x), model(x), atol=1e-6)


def test_fast_save_adapter_writes_what_save_pretrained_writes(tmp_path):
    # the async learner's publish path skips peft's model card; tensors and config must be the same
    from safetensors.torch import load_file

    model = add_lora(base_model(), r=4, alpha=8)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.normal_(0, 0.3)
    save_adapter(model, tmp_path / "fast")
    model.save_pretrained(str(tmp_path / "ref"))
    a, b = load_file(tmp_path / "fast" / "adapter_model.safetensors"), load_file(tmp_path / "ref" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    x = torch.randint(4, 20, (2, 6))
    assert torch.allclose(load_adapter(base_model(), tmp_path / "fast")(x), model(x), atol=1e-6)


def test_bound_adapter_tensors_follow_in_place_steps_and_replaced_parameters():
    # publish reads the adapter through a binding resolved once; it must always equal peft's answer
    from peft import get_peft_model_state_dict

    from miles_core.models.lora import adapter_tensors

    model = add_lora(base_model(), r=4, alpha=8)

    def same() -> bool:
        a, b = adapter_tensors(model), get_peft_model_state_dict(model)
        return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)

    assert same()
    with torch.no_grad():  # an optimizer step: in place
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.add_(0.25)
    assert same()
    name, old = next((n, p) for n, p in model.named_parameters() if "lora_A" in n)
    module = model.get_submodule(name.rsplit(".", 1)[0])
    setattr(module, name.rsplit(".", 1)[1], torch.nn.Parameter(old.detach() * 0 + 3.0))  # replaced, not stepped
    assert same() and any(torch.all(t == 3.0) for t in adapter_tensors(model).values())


def test_lora_targets_from_the_recipe_adapt_only_those_modules():
    cfg = load_recipe("tiny", ["lora.r=2", "lora.alpha=4", "lora.targets=q_proj, v_proj"])
    model = add_lora_from(base_model(), cfg.lora)
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n, p in model.named_parameters() if p.requires_grad}
    assert adapted == {"q_proj", "v_proj"} and model.peft_config["default"].target_modules == {"q_proj", "v_proj"}
    n_lora = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert n_lora == 2 * 2 * 2 * (32 + 32)  # layers x {q,v} x r x (d_in + d_out)
    with pytest.raises(ValueError, match="lora.targets.*qq_proj"):
        add_lora_from(base_model(), load_recipe("tiny", ["lora.targets=qq_proj"]).lora)


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="adpo.nope"):
        load_recipe("tiny", ["adpo.nope=1"])
    with pytest.raises(ConfigError, match=r"optim.lr: expected a number"):
        load_recipe("tiny", ["optim.lr=abc"])
    with pytest.raises(ConfigError, match=r"sampler.remasking.*allowed values: 'low_confidence', 'random'"):
        load_recipe("tiny", ["sampler.remasking=best"])
    with pytest.raises(ConfigError, match=r"estimators.adpo.step_fraction: 0.0 is out of bounds \[1e-09, 1.0\]"):
        load_recipe("tiny", ["estimators.adpo.step_fraction=0"])
    with pytest.raises(ConfigError, match="built-ins"):
        load_recipe("no-such-recipe")
    cfg = load_recipe("tiny", ["optim.lr=0.5", "sampler.kind=nsd"])
    assert cfg.optim.lr == 0.5 and cfg.sampler.kind == "nsd"


def test_a_rows_logits_and_greedy_completion_do_not_depend_on_its_batch():
    """Positions count real tokens only: left padding (set by the longest prompt in the batch) must
    not move a short prompt's completion to other positions, with or without the prefix cache."""
    model = base_model(1).eval()
    ids = torch.tensor([TOK.encode("1+2") + [TOK.mask_id] * 4])
    padded = torch.cat([torch.full((1, 5), TOK.pad_id), ids], 1)
    attn = torch.cat([torch.zeros(1, 5, dtype=torch.bool), torch.ones_like(ids, dtype=torch.bool)], 1)
    with torch.no_grad():
        alone = model(ids)[0]
        assert torch.allclose(alone, model(padded, attn)[0, 5:], atol=1e-5)
        _, cache = model.window(padded, attn, (0, 12), (0, 12), keep=((0, 8),))   # pads + prompt cached
        tail, _ = model.window(padded, attn, (8, 12), (8, 12), cache=cache)
        assert torch.allclose(alone[3:], tail[0], atol=1e-5)
    greedy = SamplerConfig(steps=4, temperature=0.0)
    one = sample(model, TOK, [TOK.encode("1+2")], greedy, 6, torch.Generator().manual_seed(0))
    two = sample(model, TOK, [TOK.encode("1+2"), TOK.encode("123+456*7")], greedy, 6, torch.Generator().manual_seed(0))
    assert torch.equal(one.completion_ids[0], two.completion_ids[0])


def _bounded_fields():
    import dataclasses as dc
    import typing

    from miles_core.config import RecipeConfig

    def walk(cls, prefix):
        hints = typing.get_type_hints(cls)
        for f in dc.fields(cls):
            if dc.is_dataclass(hints[f.name]):
                yield from walk(hints[f.name], f"{prefix}{f.name}.")
            elif hints[f.name] in (int, float) or hints[f.name] in (int | None, float | None):
                yield f"{prefix}{f.name}", hints[f.name], f.metadata.get("bounds")
    return list(walk(RecipeConfig, ""))


@pytest.mark.parametrize("key,tp,bounds", _bounded_fields(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_numeric_setting_is_bounded_and_refused_outside(key: str, tp: type, bounds) -> None:
    """Generated from the config dataclasses: every int/float field declares bounds, and a value
    just outside them fails at load with the field, the value and the bounds in the message."""
    from miles_core.config import ConfigError, load_recipe

    assert bounds is not None and bounds != (None, None), f"{key} declares no bounds"
    lo, hi = bounds
    step = 1 if tp in (int, int | None) else 1e-3 * max(1.0, abs(lo if lo is not None else hi))
    for bad in ([lo - step] if lo is not None else []) + ([hi + step] if hi is not None else []):
        with pytest.raises(ConfigError, match=rf"{key}: {bad!r} is out of bounds \["):
            load_recipe("tiny", [f"{key}={bad}"])


def test_the_character_tokenizer_saves_what_transformers_reads_and_reads_its_older_file(tmp_path) -> None:
    """A saved character tokenizer is a ``tokenizers`` WordLevel file transformers opens with the
    same ids, left padding and decoding (checked here on the file itself; the folder in a fresh
    process: tests/test_adapters_outside.py); the older ``{"type": "char"}`` file still loads, and a
    subword tokenizer is not taken for a character one."""
    import json

    from tokenizers import Tokenizer

    from miles_core.tokenizer import SPECIALS, CharTokenizer

    tok = CharTokenizer()
    tok.save(tmp_path / "new")
    text = "12+3=\n'x'\\é"  # a newline, quotes, a backslash and a character outside the vocabulary
    hf = Tokenizer.from_file(str(tmp_path / "new" / "tokenizer.json"))
    assert hf.encode(text).ids == tok.encode(text) and tok.unk_id in tok.encode(text)
    assert hf.decode(tok.encode("7*(2-5)")) == "7*(2-5)"
    assert [hf.token_to_id(s) for s in SPECIALS] == [tok.pad_id, tok.mask_id, tok.eos_id, tok.unk_id]
    assert json.loads((tmp_path / "new" / "tokenizer_config.json").read_text())["padding_side"] == "left"
    assert CharTokenizer.load(tmp_path / "new").chars == tok.chars and CharTokenizer.saved_in(tmp_path / "new")
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "tokenizer.json").write_text(json.dumps({"type": "char", "chars": "ab+"}))
    assert CharTokenizer.load(tmp_path / "old").encode("a+b") == [4, 6, 5]
    bpe = json.loads((tmp_path / "new" / "tokenizer.json").read_text())
    bpe["model"]["vocab"]["ab"] = len(bpe["model"]["vocab"])  # a merged token: not one character each
    (tmp_path / "bpe").mkdir()
    (tmp_path / "bpe" / "tokenizer.json").write_text(json.dumps(bpe))
    assert not CharTokenizer.saved_in(tmp_path / "bpe")
    with pytest.raises(ValueError, match="bpe/tokenizer.json: not a Miles character tokenizer"):
        CharTokenizer.load(tmp_path / "bpe")
