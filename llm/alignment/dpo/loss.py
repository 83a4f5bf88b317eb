"""Preference-optimisation losses as pure functions of per-pair sequence log-probabilities.

Every function returns a *per-pair* loss ``(P,)``; the trainer sums and divides by the global pair
count. Notation: ``pi_c`` = sum over the chosen answer tokens of ``log pi(y_t | x, y_<t)``, ``|y_c|``
its token count, ``ref_c`` the same under the frozen reference; likewise ``_r`` for rejected.

Per-pair losses (D: log-ratio margin on sums, M: margin of per-token means)::

    sigmoid  -(1-e) log s(b D) - e log s(-b D)       D = (pi_c - ref_c) - (pi_r - ref_r)
    hinge    max(0, 1 - b D)
    ipo      (M - 1 / (2 b))^2                      M = (pi_c - ref_c) / |y_c| - (pi_r - ref_r) / |y_r|
    simpo    -(1-e) log s(b M - g) - e log s(g - b M)   with ref = 0
    orpo     -b log s(log odds_c - log odds_r)      odds = p / (1 - p), p = exp(pi / |y|);
             plus ORPO's NLL term, which the trainer adds

``s`` is the logistic sigmoid, ``b`` = ``beta``, ``e`` = ``label_smoothing``, ``g`` = ``simpo_gamma``.
Reference-free mode replaces the reference log-probs by 0. The conventions (sums or per-token means,
IPO's length normalisation) are those of TRL 1.12: ``DPOTrainer`` for sigmoid/hinge/ipo,
``CPOTrainer(loss_type="simpo")`` for simpo and ``ORPOTrainer`` for orpo. Inputs are fp32 whatever the
models' precision (``readout_log_probs`` upcasts the logits before the log-softmax): fp32 math throughout.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from llm.settings.registry import DPO_LOSSES


class PairLogProbs(NamedTuple):
    """Per-pair sequence log-probabilities of the answers, all ``(P,)``."""

    chosen: torch.Tensor  # sum of the chosen answer's token log-probs
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor  # answer lengths (float)
    rejected_tokens: torch.Tensor


class PreferenceOutputs(NamedTuple):
    """Per-pair loss and what TRL logs about each pair, all ``(P,)``."""

    loss: torch.Tensor
    chosen_rewards: torch.Tensor  # implicit rewards (metrics only, detached)
    rejected_rewards: torch.Tensor
    chosen_logps: torch.Tensor  # the sequence log-prob the loss uses: sum, or mean per token (detached)
    rejected_logps: torch.Tensor


def sigmoid_loss(margin: torch.Tensor, beta: float, label_smoothing: float = 0.0) -> torch.Tensor:
    """DPO (Rafailov et al. 2023, Eq. 7) with conservative label smoothing (cDPO, Mitchell 2023).

    ``margin`` = D, the difference of the chosen and rejected log-ratios to the reference.
    """
    loss = -F.logsigmoid(beta * margin)
    if label_smoothing:
        loss = (1 - label_smoothing) * loss - label_smoothing * F.logsigmoid(-beta * margin)
    return loss


def hinge_loss(margin: torch.Tensor, beta: float) -> torch.Tensor:
    """SLiC-HF hinge (Zhao et al. 2023, Eq. 1 with the DPO log-ratio margin): ``relu(1 - beta * D)``."""
    return torch.relu(1 - beta * margin)


def ipo_loss(mean_margin: torch.Tensor, beta: float) -> torch.Tensor:
    """IPO (Azar et al. 2023, Eq. 17) on per-token mean log-ratios: ``(D' - 1 / (2 beta))^2``, beta = tau."""
    return (mean_margin - 1 / (2 * beta)) ** 2


def simpo_loss(mean_margin: torch.Tensor, beta: float, gamma: float, label_smoothing: float = 0.0) -> torch.Tensor:
    """SimPO (Meng et al. 2024, Eq. 6): reference-free, length-normalised, target margin ``gamma``."""
    logits = beta * mean_margin - gamma
    return -(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, stable on both sides of ``-log 2`` (Maechler 2012)."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def orpo_odds_ratio_loss(mean_chosen: torch.Tensor, mean_rejected: torch.Tensor, beta: float) -> torch.Tensor:
    """ORPO's odds-ratio term (Hong et al. 2024, Eqs. 4-7): ``-beta * log sigmoid(log OR)``.

    With ``p = exp(mean log-prob)``, ``log odds(y) = log p - log(1 - p)``; ``beta`` is the paper's lambda.
    The full ORPO loss adds the NLL of the chosen sequence (the trainer does, see ``DPOTrainer``).
    """
    log_odds = (mean_chosen - mean_rejected) - (log1mexp(mean_chosen) - log1mexp(mean_rejected))
    return -beta * F.logsigmoid(log_odds)


def _margin(policy: PairLogProbs, reference: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return (policy.chosen - reference[0]) - (policy.rejected - reference[1])


def _means(policy: PairLogProbs, reference: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token mean log-ratios of the chosen and rejected answers (mean log-probs with a zero reference)."""
    chosen = (policy.chosen - reference[0]) / policy.chosen_tokens
    rejected = (policy.rejected - reference[1]) / policy.rejected_tokens
    return chosen, rejected


def _mean_margin(policy: PairLogProbs, reference: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    chosen, rejected = _means(policy, reference)
    return chosen - rejected


@dataclass(frozen=True)
class LossSpec:
    """A ``loss_type``: its per-pair loss and the properties validation, data building and the trainer read.

    ``loss(policy, reference, beta, label_smoothing, simpo_gamma)`` -> ``(P,)``; ``needs_reference``: the
    loss compares to a frozen reference (else reference-free by design); ``length_normalised``: sequence
    log-probs are per-token means (logps and rewards too); ``label_smoothing``: takes ``label_smoothing``;
    ``nll_term``: the loss includes an NLL term over prompt + chosen (ORPO), so the prompt tokens are targets
    and ``sft_loss_weight`` would count it twice.
    """

    loss: Callable[..., torch.Tensor]
    needs_reference: bool
    length_normalised: bool = False
    label_smoothing: bool = False
    nll_term: bool = False


LOSSES = DPO_LOSSES  # name -> LossSpec (llm.settings.registry, read by validation too)


def register_loss(name: str, spec: LossSpec) -> LossSpec:
    """Add a ``loss_type``: validation (``DPOTrainingArguments``), data building and the trainer read it."""
    return LOSSES.add(name, spec)


def loss_spec(loss_type: str) -> LossSpec:
    """The registered spec of ``loss_type``; an unknown name is refused with the valid ones."""
    return LOSSES.lookup(loss_type)


register_loss(
    "sigmoid",
    LossSpec(lambda pol, ref, beta, ls, gamma: sigmoid_loss(_margin(pol, ref), beta, ls), True, label_smoothing=True),
)
register_loss("hinge", LossSpec(lambda pol, ref, beta, ls, gamma: hinge_loss(_margin(pol, ref), beta), True))
register_loss("ipo", LossSpec(lambda pol, ref, beta, ls, gamma: ipo_loss(_mean_margin(pol, ref), beta), True))
register_loss(
    "simpo",
    LossSpec(
        lambda pol, ref, beta, ls, gamma: simpo_loss(_mean_margin(pol, ref), beta, gamma, ls),
        needs_reference=False,
        length_normalised=True,
        label_smoothing=True,
    ),
)
register_loss(
    "orpo",
    LossSpec(
        lambda pol, ref, beta, ls, gamma: orpo_odds_ratio_loss(*_means(pol, ref), beta),
        needs_reference=False,
        length_normalised=True,
        nll_term=True,
    ),
)


def preference_loss(
    loss_type: str,
    policy: PairLogProbs,
    reference: tuple[torch.Tensor, torch.Tensor] | None,
    beta: float,
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.0,
) -> PreferenceOutputs:
    """Per-pair loss of ``loss_type`` and TRL's per-pair metrics.

    ``reference`` = (ref_c, ref_r) summed reference log-probs, None = reference-free (zeros; always
    for simpo and orpo). Rewards are ``beta * (pi - ref)`` on sums, or ``beta * mean`` for the
    length-normalised losses, as TRL logs them.
    """
    spec = loss_spec(loss_type)
    if reference is None or not spec.needs_reference:
        zero = torch.zeros_like(policy.chosen)
        reference = (zero, zero)
    loss = spec.loss(policy, reference, beta, label_smoothing, simpo_gamma)
    if spec.length_normalised:
        chosen, rejected = (x.detach() for x in _means(policy, reference))
        return PreferenceOutputs(loss, beta * chosen, beta * rejected, chosen, rejected)
    chosen, rejected = policy.chosen.detach(), policy.rejected.detach()
    rewards = beta * (chosen - reference[0]), beta * (rejected - reference[1])
    return PreferenceOutputs(loss, *rewards, chosen, rejected)


def mean_nll(log_prob_sum: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Per-sequence mean negative log-likelihood ``-sum log p / tokens``: ``(P,)`` -> ``(P,)``.

    The SFT term on the chosen answer (``sft_loss_weight``; RPO, Pang et al. 2024, Eq. 2 normalises by
    ``|y_c|`` the same way) and ORPO's NLL term.
    """
    return -log_prob_sum / tokens
