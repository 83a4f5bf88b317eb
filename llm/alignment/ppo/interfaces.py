"""What the PPO roles take and return, and the interfaces the trainer calls them through.

Arguments and results are plain records and tensors (``Samples``, ``PolicyBatch``, ``ValueBatch``,
``UpdateStats``, ``RewardOutput``): token tensors are ``(B, T)``, right-padded over response tokens, on
the CPU. So a role lives in this process (roles.py, rewards/) or in Ray actors (ray_roles.py's
``RemoteRole``, a proxy with the same methods) without the trainer knowing which: the trainer types its
roles with the protocols below, which both satisfy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from llm.utils.errors import UserError


class RoleFailure(UserError):
    """A role stopped answering: its process died, or a call ran past its timeout. Names the role."""


@dataclass
class Samples:
    """One rollout: token ids and texts per sample (``num_samples_per_step`` consecutive per prompt)."""

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]  # up to and including EOS when one was generated
    prompts: list[str]
    responses: list[str]
    references: list[str | None]
    ended: torch.Tensor  # (B,) bool: the response ended with EOS

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def select(self, idx: list[int]) -> Samples:
        return Samples(
            [self.prompt_ids[i] for i in idx],
            [self.response_ids[i] for i in idx],
            [self.prompts[i] for i in idx],
            [self.responses[i] for i in idx],
            [self.references[i] for i in idx],
            self.ended[idx],
        )

    def response_mask(self) -> torch.Tensor:
        T = max((len(r) for r in self.response_ids), default=0)
        lengths = torch.tensor([len(r) for r in self.response_ids])
        return (torch.arange(T)[None, :] < lengths[:, None]).float()


@dataclass
class PolicyBatch:
    """What the actor's update needs of one scored rollout; token tensors ``(B, T)`` on the CPU."""

    samples: Samples
    mask: torch.Tensor
    # the actor's log-probs at rollout time; None: an on-policy update (one optimizer step over the whole batch),
    # whose old log-probs are its own forward's, detached (``PPOConfig.on_policy_update``)
    old_logprobs: torch.Tensor | None
    advantages: torch.Tensor
    ref_logprobs: torch.Tensor | None  # for the KL loss term
    is_weights: torch.Tensor | None = None  # truncated importance weights per token (rollout_is_cap), else 1


@dataclass
class ValueBatch:
    """What the critic's update needs of one scored rollout; token tensors ``(B, T)`` on the CPU."""

    samples: Samples
    mask: torch.Tensor
    old_values: torch.Tensor  # the critic's values at rollout time (value clipping)
    returns: torch.Tensor


@dataclass
class UpdateStats:
    """One role's update over a rollout: metric means over its optimizer steps, and each step's loss."""

    metrics: dict[str, float]
    losses: list[tuple[int, float]]  # (epoch, loss) per mini-batch, in order
    logprobs: torch.Tensor | None = None  # (B, T) the actor's log-probs before an on-policy update, else None


@dataclass
class RewardOutput:
    scores: torch.Tensor  # (B,) outcome score added at the last response token
    dense: torch.Tensor | None = None  # (B, T) extra per-token rewards (PRM steps), or None


# --- the role interfaces (structural: a role class or its Ray proxy) ------------------------------------
class Policy(Protocol):
    """Reference or rollout copy: sampling and per-token log-probs."""

    def generate(self, prompt_ids: list[list[int]], **settings: Any) -> Any: ...

    def log_probs(self, samples: Samples, with_hidden: bool = False, ref_hidden: torch.Tensor | None = None) -> Any: ...

    def lm_head(self, on_cpu: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, float]: ...

    def take_reference_head(self, head: tuple[torch.Tensor, torch.Tensor | None, float]) -> None: ...

    def load_weights(self, state: dict[str, torch.Tensor]) -> None: ...

    def sync_from(self, source: Actor) -> None: ...


class Trained(Protocol):
    """A role with an optimizer: mini-batch epochs over one rollout, and checkpoints."""

    def update(self, batch: Any, orders: list[list[int]]) -> UpdateStats: ...

    def save(self, directory: str, with_optimizer: bool) -> None: ...

    def load(self, directory: str) -> None: ...


class Actor(Policy, Trained, Protocol):
    """The trained policy; ``weights`` are its full weights for a rollout copy."""

    def weights(self) -> dict[str, torch.Tensor]: ...


class Critic(Trained, Protocol):
    def values(self, samples: Samples) -> torch.Tensor: ...


class Reward(Protocol):
    """ORM, PRM, rule, HTTP, or any registered type (rewards/)."""

    def score(self, samples: Samples) -> RewardOutput: ...


@dataclass
class Scored:
    """Phase 2's record (``PPOTrainer.score``): the samples with log-probs, values, KL and scores."""

    samples: Samples
    mask: torch.Tensor  # (B, T)
    logprobs: torch.Tensor | None  # (B, T) actor, at rollout time (an on-policy update fills it in)
    ref_logprobs: torch.Tensor | None
    values: torch.Tensor | None  # (B, T) critic
    kl: torch.Tensor  # (B, T) per-token KL estimate (0 without a reference)
    scores: torch.Tensor  # (B,) after penalty / normalisation / clipping
    raw_scores: torch.Tensor  # (B,) as the reward function returned them
    dense: torch.Tensor | None  # (B, T) PRM step rewards
    is_weights: torch.Tensor | None = None  # (B, T) truncated importance weights (rollout_is_cap)


@dataclass
class Experience:
    """Phase 3's record (``PPOTrainer.advantages``): per-token rewards, advantages and returns."""

    scored: Scored
    rewards: torch.Tensor  # (B, T)
    advantages: torch.Tensor  # (B, T)
    returns: torch.Tensor | None  # (B, T), GAE only
