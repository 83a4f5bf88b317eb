"""The last decoder layer computed at the readout positions only.

A reward model reads its output at a few positions: the step placeholders of a PRM solution (4% of
the tokens on the bundled data), the last chosen and last rejected token of an ORM pair (1.5%).
Every layer but the last must run at every position, since later layers attend to all of them; the
last layer's output, though, is read only at the readouts. So the last layer computes its keys and
values at every position (the readout queries attend to them) and everything else (query
projection, attention, output projection, MLP) at the readouts only: on a 4-layer model about a
fifth of the model's linear-layer work, with the same numbers up to float rounding
(tests/test_packing.py::test_last_layer_at_readouts_equals_full_layer).

``install`` puts this behind the last layer's ``forward``; it takes effect only when the model is
called with ``readout_index`` (flat ``row * L + position`` indices, ``PackedBatch.readout_index``) and
``packed_attention``; the layer output is then zero except at the readout positions. Without
``readout_index`` the layer is the stock one (generation, saving, any other caller). Only decoder
layers of the Llama shape are replaced, recognised by their structure, not their class name
(``mismatch``): exactly an input norm, ``self_attn`` with exactly q/k/v/o linear projections (no q/k
norms as in Qwen3, rotary embeddings over whole heads), a post-attention norm and an MLP. Any other layer keeps the full computation, and the log says why.
"""

from __future__ import annotations

import functools
import logging

import torch

from llm.utils.attention import PackedAttention, readout_sdpa

logger = logging.getLogger(__name__)

LAYER_PARTS = {"input_layernorm", "self_attn", "post_attention_layernorm", "mlp"}
ATTENTION_PARTS = {"q_proj", "k_proj", "v_proj", "o_proj"}


def mismatch(layer: torch.nn.Module) -> str | None:
    """Why ``readout_layer`` would not compute what ``layer`` computes, or None when it would: the structure
    ``readout_layer`` reproduces (module names, linear projections, head sizes, rotary and window settings)."""
    parts = {name for name, _ in layer.named_children()}
    if parts != LAYER_PARTS:
        return f"its parts are {sorted(parts)}, not {sorted(LAYER_PARTS)}"
    attn = layer.self_attn
    parts = {name for name, _ in attn.named_children()}
    if parts != ATTENTION_PARTS:
        return f"its attention has {sorted(parts)}, not exactly {sorted(ATTENTION_PARTS)} (q/k norms?)"
    if not all(isinstance(_base_layer(getattr(attn, name)), torch.nn.Linear) for name in ATTENTION_PARTS):
        return "its q/k/v/o projections are not linear layers"
    for name in ("head_dim", "scaling", "attention_dropout"):
        if not hasattr(attn, name):
            return f"its attention has no {name!r}"
    config = getattr(attn, "config", None)
    if getattr(config, "partial_rotary_factor", 1.0) not in (None, 1.0):
        return "it rotates only part of each head (partial_rotary_factor)"
    if attn.o_proj.in_features % attn.head_dim or attn.q_proj.out_features % attn.head_dim:
        return "its projections are not whole heads of head_dim"
    return None


def _base_layer(module: torch.nn.Module) -> torch.nn.Module:
    """The linear layer under a peft LoRA layer (which computes base + adapter when called), else ``module``."""
    return module.get_base_layer() if hasattr(module, "get_base_layer") else module


def install(model: torch.nn.Module) -> bool:
    """Make the last decoder layer of ``model`` (unwrapped; a peft model's base) honour ``readout_index``; False
    (logged with the reason) when the layer is not of the shape ``readout_layer`` computes."""
    if hasattr(model, "get_base_model"):  # peft (LoRA): its adapters stay in the projections readout_layer calls
        model = model.get_base_model()
    layers = getattr(getattr(model, "base_model", model), "layers", None)
    if not layers:
        logger.warning("last_layer_at_readouts: %s has no decoder layers list; the full last layer runs", type(model))
        return False
    last = layers[-1]
    reason = mismatch(last)
    if reason is not None:
        logger.warning(
            "last_layer_at_readouts: the last layer (%s) is not of the Llama shape this fast path computes: %s; "
            "the full last layer runs (the same numbers, more work)",
            type(last).__name__,
            reason,
        )
        return False
    if not isinstance(last.__dict__.get("forward"), functools.partial) or last.forward.func is not _forward:
        # partial, not a closure: a deep copy of the model then calls its own copy of the layer
        last.forward = functools.partial(_forward, last, last.__dict__.get("forward"))
    return True


def _forward(layer, own_forward, hidden_states, *args, readout_index=None, **kwargs):
    packed, rotary = kwargs.get("packed_attention"), kwargs.get("position_embeddings")
    if readout_index is None or packed is None or rotary is None or args or not readout_index.numel():
        full = own_forward or functools.partial(type(layer).forward, layer)
        return full(hidden_states, *args, **kwargs)
    return readout_layer(layer, hidden_states, readout_index, packed, rotary)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding, the same operations as transformers' ``apply_rotary_pos_emb``."""
    half = x.shape[-1] // 2
    return (x * cos) + (torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin)


def readout_layer(
    layer: torch.nn.Module,
    hidden_states: torch.Tensor,
    readout_index: torch.Tensor,
    packed: PackedAttention,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """``layer(hidden_states)`` at the flat positions ``readout_index``, zero elsewhere. ``(R, L, W)`` -> same."""
    rows, length, width = hidden_states.shape
    attn = layer.self_attn
    dim = attn.head_dim
    positions = torch.unique(readout_index)  # sorted: grouped by row
    n = positions.numel()
    normed = layer.input_layernorm(hidden_states)  # every position: the keys and values
    cos, sin = (t.expand(rows, length, dim) for t in position_embeddings)
    keys = _rotate(attn.k_proj(normed).view(rows, length, -1, dim).transpose(1, 2), cos[:, None], sin[:, None])
    values = attn.v_proj(normed).view(rows, length, -1, dim).transpose(1, 2)
    at = functools.partial(torch.index_select, dim=0, index=positions)
    query = attn.q_proj(at(normed.reshape(-1, width))[None]).view(1, n, -1, dim).transpose(1, 2)
    query = _rotate(query, at(cos.reshape(-1, dim))[None, None], at(sin.reshape(-1, dim))[None, None])

    dropout = attn.attention_dropout if layer.training else 0.0
    out = readout_sdpa(query, keys, values, packed, positions.tolist(), attn.scaling, dropout)
    h = at(hidden_states.reshape(-1, width))[None] + attn.o_proj(out.transpose(1, 2).reshape(1, n, -1))
    h = h + layer.mlp(layer.post_attention_layernorm(h))
    full = hidden_states.new_zeros(rows * length, width).index_copy(0, positions, h[0])
    return full.view(rows, length, width)
