"""The engine's model call: logits for a window of positions, with optional KV caches.

A sampler step only decides the positions of the current block, so it asks for logits there
and nowhere else: at LLaDA's vocabulary (126,464 rows) the LM head over a whole 64 x 300 batch is
~10 GB of float32 per step, over a 32-position block about a ninth of that. :func:`window_logits`
runs the backbone on the *query* positions ``[q0, q1)`` (attending to the cached keys too) and the
LM head on ``out = [o0, o1)`` only.

Caches (Fast-dLLM, Wu et al. 2025, arXiv:2505.22618, ``llada/generate.py``):
* ``prefix``: at a block start one full pass; keys/values of the prompt and finished blocks are
  kept and later steps of the block run only the block and what follows;
* ``dual``: the suffix after the block is kept too, so later steps run the block alone.
In a bidirectional model both are approximations (cached keys are not refreshed as later tokens
are revealed); in a block-causal one (SDAR) the prefix is exact when blocks align. The sampler
records the log-probs of the distribution it actually sampled from, cached or not, and the learner
scores without a cache: the importance weight corrects the gap (benchmarks/speed/rollout.py measures it).

Every backend class is a :class:`WindowDenoiser` (tiny, the Llama, the published families, remote
code): it implements ``window(ids, mask, query, out, cache, keep)`` and states its
:class:`Capabilities` (caches, attention grid, logit shift, what its logits weigh, how its
tensors are named), which the sampler, the update engine, LoRA and FSDP read instead of probing
attributes. Anything else (DiffusionGemma's native class, a denoiser built in a test) has the
default capabilities: a full forward sliced to ``out``, no cache, full attention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Union

import torch
from peft import PeftModel
from torch import Tensor, nn

Span = tuple[int, int]
Out = Union[Span, Tensor]  # a span of positions, or [B, n] absolute positions per row


@dataclass
class KVCache:
    """Keys/values of the absolute positions ``spans`` (in key order) for every layer.

    ``layers[i] = (k, v)``, each [B, H, N, Dh] with N the spans' total length."""

    spans: tuple[Span, ...]
    layers: list[tuple[Tensor, Tensor]]

    def index(self, device: torch.device) -> Tensor:
        """[N] the absolute positions of the cached keys, in their order."""
        return torch.cat([torch.arange(a, b, device=device) for a, b in self.spans])

    @property
    def length(self) -> int:
        return sum(b - a for a, b in self.spans)

    def select(self, rows: Tensor) -> "KVCache":
        """The cache of some rows (the sampler drops finished rows)."""
        return KVCache(self.spans, [(k[rows], v[rows]) for k, v in self.layers])


@dataclass(frozen=True)
class Capabilities:
    """What a denoiser can do beyond ``model(ids, mask) -> logits``, stated by its backend.

    ``kv_cache``: its window keeps prefix/dual caches. ``block_size``: the attention grid of a
    block-causal model (SDAR: bidirectional within blocks at absolute multiples of it, causal
    across them), 0 for full attention. ``logit_shift``: position i's logits are read from the
    hidden state at i - 1 (Dream): a cached step's query then starts one position before the block.
    ``head_weight``: what one scored position's logits cost in training memory, in units of one
    position's backbone activations (:func:`head_weight_of`; 0: only positions count).
    ``native``: the transformers model_type it runs inside (a saved adapter's task type).
    ``wraps_lm``: the published class runs inside as the attribute ``lm`` (LoRA module paths drop
    ``lm.``); ``to_published`` / ``to_native``: a native tensor name -> the family's published one
    and back, when the family renames tensors (LLaDA), else None."""

    kv_cache: bool = False
    block_size: int = 0
    logit_shift: bool = False
    head_weight: float = 0.0
    native: str = ""
    wraps_lm: bool = False
    to_published: Callable[[str], str | None] | None = None
    to_native: Callable[[str], str | None] | None = None


