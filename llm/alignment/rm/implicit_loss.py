"""The implicit PRM's math as pure functions (Yuan et al. 2024, "Free Process Rewards without Process Labels").

The reward of a response is parameterised by the trained causal LM ``pi`` and a frozen reference ``pi_ref``::

    r(y)   = beta * sum_t [log pi(y_t | x, y_<t) - log pi_ref(y_t | x, y_<t)]      (the implicit reward)
    r_k    = beta * sum_{t in step k} (log pi - log pi_ref)                          (step k's process reward)
    q_k    = sum_{j <= k} r_j                                                         (its Q-value)
    p_k    = sigmoid(q_k)                                                             (p(correct) of step k)

trained from outcome labels only, in one of two forms:

    ce     BCE(sigmoid(r(y)), o)            o in {0, 1}: the solution's outcome (one item = one solution)
    dpo    -log sigmoid(r(y_c) - r(y_r))    y_c correct, y_r wrong (one item = one pair; DPO's sigmoid loss)

``p_k`` is what the step scorer answers (``rm.implicit``): the paper's Q-value read as a probability, which for the
last step of a whole solution is exactly the ``ce`` form's prediction ``sigmoid(r(y))``. Inputs are per-token
log-probs in fp32; every function returns per-item values (the trainer divides by the global item count).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llm.alignment.dpo.loss import sigmoid_loss


def outcome_ce_loss(rewards: torch.Tensor, outcomes: torch.Tensor) -> torch.Tensor:
    """``(E,)`` binary cross-entropy of ``sigmoid(r(y))`` against each solution's 0/1 outcome (NaN: no outcome,
    loss 0: the caller leaves it out of the item count)."""
    known = ~torch.isnan(outcomes)
    target = torch.where(known, outcomes, torch.zeros_like(outcomes)).float()
    loss = F.binary_cross_entropy_with_logits(rewards.float(), target, reduction="none")
    return torch.where(known, loss, torch.zeros_like(loss))


def pair_dpo_loss(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor) -> torch.Tensor:
    """``(P,)`` DPO's sigmoid loss on implicit rewards that already carry beta: ``-log sigmoid(r_c - r_r)``."""
    return sigmoid_loss(chosen_rewards.float() - rejected_rewards.float(), 1.0)


def step_rewards(log_ratios: torch.Tensor, steps: torch.Tensor, n_steps: int, beta: float) -> torch.Tensor:
    """``(n_steps,)`` process rewards ``r_k = beta * sum of step k's token log-ratios`` of one solution;
    ``log_ratios`` ``(T,)`` per token, ``steps`` ``(T,)`` the step index of each token."""
    out = torch.zeros(n_steps, dtype=torch.float32, device=log_ratios.device)
    return beta * out.index_add(0, steps, log_ratios.float())


def step_probabilities(rewards: list[float]) -> list[float]:
    """p(correct) of every step: ``sigmoid`` of the cumulative implicit reward up to it (its Q-value)."""
    out, q = [], 0.0
    for r in rewards:
        q += r
        out.append(float(torch.sigmoid(torch.tensor(q, dtype=torch.float64))))
    return out
