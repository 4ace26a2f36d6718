"""SDAR with fewer denoising steps than its block: a block the prompt ends inside keeps
the full block's per-step counts (``get_num_transfer_tokens(block_length, steps)``) until its
masks run out, as JetAstra/SDAR's ``block_diffusion_generate`` does, instead of spreading the
steps over the masks left.

Greedy parity is checked on a stand-in block-causal model whose logits are a hash of everything
each position may attend to, with wide margins: random weights would leave near-ties between
positions' confidences that float order could flip between Miles' block window and the
reference's full forward; here every decision is far from a tie, so a difference can only come
from the schedule (or a real bug)."""

from __future__ import annotations


import pytest
import torch
from torch import Tensor, nn

from miles_core.config import SamplerConfig
from miles_core.models.window import (Capabilities, KVCache, Out, Span, WindowDenoiser, attention_grid,
                                      select_out)
from miles_core.samplers.sampler import sample, static_counts, transfer_counts
from miles_core.tokenizer import CharTokenizer
from tools.llada_reference import reference_generate

TOK = CharTokenizer()
BLOCK = 4


class HashedBlockCausal(WindowDenoiser):
    """A block-causal denoiser (attention blocks of ``block_size`` at absolute real positions, as
    SDAR's) with no weights: position i's logits are one token at 4 + 0.5 * level + 0.05 * (i mod
    block), every other token 0, where token and level come from a hash of the (position, id)
    pairs i may attend to (real ones, in its block or an earlier one). Revealing any token of a
    block changes the predictions in it and after it, so a different schedule decodes differently,
    and no two positions of a block have confidences within float noise of each other."""

    def __init__(self, vocab_size: int, allowed: list[int], block_size: int = BLOCK, seed: int = 0) -> None:
        super().__init__()
        self.block_size, self.vocab_size = block_size, vocab_size
        g = torch.Generator().manual_seed(seed)
        self.register_buffer("allowed", torch.tensor(allowed, dtype=torch.long))
        self.register_buffer("coef", torch.randint(1, 10_007, (256,), generator=g))

    def capabilities(self) -> Capabilities:
        return Capabilities(block_size=self.block_size)  # what attention_grid reads

    def window(self, ids: Tensor, mask: Tensor, query: Span, out: Out, cache: KVCache | None = None,
               keep: tuple[Span, ...] = ()) -> tuple[Tensor, KVCache | None]:
        assert cache is None and not keep
        return select_out(self(ids, mask), out), None

    def forward(self, ids: Tensor, mask: Tensor) -> Tensor:
        """ids, mask [B, T] (mask: real tokens; left padding is not) -> logits [B, T, V]."""
        pos = mask.long().cumsum(1) - 1                                          # real position; pads -1
        blk = pos // self.block_size
        see = mask[:, None, :] & (blk[:, None, :] <= blk[:, :, None])          # [B, Tq, Tk] block-causal
        term = (ids + 1) * self.coef[pos.clamp(min=0)]                          # [B, Tk]
        h = ((see.long() * term[:, None, :]).sum(-1) + 7919 * pos.clamp(min=0)) % 1_000_003   # [B, Tq]
        n = self.allowed.numel()
        token = self.allowed[h % n]
        height = 4.0 + 0.5 * ((h // n) % 16).float() + 0.05 * (pos.clamp(min=0) % self.block_size).float()
        logits = torch.zeros(*ids.shape, self.vocab_size)
        return logits.scatter_(-1, token[..., None], height[..., None])


def hashed_model() -> HashedBlockCausal:
    bad = set(TOK.forbidden_ids) | {TOK.eos_id}
    return HashedBlockCausal(TOK.vocab_size, [i for i in range(TOK.vocab_size) if i not in bad]).eval()


@pytest.mark.parametrize("steps", [1, 2, 3, 4])
def test_transfer_counts_keep_the_full_blocks_schedule_until_the_masks_run_out(steps: int) -> None:
    full = static_counts(BLOCK, steps)                       # get_num_transfer_tokens(4, steps)
    for masked in range(BLOCK + 1):
        got = transfer_counts(masked, BLOCK, steps)
        assert sum(got) == masked and len(got) == steps, (masked, got)
        done = 0
        for n, want in zip(got, full):                       # the official count, or the masks left
            assert n == min(want, masked - done), (masked, got)
            done += n
    assert transfer_counts(BLOCK, BLOCK, steps) == full
    if steps == 2:  # the case: 2 masks in 2 steps commit both at once, not one a step
        assert transfer_counts(2, BLOCK, 2) == [2, 0] and transfer_counts(3, BLOCK, 2) == [2, 1]


@pytest.mark.parametrize("per_block", [1, 2, 3, 4])
def test_greedy_output_equals_sdars_decoder_with_prompts_ending_mid_block(per_block: int) -> None:
    """Prompts ending at every offset into a 4-token block, decoded in one batch (left-padded), at
    ``per_block`` steps per block: each row's completion and NFE equal the reference decoder's
    (SDAR's rule, tools/llada_reference.py) run on that prompt alone. At 2 steps per block
    a prompt of length 6 leaves 2 masks in its first block (and its last): SDAR commits both in one
    step, spreading them would commit one a step, and the outputs differ."""
    model = hashed_model()
    assert attention_grid(model) == BLOCK
    lens, length = [4, 5, 6, 7, 9], 12
    g = torch.Generator().manual_seed(3)
    prompts = [model.allowed[torch.randint(0, model.allowed.numel(), (n,), generator=g)].tolist() for n in lens]
    steps = per_block * (length // BLOCK)
    cfg = SamplerConfig(kind="static", steps=steps, block_size=BLOCK, temperature=0.0)
    batch = sample(model, TOK, prompts, cfg, length, torch.Generator().manual_seed(0))
    for b, p in enumerate(lens):
        ref, ran = reference_generate(model, torch.tensor([prompts[b]]), TOK.mask_id, TOK.forbidden_ids, length,
                                      BLOCK, steps, grid=BLOCK)
        assert torch.equal(ref[0, p:], batch.completion_ids[b]), (per_block, p)
        assert int(batch.nfe[b]) == ran, (per_block, p)       # a block stops once its masks are gone


def test_a_partial_block_stops_once_its_masks_are_committed() -> None:
    """Prompt length 6, 2 steps per block: the first block (2 masks) and the last (2) take one
    denoiser call each, the two full blocks two: NFE 6, every committed step recorded in order."""
    model = hashed_model()
    cfg = SamplerConfig(kind="static", steps=6, block_size=BLOCK, temperature=0.0)
    batch = sample(model, TOK, [model.allowed[:6].tolist()], cfg, 12, torch.Generator().manual_seed(0))
    sm = batch.step_map[0]
    assert int(batch.nfe[0]) == 6
    assert sm[:2].tolist() == [0, 0] and sm[10:].tolist() == [5, 5]      # the partial blocks: one step each
    assert sorted(sm[2:6].tolist()) == [1, 1, 2, 2] and sorted(sm[6:10].tolist()) == [3, 3, 4, 4]
