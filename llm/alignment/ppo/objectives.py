"""Policy objectives (``actor_rollout.policy_loss``) and how per-token losses become one loss
(``actor_rollout.loss_agg_mode``), registered by name in ``llm.settings.registry`` (``POLICY_LOSSES``,
``LOSS_AGG_MODES``), which validation and the actor's update both read.

With ``r_t = pi(y_t) / pi_old(y_t)`` and advantage ``A`` (per token), per-token losses:

- ``vanilla`` (PPO, Schulman et al. 2017, eq. 7; separate low/high ranges as DAPO, Yu et al. 2025):
  ``max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))``.
- ``dual_clip`` (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep RL", eq. 5): vanilla, and for
  ``A < 0`` also at most ``-c A`` (``c = clip_ratio_c > 1``): a huge ratio on a bad action no longer gives an
  unbounded loss. As verl's ``compute_policy_loss`` (``clip_ratio_c``) and OpenRLHF's ``dual_clip``.
- ``gspo`` (Zheng et al. 2025, "Group Sequence Policy Optimization", eq. 5-7): one ratio per response, the
  geometric mean of its token ratios ``s = exp(mean_t log r_t)``, clipped as vanilla with ``A``:
  ``max(-A s, -A clip(s, 1 - eps_low, 1 + eps_high))`` at every token of the response; the gradient flows through
  ``s`` (``d s = s * mean_t d log pi(y_t)``), as TRL's ``importance_sampling_level: sequence`` and verl's gspo.
  The paper pairs it with ``seq-mean-token-mean`` and clip ranges around 3e-4 / 4e-4.
- ``cispo`` (MiniMax-M1, Chen et al. 2025, eq. 4): ``-sg(clip(r, 1 - eps_low, 1 + eps_high)) A log pi(y_t)``: the
  clipped ratio is a stop-gradient weight, so every token keeps a gradient (vanilla's clipped tokens have none).
  The paper clips from above only: give ``clip_ratio_low >= 1``. TRL's ``loss_type: cispo`` clamps at
  ``epsilon_high`` itself (``clamp(r, max=epsilon_high)``), so TRL's ``epsilon_high`` is our ``1 + clip_ratio_high``.

Aggregation over the tokens of a mini-batch (verl's ``agg_loss`` names), with ``m`` the loss mask, ``N`` the
mini-batch's masked tokens, ``B`` its responses and ``L`` = ``max_response_length``:

- ``token-mean``: ``sum(loss m) / N`` (DAPO; TRL's ``dapo`` / ``bnpo``);
- ``seq-mean-token-mean``: ``sum_i (sum_t loss m / |y_i|) / B`` (the original GRPO; TRL's ``grpo``);
- ``seq-mean-token-sum``: ``sum(loss m) / B``;
- ``seq-mean-token-sum-norm``: ``sum(loss m) / (B L)`` (Dr. GRPO, Liu et al. 2025: a constant normaliser; TRL's
  ``dr_grpo``).

``N`` and ``B`` count the whole mini-batch (every micro-batch, every rank of an FSDP2 group), so accumulation and
data parallelism add up to the loss of one big batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from llm.alignment.ppo.algorithm import masked_mean
from llm.settings.registry import LOSS_AGG_MODES, POLICY_LOSSES


@dataclass(frozen=True)
class Counts:
    """The whole mini-batch's masked tokens and responses: the normalisers every micro-batch divides by."""

    tokens: torch.Tensor | float
    sequences: int


@dataclass(frozen=True)
class Clip:
    low: float  # eps_low
    high: float  # eps_high
    c: float = 3.0  # dual_clip's bound on a negative advantage's loss


@dataclass
class TokenLosses:
    per_token: torch.Tensor  # (B, T) loss of each token (masked tokens included, the aggregation masks them)
    clipped: torch.Tensor  # (B, T) float: 1 where the objective clipped this token's ratio (a statistic)


# f(logprobs, old_logprobs, advantages, mask, clip) -> TokenLosses, all (B, T)
Objective = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Clip], TokenLosses]


def register_policy_loss(name: str) -> Callable[[Objective], Objective]:
    def add(fn: Objective) -> Objective:
        return POLICY_LOSSES.add(name, fn)

    return add


def clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, clip: Clip) -> tuple[torch.Tensor, torch.Tensor]:
    """``max(-A r, -A clip(r, 1 - low, 1 + high))`` and where the clipped term won."""
    loss1 = -advantages * ratio
    loss2 = -advantages * ratio.clamp(1.0 - clip.low, 1.0 + clip.high)
    return torch.maximum(loss1, loss2), (loss2 > loss1).float()


@register_policy_loss("vanilla")
def vanilla(logprobs, old_logprobs, advantages, mask, clip: Clip) -> TokenLosses:
    per_token, clipped = clipped_surrogate((logprobs - old_logprobs).exp(), advantages, clip)
    return TokenLosses(per_token, clipped)


