"""A role as one rank of an FSDP2 group (ray_roles.py starts the group): where this process stands in it,
and everything that touches FSDP2 beyond its public ``fully_shard`` (state-dict options, gathered heads,
gradient sums, unsharded decoding). One place to change when torch's FSDP2 changes.

In one process (no group) every helper is the plain thing: rank 0 of 1, ``layer(hidden)``, no gathers.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions
from transformers import PreTrainedModel

from llm.alignment.lm import full_weight

# Full (unsharded) state dicts: gathered to the first rank on the CPU (other ranks get {}), and loaded
# on every rank, each keeping its shard. The same calls work on a model in one process.
GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True)
FULL = StateDictOptions(full_state_dict=True)


def sharded() -> bool:
    """This process is one rank of a group of several."""
    return dist.is_initialized() and dist.get_world_size() > 1


def first_rank() -> bool:
    """The rank that writes (checkpoints) and answers (gathered state); True in one process."""
    return not dist.is_initialized() or dist.get_rank() == 0


def rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if sharded() else (0, 1)


def head_linear(layer: torch.nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    """``layer(hidden)`` for a head applied outside the model's forward, where an FSDP2-sharded weight is
    a DTensor: gathered (differentiably) to one tensor first. The same op as ``layer(hidden)`` otherwise:
    in the weight's dtype (bf16 with ``training.bf16``; callers upcast the output to fp32)."""
    weight = full_weight(layer.weight)
    return F.linear(hidden.to(weight.dtype), weight, full_weight(layer.bias))


def sum_gradients(model) -> None:
    """FSDP2 averages gradients over the group; a PPO rank's loss is already its share of the whole
    mini-batch's (normalised by all its tokens, update.py), so the ranks' gradients must be summed: divide
    factor 1, with plain sum reductions (gloo has no pre-multiplied sum)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


@contextlib.contextmanager
def gathered_for_decoding(model: PreTrainedModel, enabled: bool = True):
    """In an FSDP2 group: all-gather each sharded module once for a whole ``generate`` call (kept
    unsharded across the decoding steps, freed after) instead of at every decoding step; every rank
    then holds the full weights while it generates, as rollout engines do. Elsewhere, or when FSDP2's
    internals differ from what this expects, nothing changes (the per-step gathers stay)."""
    from torch.distributed.fsdp import FSDPModule

    modules = [m for m in model.modules() if isinstance(m, FSDPModule)] if enabled else []
    try:
        states = [m._get_fsdp_state() for m in modules]
        saved = [(st, st._auto_reshard_after_forward) for st in states]
        groups = [(g, g.post_forward_mesh_info) for st in states for g in st._fsdp_param_groups]
    except AttributeError:
        modules = []
    if not modules:
        yield
        return
    for m in modules:
        m.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for m in modules:
            m.reshard()
        for st, auto in saved:
            st._auto_reshard_after_forward = auto
        for g, info in groups:
            g.post_forward_mesh_info = info
