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


# the optional multi-turn fields of ``Samples``, each a list with one entry per sample (None: single-turn samples)
EPISODE_FIELDS = ("action_mask", "turn_ends", "turn_rewards", "episodes")


@dataclass
class Samples:
    """One rollout: token ids and texts per sample (``num_samples_per_step`` consecutive per prompt).

    A multi-turn episode's response is everything after the prompt: the model's turn 1, the tokens the loop
    appended (environment / tool messages, template tokens between turns), turn 2, ...; its first and last tokens
    are the model's. ``action_mask`` then holds one int per response token (1: sampled by the policy, trained;
    0: appended by the loop), ``turn_ends`` the index in ``response_ids`` of each model turn's last token
    (ascending), ``turn_rewards`` the environment's reward after each model turn (0.0 where it gave none; as
    long as ``turn_ends``), ``episodes`` a JSON-able record per sample for samples.jsonl (turns, cut, errors,
    env_seconds). All four are None for single-turn samples, which behave exactly as before they existed."""

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]  # up to and including EOS when one was generated
    prompts: list[str]
    responses: list[str]
    references: list[str | None]
    ended: torch.Tensor  # (B,) bool: the response ended with EOS
    action_mask: list[list[int]] | None = None
    turn_ends: list[list[int]] | None = None
    turn_rewards: list[list[float]] | None = None
    episodes: list[dict] | None = None

    def __post_init__(self) -> None:
        n = len(self.response_ids)
        for name in EPISODE_FIELDS:
            value = getattr(self, name)
            if value is not None and len(value) != n:
                raise ValueError(f"Samples.{name} has {len(value)} entries for {n} samples")
        for i, response in enumerate(self.response_ids):
            if self.action_mask is not None and len(self.action_mask[i]) != len(response):
                raise ValueError(
                    f"Samples.action_mask[{i}] has {len(self.action_mask[i])} entries for "
                    f"{len(response)} response tokens"
                )
            mask = None if self.action_mask is None else self.action_mask[i]
            if mask is not None and any(m not in (0, 1) for m in mask):
                raise ValueError(f"Samples.action_mask[{i}]: 1 (a model token) or 0 (appended by the loop) per token")
            ends = None if self.turn_ends is None else self.turn_ends[i]
            if ends and mask is not None and any(mask[e] != 1 for e in ends if 0 <= e < len(mask)):
                raise ValueError(f"Samples.turn_ends[{i}]={ends}: a turn ends on a model token (action_mask 1)")
            if ends is not None and (ends != sorted(ends) or any(not 0 <= e < len(response) for e in ends)):
                raise ValueError(f"Samples.turn_ends[{i}]={ends}: ascending indices of response tokens")
            if self.turn_rewards is not None and len(self.turn_rewards[i]) != len(ends or ()):
                raise ValueError(f"Samples.turn_rewards[{i}] needs one reward per turn_ends entry")

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def select(self, idx: list[int]) -> Samples:
        def pick(values):
            return None if values is None else [values[i] for i in idx]

        return Samples(
            pick(self.prompt_ids),
            pick(self.response_ids),
            pick(self.prompts),
            pick(self.responses),
            pick(self.references),
            self.ended[idx],
            *(pick(getattr(self, name)) for name in EPISODE_FIELDS),
        )

    @staticmethod
    def concat(parts: list[Samples]) -> Samples:
        """The samples of ``parts`` one after another (a multi-turn field must be set in all parts or in none)."""
        fields = {}
        for name in EPISODE_FIELDS:
            values = [getattr(p, name) for p in parts]
            if any(v is None for v in values) and not all(v is None for v in values):
                raise ValueError(f"Samples.concat: {name} is set in some parts only")
            fields[name] = None if values[0] is None else [x for v in values for x in v]
        lists = ("prompt_ids", "response_ids", "prompts", "responses", "references")
        return Samples(
            *([x for p in parts for x in getattr(p, name)] for name in lists),
            torch.cat([p.ended for p in parts]),
            **fields,
        )

    def response_mask(self) -> torch.Tensor:
        """``(B, T)`` float, 1.0 on the response tokens the policy is trained on: every response token of a
        single-turn sample; the model's tokens (``action_mask``) of a multi-turn one. Every loss, KL, entropy and
        value term, and the advantages, are masked with it."""
        T = max((len(r) for r in self.response_ids), default=0)
        if self.action_mask is not None:
            out = torch.zeros(len(self.response_ids), T)
            for i, m in enumerate(self.action_mask):
                out[i, : len(m)] = torch.tensor(m, dtype=torch.float32)
            return out
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
    # several rewards (rewards/combined.py): each one's (B,) reward, unweighted (its outcome score + its dense sum)
    components: dict[str, torch.Tensor] | None = None


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
    """Phase 2's record (``Scoring.score``, scoring.py): the samples with log-probs, values, KL and scores."""

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
    # (B, T) the environment's rewards of multi-turn samples (algorithm.turn_reward_tokens), else None
    env_rewards: torch.Tensor | None = None
    components: dict[str, torch.Tensor] | None = None  # several rewards: each one's (B,) (RewardOutput.components)


@dataclass
class Experience:
    """Phase 3's record (``PPOTrainer.advantages``): per-token rewards, advantages and returns."""

    scored: Scored
    rewards: torch.Tensor  # (B, T)
    advantages: torch.Tensor  # (B, T)
    returns: torch.Tensor | None  # (B, T), GAE only