class WindowDenoiser(nn.Module):
    """A backend that computes logits for a window of positions (module docstring) and states its
    :class:`Capabilities`. Subclasses implement both methods."""

    def capabilities(self) -> Capabilities:
        raise NotImplementedError

    def window(self, ids: Tensor, mask: Tensor, query: Span, out: Out, cache: KVCache | None = None,
               keep: tuple[Span, ...] = ()) -> tuple[Tensor, KVCache | None]:
        raise NotImplementedError


def inner(model: nn.Module) -> nn.Module:
    """The denoiser under a peft wrapper (its LoRA layers are injected in place, so calls through
    it train and sample the adapted policy; it is also FSDP's root)."""
    return model.get_base_model() if isinstance(model, PeftModel) else model


def capabilities(model: nn.Module) -> Capabilities:
    """The capabilities ``model``'s backend states (peft unwrapped); the defaults for any other module."""
    m = inner(model)
    return m.capabilities() if isinstance(m, WindowDenoiser) else Capabilities()


def supports_cache(model: nn.Module) -> bool:
    return capabilities(model).kv_cache


def attention_grid(model: nn.Module) -> int:
    """The attention block size of a block-causal model, 0 for a full-attention one."""
    return capabilities(model).block_size


def logit_shift(model: nn.Module) -> int:
    """1 when position i's logits are read from the hidden state at i - 1 (Dream), else 0."""
    return int(capabilities(model).logit_shift)


def head_weight_of(vocab: int, hidden: int, layers: int, mlp: int) -> float:
    """One scored position's logits in training memory, in units of one position's backbone
    activations: ~3 x V floats (logits, tempered logits, log-probs) against ~layers x (8 x hidden
    + 3 x MLP) floats. 26 for the rollout benchmark's 41M model (vocab 151,936, hidden 128), 0.17
    for LLaDA-8B."""
    return 3.0 * vocab / (layers * (8 * hidden + 3 * mlp))


def model_device(model: nn.Module) -> torch.device:
    """Where the weights are (the sampler builds every tensor there)."""
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def window_logits(model: nn.Module, ids: Tensor, mask: Tensor, query: Span, out: Out,
                  cache: KVCache | None = None, keep: tuple[Span, ...] = ()) -> tuple[Tensor, KVCache | None]:
    """Logits [B, n, V] of positions ``out`` (a span [o0, o1), or [B, n] positions per row) from a
    pass over ``query`` (plus ``cache``'s keys).

    ids, mask [B, T] are the whole sequence (mask: real tokens). ``keep``: spans inside ``query``
    whose keys/values this pass returns as a new cache (None when empty)."""
    m = inner(model)
    if isinstance(m, WindowDenoiser):
        return m.window(ids, mask, query, out, cache, keep)
    if cache is not None or keep:
        raise ValueError(f"{type(m).__name__} has no KV cache: use sampler.cache=none")
    return select_out(model(ids, mask), out), None


def select_out(full: Tensor, out: Out) -> Tensor:
    """The ``out`` positions [B, n, V] of a full forward's logits [B, T, V] (models without a window)."""
    if isinstance(out, Tensor):
        return full.gather(1, out[..., None].expand(-1, -1, full.shape[-1]))
    return full[:, out[0]:out[1]]


def kept_spans(layers: list[tuple[Tensor, Tensor]], keep: tuple[Span, ...], start: int) -> KVCache:
    """A cache of the absolute positions ``keep`` from a pass's per-layer keys/values [B, H, N, Dh],
    whose index 0 is absolute position ``start``."""
    def take(t: Tensor) -> Tensor:
        return torch.cat([t[:, :, a - start:b - start] for a, b in keep], 2)
    return KVCache(tuple(keep), [(take(k), take(v)) for k, v in layers])


def key_mask(mask: Tensor, query: Span, cache: KVCache | None) -> tuple[Tensor, Tensor]:
    """-> (key positions [Tk] in key order, [B, Tk] real keys): cached keys first, then the query's."""
    q = torch.arange(query[0], query[1], device=mask.device)
    idx = torch.cat([cache.index(mask.device), q]) if cache is not None else q
    return idx, mask[:, idx]


