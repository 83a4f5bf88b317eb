"""PPO / GRPO / RLOO / REINFORCE++ math as pure functions of tensors (torch only, no logging; the running
reward moments and KL controllers keep Python floats), and the registries of the variants.

Token tensors are ``(B, T)`` over response tokens, right-padded; ``mask`` is 1.0 on the response tokens the
policy is trained on (``Samples.response_mask``: every real response token of a single-turn sample, the model's
tokens of a multi-turn episode, whose environment tokens in between are 0). Position t holds what concerns
response token t (its log-prob, the value of the state before it, the reward received after emitting it).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from llm.settings.registry import ADV_ESTIMATORS, EXACT_KL, KL_CONTROLLERS, KL_ESTIMATORS


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    return (x * mask).sum() if dim is None else (x * mask).sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    if dim is None:
        return masked_sum(x, mask) / mask.sum().clamp_min(1)
    return masked_sum(x, mask, dim) / mask.sum(dim).clamp_min(1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over masked entries, unbiased variance (as TRL and OpenRLHF). Zero outside the mask."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    n = mask.sum()
    if n > 1:
        var = var * n / (n - 1)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * mask


# --- KL estimators (Schulman, "Approximating KL divergence", 2020) ---------------------------------
# KL_ESTIMATORS (llm.settings.registry): name -> f(log p - log q) per token


def register_kl_estimator(*names: str):
    """Register ``f(log_ratio) -> per-token KL estimate`` under ``names`` (``algorithm.kl_penalty``)."""

    def add(fn):
        for name in names:
            if name == EXACT_KL:
                raise ValueError(f"KL estimator {name!r} is reserved for the exact KL")
            KL_ESTIMATORS.add(name, fn)
        return fn

    return add


@register_kl_estimator("kl", "k1")
def _k1(log_ratio: torch.Tensor) -> torch.Tensor:
    return log_ratio


@register_kl_estimator("abs")
def _abs(log_ratio: torch.Tensor) -> torch.Tensor:
    return log_ratio.abs()


@register_kl_estimator("mse", "k2")
def _k2(log_ratio: torch.Tensor) -> torch.Tensor:
    return 0.5 * log_ratio.square()


@register_kl_estimator("low_var_kl", "k3")
def _k3(log_ratio: torch.Tensor) -> torch.Tensor:
    neg = -log_ratio
    return neg.exp() - neg - 1


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from sampled-token log-probs.

    kl / k1: ``log p - log q``; abs: ``|log p - log q|``; mse / k2: ``0.5 (log p - log q)^2``;
    low_var_kl / k3: ``exp(log q - log p) - (log q - log p) - 1`` (unbiased, always >= 0).
    ("full" needs the whole distributions: see ``full_kl``.)
    """
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kind!r}")
    return KL_ESTIMATORS[kind](logprobs - ref_logprobs)


def full_kl(logits: torch.Tensor, ref_logits: torch.Tensor) -> torch.Tensor:
    """Exact KL(pi || pi_ref) over the vocabulary per position: ``(N, V), (N, V) -> (N,)``. The actor applies
    it (``token_stats``) to one chunk of readouts at a time (roles.py): no ``(B, T, V)`` tensor is ever made."""
    return _kl(torch.log_softmax(logits.float(), -1), torch.log_softmax(ref_logits.float(), -1))


