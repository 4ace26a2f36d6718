"""``benchmarks.grad_snr``'s gradient of the whole renoising chain, against ADPO's own update on a
tiny random-init DiffusionGemma (transformers' class, the real config fields)."""

from __future__ import annotations

import copy

import pytest
import torch

from benchmarks.grad_snr import _tap, chain_gradient
from miles_core.algo.update import update_policy
from miles_core.config import RenoiseConfig, UpdateConfig
from miles_core.models import diffusion_gemma as dg
from miles_core.models.lora import add_lora
from miles_core.samplers import renoise as rn
from miles_core.tokenizer import CharTokenizer

pytestmark = [pytest.mark.filterwarnings("ignore::FutureWarning"), pytest.mark.filterwarnings("ignore::DeprecationWarning")]

TOK = CharTokenizer()
PROMPTS = ["12+3=", "7*8=", "1+1=", "9-4*2="]
# stability 0: the stop is the mean-entropy test alone, so rows of a random model stop at different steps
EARLY = RenoiseConfig(max_steps=10, entropy_bound=3.0, stability_threshold=0, confidence_threshold=4.556)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = dg.write_tiny_checkpoint(tmp_path_factory.mktemp("dg"), TOK, canvas_length=8, hidden=32, heads=2)
    return dg.load_diffusion_gemma(d)[0]


def _ids(texts):
    return [TOK.encode(t) for t in texts]


def test_grad_snr_chain_gradient_detached_is_adpos_on_policy_gradient(model):
    """``benchmarks.grad_snr.chain_gradient`` with the self-conditioning detached is ADPO's gradient
    of a fresh batch (ratio 1, no clip active) up to its normaliser; built through the
    self-conditioning it adds the policy's effect on later steps, another direction."""
    pm = add_lora(copy.deepcopy(model), r=4, alpha=8)
    with torch.no_grad():   # LoRA B = 0 would leave the A gradients zero: give the adapter a path
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(n)))
    batch = rn.sample(pm, TOK, _ids(PROMPTS * 2), EARLY, torch.arange(8) + 40)
    batch.advantage = torch.tensor([1.0, -1.0, 0.5, -0.5, 0.8, -0.3, -0.7, 0.2])
    params = [p for p in pm.parameters() if p.requires_grad]
    ref, det, full = _tap(params), _tap(params), _tap(params)
    update_policy(pm, ref, batch, UpdateConfig(num_minibatches=1, epochs=1, max_grad_norm=1e9), TOK, 1.0,
                torch.Generator().manual_seed(0))
    chain_gradient(pm, det, batch, EARLY, TOK, through_soft=False)
    chain_gradient(pm, full, batch, EARLY, TOK)
    g_ref, g_det, g_full = ref.grads[0], det.grads[0], full.grads[0]
    cos = lambda a, b: float(a @ b / (a.norm() * b.norm()))  # noqa: E731
    assert g_ref.norm() > 0 and cos(g_ref, g_det) > 1 - 1e-9
    assert cos(g_det, g_full) < 1 - 1e-6
