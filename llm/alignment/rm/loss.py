"""Reward-model losses as pure functions. Each returns *per-item* values; the caller sums them and
divides by the global item count, so gradient accumulation and data parallelism equal one big batch."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def pairwise_loss(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    margin: float = 0.0,
    center_coefficient: float = 0.0,
    regularization: float = 0.0,
) -> torch.Tensor:
    """Bradley-Terry loss per pair: ``-log sigmoid(s_c - s_r - margin) + c * (s_c + s_r)^2 + r * (s_c^2 + s_r^2)``.

    Shapes: ``chosen``, ``rejected`` ``(P,)`` -> ``(P,)``, computed in fp32 whatever the scores' dtype.
    Mean over pairs equals TRL's RewardTrainer loss (``center_rewards_coefficient`` there is ``c`` here) and,
    with ``r``, PaddleNLP's sequence-wise reward loss (``regularization``: ``+ r * (mean s_r^2 + mean s_c^2)``).
    """
    chosen, rejected = chosen.float(), rejected.float()
    loss = -F.logsigmoid(chosen - rejected - margin)
    if center_coefficient:
        loss = loss + center_coefficient * (chosen + rejected) ** 2
    if regularization:
        loss = loss + regularization * (chosen**2 + rejected**2)
    return loss


def step_loss(reward_logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """PRM cross-entropy per step over the two reward-token logits.

    ``reward_logits`` ``(S, 2)`` = logits of ('+', '-') at each placeholder; ``labels`` ``(S,)`` with
    0 = '+', 1 = '-', and -1 for a step without a label (loss 0; the trainer leaves it out of the item
    count). Returns ``(S,)``, in fp32 (the logits are upcast first).
    """
    return F.cross_entropy(reward_logits.float(), labels, reduction="none", ignore_index=-1)


def soft_step_loss(reward_logits: torch.Tensor, labels: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """PRM binary cross-entropy per step against a soft target (Math-Shepherd's soft estimate, OmegaPRM's MC value).

    The model's p(+) is ``softmax([l+, l-])[0] = sigmoid(l+ - l-)``; the target is the step's soft label
    ``values`` ``(S,)`` where it is finite, else its hard label (1 for '+', 0 for '-'), so a step without a soft
    label gets exactly ``step_loss``. Labels ``-1`` (no label): loss 0. Returns ``(S,)`` in fp32.
    """
    logits = reward_logits.float()
    target = torch.where(torch.isnan(values), (labels == 0).float(), values.float())
    loss = F.binary_cross_entropy_with_logits(logits[:, 0] - logits[:, 1], target, reduction="none")
    return torch.where(labels >= 0, loss, torch.zeros_like(loss))


def step_scores(reward_logits: torch.Tensor) -> torch.Tensor:
    """Probability of the positive token, ``softmax([l+, l-])[0]``, per step."""
    return torch.softmax(reward_logits.float(), dim=-1)[:, 0]