def hf_window(lm: Any, ids: Tensor, mask: Tensor, query: Span, out: Out, cache: KVCache | None,
              keep: tuple[Span, ...], block_size: int = 0, shift: bool = False) -> tuple[Tensor, KVCache | None]:
    """:func:`window_logits` for a transformers ``*ForCausalLM`` run bidirectionally (or block-causal
    with ``block_size`` > 0, Dream's logit ``shift``). Positions count real tokens only, as in the
    full forward, so a cached step sees the same rotary positions as an uncached one."""
    from transformers import DynamicCache

    dev = lm.get_input_embeddings().weight.device
    ids, mask = ids.to(dev), mask.to(dev).bool()
    q0, q1 = query
    pos = (mask.long().cumsum(1) - 1).clamp_min(0)                                     # [B, T]
    kidx, kreal = key_mask(mask, query, cache)                                          # [Tk], [B, Tk]
    c = cache.length if cache is not None else 0
    if block_size > 0:  # key real and in the query's block or an earlier one: [B, 1, Tq, Tk]
        qb, kb = pos[:, q0:q1] // block_size, pos[:, kidx] // block_size
        allowed = (kreal[:, None, :] & (qb[:, :, None] >= kb[:, None, :]))[:, None]
    else:               # every real key: [B, 1, 1, Tk], broadcast over queries
        allowed = kreal[:, None, None, :]
    # a padded query (outputs never read) still sees the row's first real token (position 0,
    # block 0), so no softmax row is empty
    past = DynamicCache(ddp_cache_data=cache.layers) if cache is not None else None
    res = lm.model(input_ids=ids[:, q0:q1], attention_mask=allowed, position_ids=pos[:, q0:q1],
                   cache=past, use_cache=past is not None or bool(keep))
    h = res.last_hidden_state                                                           # [B, Tq, D]
    logits = out_logits(lm.lm_head, h, mask, query, out, shift)                         # [B, n, V]
    kept = kept_spans([(lay.keys, lay.values) for lay in res.cache.layers], keep, q0 - c) if keep else None
    return logits, kept


def out_logits(head: Callable[[Tensor], Tensor], h: Tensor, mask: Tensor, query: Span, out: Out,
               shift: bool = False) -> Tensor:
    """Logits [B, n, V] of ``out`` from a pass's hidden states h [B, Tq, D]: a span [o0, o1) of
    positions (the head over that slice), or [B, n] absolute positions per row (the learner scores
    committed positions only: their hidden states are gathered first).

    Dream's ``shift``: position i reads the state at i - 1, except a row's first real token, which
    reads its own (Dream's ``cat([logits[:, :1], logits[:, :-1]])`` at position 0). On a span the
    logits are shifted, not the hidden states, so a window's rounding is the full forward's."""
    q0 = query[0]
    if isinstance(out, Tensor):
        idx = out
        if shift:
            before = torch.where(idx > 0, mask.gather(1, (idx - 1).clamp_min(0)), torch.zeros_like(idx, dtype=torch.bool))
            first = mask.gather(1, idx) & ~before                                        # [B, n]
            idx = torch.where(first, idx, (idx - 1).clamp_min(0))
        return head(h.gather(1, (idx - q0)[..., None].expand(-1, -1, h.shape[-1])))     # [B, n, V]
    o0, o1 = out
    if not shift:
        return head(h[:, o0 - q0:o1 - q0])
    if o0 == q0 > 0:
        raise ValueError(f"a shifted window needs position {o0 - 1} in its query {query}")
    a = max(o0 - 1, q0)
    z = head(h[:, a - q0:o1 - q0])                                     # [B, o1 - a, V]
    own = z[:, o0 - a:]                                                # logits read at i
    prev = z[:, :o1 - o0] if o0 > q0 else torch.cat([z[:, :1], z[:, :o1 - o0 - 1]], 1)   # read at i - 1
    before = mask[:, o0 - 1:o1 - 1] if o0 > 0 else torch.cat([torch.zeros_like(mask[:, :1]), mask[:, :o1 - 1]], 1)
    first = mask[:, o0:o1] & ~before                                   # [B, L] a row's first real token
    return torch.where(first[..., None], own, prev)