@register_policy_loss("dual_clip")
def dual_clip(logprobs, old_logprobs, advantages, mask, clip: Clip) -> TokenLosses:
    per_token, clipped = clipped_surrogate((logprobs - old_logprobs).exp(), advantages, clip)
    bound = -advantages * clip.c  # > 0 where A < 0
    lower = (advantages < 0) & (per_token > bound)
    return TokenLosses(torch.where(lower, bound, per_token), torch.maximum(clipped, lower.float()))


@register_policy_loss("gspo")
def gspo(logprobs, old_logprobs, advantages, mask, clip: Clip) -> TokenLosses:
    m = mask.to(logprobs.dtype)
    seq_log_ratio = ((logprobs - old_logprobs) * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp_min(1)
    per_seq, clipped = clipped_surrogate(seq_log_ratio.exp().expand_as(logprobs), advantages, clip)
    return TokenLosses(per_seq, clipped)


@register_policy_loss("cispo")
def cispo(logprobs, old_logprobs, advantages, mask, clip: Clip) -> TokenLosses:
    ratio = (logprobs - old_logprobs).exp().detach()
    weight = ratio.clamp(1.0 - clip.low, 1.0 + clip.high)
    return TokenLosses(-weight * advantages * logprobs, (weight != ratio).float())


# aggregate(per_token, mask, counts, max_length) -> scalar
Aggregation = Callable[[torch.Tensor, torch.Tensor, Counts, int], torch.Tensor]


def register_agg_mode(name: str) -> Callable[[Aggregation], Aggregation]:
    def add(fn: Aggregation) -> Aggregation:
        return LOSS_AGG_MODES.add(name, fn)

    return add


@register_agg_mode("token-mean")
def token_mean(per_token, mask, counts: Counts, max_length: int) -> torch.Tensor:
    return (per_token * mask).sum() / counts.tokens


@register_agg_mode("seq-mean-token-mean")
def seq_mean_token_mean(per_token, mask, counts: Counts, max_length: int) -> torch.Tensor:
    m = mask.to(per_token.dtype)
    return ((per_token * m).sum(-1) / m.sum(-1).clamp_min(1)).sum() / counts.sequences


@register_agg_mode("seq-mean-token-sum")
def seq_mean_token_sum(per_token, mask, counts: Counts, max_length: int) -> torch.Tensor:
    return (per_token * mask).sum() / counts.sequences


@register_agg_mode("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(per_token, mask, counts: Counts, max_length: int) -> torch.Tensor:
    return (per_token * mask).sum() / (counts.sequences * max_length)


def aggregate(mode: str, per_token: torch.Tensor, mask: torch.Tensor, counts: Counts, max_length: int) -> torch.Tensor:
    return LOSS_AGG_MODES[mode](per_token, mask, counts, max_length)


@dataclass
class PolicyLoss:
    loss: torch.Tensor  # scalar: the aggregated per-token losses
    clipfrac: torch.Tensor
    approx_kl: torch.Tensor
    # the same aggregation of |per-token loss|, no gradient: how large the objective's terms are, which ``loss`` hides
    # when positive and negative advantages cancel (on-policy, ratio 1, ``loss`` is -mean(A): 0 after whitening)
    abs_loss: torch.Tensor


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    normaliser: torch.Tensor | float | None = None,
    weights: torch.Tensor | None = None,
    objective: str = POLICY_LOSSES.default,
    agg_mode: str = LOSS_AGG_MODES.default,
    sequences: int | None = None,
    max_length: int | None = None,
    clip_c: float = 3.0,
) -> PolicyLoss:
    """The ``objective``'s per-token losses (module docstring), times ``weights`` when given (truncated importance
    weights, ``algorithm.truncated_is_weights``), aggregated by ``agg_mode`` over the mini-batch's counts:
    ``normaliser`` its masked tokens (default: this mask's), ``sequences`` its responses (default: this batch's),
    ``max_length`` the constant of ``seq-mean-token-sum-norm`` (default: this batch's T)."""
    terms = POLICY_LOSSES[objective](logprobs, old_logprobs, advantages, mask, Clip(clip_low, clip_high, clip_c))
    per_token = terms.per_token if weights is None else terms.per_token * weights
    counts = Counts(
        mask.sum().clamp_min(1) if normaliser is None else normaliser,
        logprobs.shape[0] if sequences is None else sequences,
    )
    length = logprobs.shape[1] if max_length is None else max_length
    log_ratio = logprobs.detach() - old_logprobs
    return PolicyLoss(
        loss=aggregate(agg_mode, per_token, mask, counts, length),
        clipfrac=masked_mean(terms.clipped, mask),
        approx_kl=0.5 * masked_mean(log_ratio.square(), mask),
        abs_loss=aggregate(agg_mode, per_token.detach().abs(), mask, counts, length),
    )
