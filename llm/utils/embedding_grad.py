"""The input embedding's gradient written into a buffer kept across steps, not a fresh vocabulary-sized one.

Autograd's embedding backward allocates a zero-filled ``(vocabulary, hidden)`` gradient every backward (49,152 x 576
on SmolLM2: 56 MB in bf16, 113 MB in fp32), scatters the step's few hundred token rows into it, and with tied
weights adds the LM head's gradient into it, a second fresh tensor of the same size. Tensors that large are mapped
afresh by glibc each time, so a PPO mini-batch paid for the page faults of two or three of them (20-150 ms each on
a CPU) for a few hundred rows of information.

``reuse_embedding_gradient(model)`` makes the model's input embedding (an ``nn.Embedding``) look its rows up through
``_Lookup``, whose backward, when the weight has no gradient yet (the first backward after the optimizer's
``zero_grad(set_to_none=True)``), zero-fills a buffer kept by the embedding, scatters the rows into it in the order
autograd's own backward does, and makes it the weight's ``.grad``; a tied LM head's gradient is then added into it
in place by autograd (``AccumulateGrad``). A later backward before the next ``zero_grad`` (gradient accumulation
over micro-batches) returns the dense gradient exactly as autograd's backward does. Either way the gradient is
bit-identical to autograd's (``tests/test_embedding_grad.py``). For one process with plain tensors on a CPU only: a
gradient set outside ``AccumulateGrad`` would bypass DDP's and FSDP's gradient hooks, so sharded or replicated
models are left alone; on a GPU the caching allocator already reuses memory, and ``index_add_`` / ``index_put_``
add with atomics in no fixed order where autograd's embedding backward is deterministic.
"""

from __future__ import annotations

import logging
import types

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)


def _rows(ids: torch.Tensor, grad: torch.Tensor, padding_idx: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The flat token ids and their gradient rows, the padding id's rows left out (they get no gradient)."""
    ids, rows = ids.reshape(-1), grad.reshape(-1, grad.shape[-1])
    if padding_idx is not None:
        keep = ids != padding_idx
        ids, rows = ids[keep], rows[keep]
    return ids, rows


def _scatter(out: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``out[ids[i]] += rows[i]`` in order, summed as autograd's embedding backward on a CPU sums them (bit for bit,
    torch 2.13): ``index_add_`` for fp32 / fp64, an accumulating ``index_put_`` for bf16 / fp16 (each differs from
    the backward in the other precisions)."""
    rows = rows.to(out.dtype)
    if out.dtype in (torch.bfloat16, torch.float16):
        return out.index_put_((ids,), rows, accumulate=True)
    return out.index_add_(0, ids, rows)


class _Lookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor, module: torch.nn.Embedding) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.module = module
        return F.embedding(ids, weight, module.padding_idx, module.max_norm, module.norm_type, False, False)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (ids,) = ctx.saved_tensors
        module = ctx.module
        weight = module.weight
        flat, rows = _rows(ids, grad, module.padding_idx)
        if weight.grad is not None:  # accumulating: autograd's own dense gradient, summed by autograd as always
            dense = torch.zeros_like(weight)
            return None, _scatter(dense, flat, rows), None
        buffer = module._grad_buffer
        if buffer is None or buffer.shape != weight.shape or buffer.dtype != weight.dtype:
            buffer = module._grad_buffer = torch.empty_like(weight)
        _scatter(buffer.zero_(), flat, rows)
        weight.grad = buffer
        return None, None, None


def _forward(self: torch.nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() and self.weight.requires_grad and self.weight.device.type == "cpu":
        return _Lookup.apply(ids, self.weight, self)  # (a model moved off the CPU afterwards: autograd's own)
    return torch.nn.Embedding.forward(self, ids)


def reuse_embedding_gradient(model: torch.nn.Module, role: str = "model") -> bool:
    """Route ``model``'s input embedding through ``_Lookup`` (module docstring); False (nothing changed) when it is
    not a plain trained ``nn.Embedding`` (frozen, a DTensor, ``max_norm`` / ``scale_grad_by_freq`` / ``sparse``)."""
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if get is not None else None
    if type(emb) is not torch.nn.Embedding:
        return False
    weight = emb.weight
    plain = type(weight) in (torch.nn.Parameter, torch.Tensor) and not hasattr(weight, "device_mesh")
    if not (weight.requires_grad and plain) or emb.max_norm is not None or emb.scale_grad_by_freq or emb.sparse:
        return False
    if weight.device.type != "cpu":  # a GPU's caching allocator reuses memory already; its scatter-adds are atomic
        return False  # (sums in no fixed order), where autograd's embedding backward sorts: left alone
    if getattr(emb, "_grad_buffer", False) is False:  # once per module
        emb._grad_buffer = None
        emb.forward = types.MethodType(_forward, emb)
        logger.info(
            "%s: the input embedding's gradient (%d x %d) goes into a buffer kept across steps",
            role,
            *weight.shape,
        )
    return True
