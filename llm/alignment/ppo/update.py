"""The one update loop of the trained roles (actor and critic): epochs over mini-batches, micro-batches
accumulated into one optimizer step per mini-batch, on a loss function the role supplies.

The loss of every micro-batch is normalised by the whole mini-batch's token count, so the split into
micro-batches (or over the ranks of an FSDP2 group) changes nothing. A rank of a group runs its
contiguous share of every mini-batch (``update_shares``) plus zero-weighted spare micro-batches up to
the largest share's count (every forward and backward is a collective); its gradients are summed over
the ranks (``fsdp.sum_gradients``), and so are the per-step stats (``sum_steps``): each optimizer step
is one process's on the whole mini-batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from llm.alignment.ppo.fsdp import rank_world
from llm.alignment.ppo.objectives import Counts
from llm.settings.registry import LOSS_AGG_MODES, POLICY_LOSSES
from llm.utils.distributed import share, sum_over_ranks, with_spares


@dataclass(frozen=True)
class PolicyUpdate:
    """How the actor turns one rollout into optimizer steps (the actor_rollout / algorithm fields)."""

    mini_batch_size: int  # samples per optimizer step
    clip_low: float
    clip_high: float
    entropy_coeff: float = 0.0
    kl_loss_coef: float = 0.0  # > 0: KL to the reference as a loss term (needs PolicyBatch.ref_logprobs)
    kl_penalty: str = "kl"  # the estimator of that loss term
    policy_loss: str = POLICY_LOSSES.default  # a registered objective (objectives.py)
    clip_c: float = 3.0  # dual_clip
    loss_agg_mode: str = LOSS_AGG_MODES.default  # objectives.py: the policy, entropy and KL terms alike
    max_length: int = 1  # seq-mean-token-sum-norm's constant: max_response_length
    mask_truncated: bool = False  # responses without EOS left out of the loss


@dataclass(frozen=True)
class ValueUpdate:
    """How the critic fits returns (the critic section's fields)."""

    mini_batch_size: int
    cliprange_value: float | None
    value_loss_coef: float = 1.0


# loss_fn(part, counts) -> (loss to backpropagate, stats): ``part`` the sample indices of one micro-batch,
# ``counts`` the mini-batch's masked tokens and samples (objectives.Counts); ``stats()`` (called after the
# backward, not for spares) gives that micro-batch's contributions to the step's sums.
LossFn = Callable[[list[int], Counts], tuple[torch.Tensor, Callable[[], dict[str, float]]]]


def chunks(items: list[int], size: int) -> list[list[int]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def update_shares(mb: list[int], micro_batch_size: int) -> list[tuple[list[int], bool]]:
    """This rank's micro-batches of mini-batch ``mb``: its contiguous share (all of ``mb`` in one process)
    in micro-batches, then spares (``mb[:1]``, True) up to the count of the largest share, so every rank
    runs the same number of forwards and backwards. Each micro-batch packs into one forward."""
    rank, world = rank_world()
    mine = [mb[i] for i in share(len(mb), rank, world)]
    rounds = math.ceil(math.ceil(len(mb) / world) / micro_batch_size)
    return list(with_spares(chunks(mine, micro_batch_size), rounds, mb[:1]))


def sum_steps(steps: list[dict[str, float]], device) -> list[dict[str, float]]:
    """Per-optimizer-step stats summed over the ranks of an FSDP2 group (each rank's are sums over its
    share of the mini-batch, normalised by the whole mini-batch's tokens); as they are in one process."""
    if not steps:
        return steps
    keys = list(steps[0])
    flat = sum_over_ranks([t[k] for t in steps for k in keys], device)
    return [dict(zip(keys, flat[i * len(keys) : (i + 1) * len(keys)])) for i in range(len(steps))]


def run_update(
    role,
    mask: torch.Tensor,
    orders: list[list[int]],
    mini_batch_size: int,
    names: tuple[str, ...],
    loss_fn: LossFn,
) -> tuple[list[dict[str, float]], list[int]]:
    """One pass per order (an epoch) over mini-batches of ``mini_batch_size`` samples of ``role``'s
    model, one ``role.optim.step()`` each. Returns each step's stats (the sums of ``names`` over its
    micro-batches, summed over the ranks) and its epoch; counts ``role.samples_seen``."""
    steps, epochs = [], []
    role.model.train()
    for epoch, order in enumerate(orders):
        for mb in chunks(order, mini_batch_size):
            counts = Counts(mask[mb].sum().clamp_min(1), len(mb))
            totals = dict.fromkeys(names, 0.0)
            for part, spare in update_shares(mb, role.micro_batch_size):
                loss, stats = loss_fn(part, counts)
                if spare:  # this rank's share ran out: a zero-weighted backward keeps the group in step
                    (loss * 0).backward()
                    continue
                role.samples_seen += len(part)
                loss.backward()
                for key, value in stats().items():
                    totals[key] += value
            role.optim.step()
            steps.append(totals)
            epochs.append(epoch)
    return sum_steps(steps, role.model.device), epochs