def _kl(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    return (logp.exp() * (logp - logq)).sum(-1)


def token_stats(
    logits: torch.Tensor,
    targets: torch.Tensor,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    ref_logits: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """From fp32 logits ``(n, V)`` (temperature applied) of readouts with ``targets`` ``(n,)``: the targets'
    log-probs, with ``with_entropy`` the entropies ``-sum p log p`` (differentiable only with
    ``entropy_grad``, else a statistic: nothing of theirs is kept for backward), and with ``ref_logits`` the
    exact ``full_kl`` to them (no gradient); each ``(n,)`` or None."""
    logp = torch.log_softmax(logits, -1)
    out = logp.gather(-1, targets[:, None]).squeeze(-1)
    entropy = kl = None
    if with_entropy:
        with torch.set_grad_enabled(torch.is_grad_enabled() and entropy_grad):
            entropy = -(logp.exp() * logp).sum(-1)
    if ref_logits is not None:
        with torch.no_grad():
            kl = _kl(logp, torch.log_softmax(ref_logits.float(), -1))
    return out, entropy, kl


# --- KL coefficient controllers ---------------------------------------------------------------------
@dataclass
class FixedKLController:
    value: float

    def update(self, current_kl: float, n_steps: int) -> None:
        pass


@dataclass
class AdaptiveKLController:
    """Ziegler et al. 2019, eq. (2): beta <- beta * (1 + clip(KL / target - 1, -0.2, 0.2) * n / horizon)."""

    value: float
    target: float
    horizon: float

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


# algorithm.kl_ctrl.type -> controller built from the kl_ctrl section (kl_coef, target_kl, horizon)
KL_CONTROLLERS.add("fixed", lambda ctl: FixedKLController(ctl.kl_coef))
KL_CONTROLLERS.add("adaptive", lambda ctl: AdaptiveKLController(ctl.kl_coef, ctl.target_kl, ctl.horizon))


# --- rewards -----------------------------------------------------------------------------------------
def shape_scores(
    scores: torch.Tensor,
    ended: torch.Tensor,
    moments: RunningMoments,
    missing_eos_penalty: float | None = None,
    normalize: bool = False,
    clip: float | None = None,
) -> torch.Tensor:
    """The score each sample's last token receives, from the reward's raw ``scores`` ``(B,)``: minus
    ``missing_eos_penalty`` where the response stopped before EOS (``ended`` False); with ``normalize``,
    ``(s - mean) / std`` by the running moments, updated with this batch first; then clipped to
    ``[-clip, clip]``."""
    scores = scores.clone()
    if missing_eos_penalty is not None:
        scores = scores - missing_eos_penalty * (~ended).float()
    if normalize:
        moments.update(scores)
        scores = (scores - moments.mean) / moments.std
    if clip is not None:
        scores = scores.clamp(-clip, clip)
    return scores


# --- per-token rewards -----------------------------------------------------------------------------------------
def last_tokens(mask: torch.Tensor) -> torch.Tensor:
    """``(B,)`` the index of each row's last masked token (a multi-turn episode's last model token; 0 for a row
    without one)."""
    positions = torch.arange(mask.shape[1], dtype=mask.dtype, device=mask.device)
    return (mask * positions).amax(1).long() if mask.shape[1] else torch.zeros(len(mask), dtype=torch.long)


def environment_rewards(
    turn_ends: list[list[int]], turn_rewards: list[list[float]], mask: torch.Tensor, per_turn: bool, gamma: float
) -> torch.Tensor:
    """``(B, T)`` the environment's rewards of multi-turn episodes: ``per_turn`` (GAE), ``turn_rewards[k]`` at
    ``turn_ends[k]``; else (the estimators that see one outcome per episode) the discounted return
    ``sum_k gamma^k turn_rewards[k]`` at the episode's last model token."""
    out = torch.zeros(mask.shape)
    last = last_tokens(mask).tolist()
    for i, (ends, rewards) in enumerate(zip(turn_ends, turn_rewards)):
        if per_turn:
            for end, reward in zip(ends, rewards):
                out[i, end] += reward
        else:
            out[i, last[i]] += sum(gamma**k * reward for k, reward in enumerate(rewards))
    return out


def token_rewards(
    kl: torch.Tensor,
    scores: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
    dense: torch.Tensor | None = None,
    env: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token reward: ``-kl_coef * kl`` on the masked tokens, plus the score at the last masked token (the
    response's last, or a multi-turn episode's last model token), plus optional dense rewards (PRM step scores
    placed at each step's last token) and the environment's (``environment_rewards``)."""
    rewards = -kl_coef * kl * mask
    rewards = rewards.clone()
    rewards[torch.arange(len(scores)), last_tokens(mask)] += scores
    if dense is not None:
        rewards = rewards + dense * mask
    if env is not None:
        rewards = rewards + env * mask
    return rewards


# --- advantage estimators ---------------------------------------------------------------------------
def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016, eq. 16), vectorised over the batch, over the
    masked tokens only.

    ``delta_t = r_t + gamma V_{t'} - V_t``; ``A_t = delta_t + gamma lam A_{t'}``, with ``t'`` the next masked
    token after ``t``: a token off the mask (an environment token between a multi-turn episode's model turns, or
    padding) is skipped, neither discounted nor bootstrapped from; the last masked token bootstraps 0. On a
    contiguous mask (single-turn) ``t' = t + 1``. Returns ``(advantages, returns = advantages + values)``, 0 off
    the mask.
    """
    values = values * mask
    last = torch.zeros_like(rewards[:, 0])
    next_value = torch.zeros_like(last)
    out = torch.zeros_like(rewards)
    for t in reversed(range(rewards.shape[1])):
        on = mask[:, t] > 0
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last = torch.where(on, delta + gamma * lam * last, last)
        next_value = torch.where(on, values[:, t], next_value)
        out[:, t] = last
    out = out * mask
    return out, (out + values) * mask


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """``G_t = r_t + gamma G_{t'}`` per sequence, ``t'`` the next masked token (tokens off the mask are skipped,
    as in ``gae``); REINFORCE++ uses these, then whitens."""
    out = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(mask[:, t] > 0, rewards[:, t] + gamma * running, running)
        out[:, t] = running
    return out * mask


def group_advantages(
    scores: torch.Tensor, group_size: int, kind: str, eps: float = 1e-6, norm_by_std: bool = True
) -> torch.Tensor:
    """Outcome advantages over groups of ``group_size`` samples of the same prompt (consecutive).

    grpo (Shao et al. 2024): ``(r - mean_g) / (std_g + eps)`` (unbiased std, as DeepSeekMath code); with
    ``norm_by_std`` false, Dr. GRPO's ``r - mean_g`` (Liu et al. 2025, "Understanding R1-Zero-Like Training");
    rloo (Ahmadian et al. 2024): ``r_i - mean_{j != i} r_j``.
    """
    grouped = scores.view(-1, group_size)
    if kind == "grpo":
        centred = grouped - grouped.mean(dim=1, keepdim=True)
        if not norm_by_std:
            return centred.view(-1)
        std = grouped.std(dim=1, keepdim=True) if group_size > 1 else torch.ones_like(grouped[:, :1])
        return (centred / (std + eps)).view(-1)
    if kind == "rloo":
        if group_size < 2:
            raise ValueError("rloo needs num_samples_per_step >= 2")
        others = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
        return (grouped - others).view(-1)
    raise ValueError(f"unknown group estimator {kind!r}")


@dataclass(frozen=True)
class AdvantageEstimator:
    """An ``algorithm.adv_estimator``: ``estimate(rewards, values, mask, gamma, lam, group_size, **options)`` ->
    ``(advantages, returns or None)``, all ``(B, T)``; ``needs_critic``: it reads ``values`` (a critic is
    built and trained on ``returns``); ``grouped``: it compares the samples of one prompt (needs
    ``num_samples_per_step`` >= 2); ``per_turn``: a multi-turn episode's environment rewards reach it at the
    end of each turn, else as one discounted outcome at the episode's end (``environment_rewards``)."""

    estimate: Callable[..., tuple[torch.Tensor, torch.Tensor | None]]
    needs_critic: bool = False
    grouped: bool = False
    per_turn: bool = False


def register_adv_estimator(name: str, estimator: AdvantageEstimator) -> AdvantageEstimator:
    """``algorithm.adv_estimator: name`` (the registry ``ADV_ESTIMATORS``, llm.settings.registry)."""
    return ADV_ESTIMATORS.add(name, estimator)


def _outcome_advantages(kind: str):
    """grpo / rloo: one outcome per sample (its score minus its summed KL), broadcast over its tokens."""

    def estimate(rewards, values, mask, gamma, lam, group_size, norm_by_std: bool = True, **options):
        return group_advantages(rewards.sum(1), group_size, kind, norm_by_std=norm_by_std)[:, None] * mask, None

    return estimate


register_adv_estimator(
    "gae",
    AdvantageEstimator(
        lambda r, v, m, gamma, lam, g, **options: gae(r, v, m, gamma, lam), needs_critic=True, per_turn=True
    ),
)
register_adv_estimator("grpo", AdvantageEstimator(_outcome_advantages("grpo"), grouped=True))
register_adv_estimator("rloo", AdvantageEstimator(_outcome_advantages("rloo"), grouped=True))
register_adv_estimator(
    "reinforce_plus_plus",
    AdvantageEstimator(lambda r, v, m, gamma, lam, g, **options: (discounted_returns(r, m, gamma), None)),
)


# --- PRIME (Cui et al. 2025): outcome and process rewards, each leave-one-out, summed --------------------------
def leave_one_out(rewards: torch.Tensor, mask: torch.Tensor, group_size: int) -> torch.Tensor:
    """verl's ``masked_rloo`` (recipe/prime/prime_core_algos.py): each sample's baseline value is the mean of its
    masked rewards ``m_j``; every masked reward of sample i in a group of n becomes ``r * n / (n - 1) - sum_j m_j /
    (n - 1)``, i.e. ``r - mean_{j != i} m_j + (r - m_i) / (n - 1)``. With one masked token per sample (an outcome)
    that is RLOO: ``o_i - mean_{j != i} o_j``. 0 off the mask."""
    if group_size < 2:
        raise ValueError("leave-one-out needs num_samples_per_step >= 2")
    n = group_size
    means = masked_sum(rewards, mask, 1) / mask.sum(1).clamp_min(1)
    total = means.view(-1, n).sum(1).repeat_interleave(n)
    return (rewards * n / (n - 1) - total[:, None] / (n - 1)) * mask


def prime_advantages(
    scores: torch.Tensor,
    process: torch.Tensor,
    mask: torch.Tensor,
    group_size: int,
    outcome_coef: float,
    process_coef: float,
) -> torch.Tensor:
    """PRIME's returns (verl's ``compute_rloo_advantage_return``): the outcome ``scores`` ``(B,)`` at each response's
    last token and the process rewards ``(B, T)`` at theirs, each through ``leave_one_out`` (the outcome's mask: the
    last token alone; the process rewards': every response token), weighted by ``outcome_coef`` /
    ``process_coef`` and summed, then summed from each token to the end: ``A_t = sum_{s >= t} r_s``. The trainer
    whitens them (``algorithm.whiten_advantages``, as verl does)."""
    last = torch.zeros_like(mask)
    last[torch.arange(len(mask)), last_tokens(mask)] = 1.0
    last = last * mask
    total = torch.zeros_like(mask)
    if outcome_coef:
        total = total + outcome_coef * leave_one_out(scores[:, None] * last, last, group_size)
    if process_coef:
        total = total + process_coef * leave_one_out(process, mask, group_size)
    return (total * mask).flip(-1).cumsum(-1).flip(-1) * mask


# --- losses (the policy objectives: objectives.py) ---------------------------------------------------
def truncated_is_weights(
    logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor, cap: float
) -> torch.Tensor:
    """Truncated importance sampling for the mismatch between the engine that sampled the tokens (its
    log-probs ``behaviour_logprobs``, mu) and the trainer's old policy (``logprobs``, pi_old, its own forward):
    per token ``min(pi_old / mu, cap)`` (Yao et al. 2025, "Your efficient RL framework secretly brings you
    off-policy RL training"; verl's rollout_is, TRL's vllm_importance_sampling_correction), 0 off the mask.
    The weights multiply the policy loss per token and carry no gradient."""
    return (logprobs - behaviour_logprobs).exp().clamp(max=cap).detach() * mask


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip_range: float | None,
    normaliser: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``0.5 * max((V - R)^2, (clip(V, V_old +- eps) - R)^2)`` per token, masked; returns (loss, clipfrac)."""
    loss1 = (values - returns).square()
    if clip_range is None:
        per_token, clipfrac = loss1, torch.zeros((), device=values.device)
    else:
        clipped = torch.clamp(values, old_values - clip_range, old_values + clip_range)
        loss2 = (clipped - returns).square()
        per_token = torch.maximum(loss1, loss2)
        clipfrac = masked_mean((loss2 > loss1).float(), mask)
    denom = mask.sum().clamp_min(1) if normaliser is None else normaliser
    return 0.5 * masked_sum(per_token, mask) / denom, clipfrac


class RunningMoments:
    """Running mean/std of scores for reward normalisation (Chan et al. parallel update)."""

    def __init__(self) -> None:
        self.mean, self.var, self.count = 0.0, 1.0, 1e-24

    def update(self, xs: torch.Tensor) -> None:
        xs = xs.double()
        n = xs.numel()
        batch_mean, batch_var = xs.mean().item(), xs.var(unbiased=False).item()
        delta = batch_mean - self.mean
        total = self.count + n
        self.mean += delta * n / total
        m2 = self.var * self.count + batch_var * n + delta**2 * self.count * n / total
        self.var, self.count = m2 / total, total

    @property
    def std(self) -> float:
        return math.sqrt(max(self.var, 1e-12))
