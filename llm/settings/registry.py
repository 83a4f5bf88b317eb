"""Registries of the variants a config chooses by name: advantage estimators, KL estimators and controllers,
reward types, PRM score aggregations, DPO losses, tool-call formats, step scorers (the kinds of process reward
model the search reads).

A registry is declared here, on the schema's side, and filled by the module that implements its variants
(``provider``), which adds each one on import (``llm.alignment.ppo.algorithm`` adds ``gae``, ``grpo``, ...).
Validation and construction read the same registry: validation checks a name and reads an entry's facts
(``needs_critic``, ``grouped``, ``needs_reference``, ...), construction calls the entry. The schema never
imports implementation code: the first lookup imports ``provider`` by name (as a plug-in is loaded), so a
config is checked against every built-in variant whoever imported what first. A variant of your own: add it
to the registry in a module you import before the run starts (``ADV_ESTIMATORS.add("mine", ...)``).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any

from llm.utils.errors import UserError, closest


class Registry(dict):
    """Name -> entry for one config field (``what``), its built-ins added by importing ``provider``; ``default``: the
    name the field takes when a config does not set it (the schema's default reads it from here)."""

    def __init__(self, what: str, provider: str, sort_names: bool = False, default: str | None = None) -> None:
        super().__init__()
        self.what, self.provider, self.sort_names, self.default = what, provider, sort_names, default
        self.loaded = False

    def load(self) -> None:
        """Import the provider once, so its built-in variants are registered."""
        if not self.loaded:
            self.loaded = True
            importlib.import_module(self.provider)

    def add(self, name: str, entry: Any) -> Any:
        """Register ``entry`` as ``name``; a name registered twice is a programming error."""
        if dict.__contains__(self, name):
            raise ValueError(f"{self.what} {name!r} is registered twice")
        dict.__setitem__(self, name, entry)
        return entry

    def remove(self, name: str) -> None:
        """Forget ``name`` (a test's own variant, say); a name not registered is ignored."""
        dict.pop(self, name, None)

    def lookup(self, name: Any, where: str = "") -> Any:
        """The entry of ``name``; an unknown name stops the run with the valid ones and the closest."""
        self.load()
        if not dict.__contains__(self, name):
            valid = sorted(dict.__iter__(self)) if self.sort_names else list(dict.__iter__(self))
            raise UserError(
                f"{where}{self.what} must be one of {', '.join(valid)}, got {name!r} "
                f"(closest: {closest(str(name), valid)})"
            )
        return dict.__getitem__(self, name)

    def names(self) -> tuple[str, ...]:
        self.load()
        return tuple(dict.__iter__(self))

    # dict reads see the built-ins too
    def __getitem__(self, name: str) -> Any:
        self.load()
        return dict.__getitem__(self, name)

    def __contains__(self, name: object) -> bool:
        self.load()
        return dict.__contains__(self, name)

    def __iter__(self) -> Iterator[str]:
        self.load()
        return dict.__iter__(self)

    def __len__(self) -> int:
        self.load()
        return dict.__len__(self)

    def get(self, name: str, default: Any = None) -> Any:
        self.load()
        return dict.get(self, name, default)

    def keys(self):
        self.load()
        return dict.keys(self)

    def values(self):
        self.load()
        return dict.values(self)

    def items(self):
        self.load()
        return dict.items(self)

    def __repr__(self) -> str:
        return f"Registry({self.what!r}: {', '.join(dict.__iter__(self))})"


PPO_ALGORITHM = "llm.alignment.ppo.algorithm"
PPO_REWARDS = "llm.alignment.ppo.rewards"

ADV_ESTIMATORS = Registry("algorithm.adv_estimator", PPO_ALGORITHM)  # name -> AdvantageEstimator
KL_ESTIMATORS = Registry("algorithm.kl_penalty", PPO_ALGORITHM)  # name -> f(log p - log q) per token
KL_CONTROLLERS = Registry("algorithm.kl_ctrl.type", PPO_ALGORITHM)  # name -> f(kl_ctrl section) -> controller
REWARD_TYPES = Registry("reward.type", PPO_REWARDS, sort_names=True)  # name -> RewardType
PRM_AGGREGATIONS = Registry("reward.prm_aggregation", PPO_REWARDS)  # name -> f(step scores) or None (dense)
PPO_OBJECTIVES = "llm.alignment.ppo.objectives"
POLICY_LOSSES = Registry("actor_rollout.policy_loss", PPO_OBJECTIVES, default="vanilla")  # name -> PolicyObjective
LOSS_AGG_MODES = Registry("actor_rollout.loss_agg_mode", PPO_OBJECTIVES, default="token-mean")  # name -> aggregation
DPO_LOSSES = Registry("loss_type", "llm.alignment.dpo.loss")  # name -> LossSpec
TOOL_CALL_FORMATS = Registry(
    "environment.tool_call_format", "llm.alignment.ppo.agent.parsers"
)  # name -> ToolCallFormat
# name -> StepScorer class (``from_settings``)
# (llm.alignment.rm.scorers imports every module that registers one: scoring.py, generative.py, implicit.py)
STEP_SCORERS = Registry("prm.kind", "llm.alignment.rm.scorers", default="discriminative")

# algorithm.kl_penalty also takes "full": the exact KL over the vocabulary (not a per-token estimator)
EXACT_KL = "full"


def reward_type(name: str, where: str = "") -> Any:
    """The registered reward type ``name`` (``RewardType``: ``needs``, ``has_model``, ``value_head``, ``build``)."""
    return REWARD_TYPES.lookup(name, where)


def model_types() -> list[str]:
    """The registered reward types that hold a reward model."""
    return sorted(name for name, kind in REWARD_TYPES.items() if kind.has_model)


def kl_kinds() -> tuple[str, ...]:
    """Every ``algorithm.kl_penalty``: the registered estimators and ``full`` (the exact KL)."""
    return (*KL_ESTIMATORS.names(), EXACT_KL)
