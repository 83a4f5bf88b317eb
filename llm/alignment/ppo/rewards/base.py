"""What every reward is, and the registry of reward types that both the config check (``reward.type``,
``llm.settings.ppo_validation``) and the builder (build.py) read.

A reward type is one class with ``score(samples) -> RewardOutput`` and a ``from_config(config, place, run)``
constructor (``run``: the run's ``PPOContext``, with the tokenizers loaded once), registered with ``@register_reward(name, ...)``: the config then accepts ``reward.type:
name``, requires the ``needs`` fields of ``reward``, refuses ``reward.dtype`` / ``reward.offload`` unless
``has_model``, and the builder calls ``from_config``. The module that registers it must be imported
before the config is parsed: the built-in types register when ``llm.alignment.ppo.rewards`` is imported.
A Ray worker builds its reward in its own process, so it knows only the types that the modules it imports
register: put a type meant for Ray runs in a module this package imports (as the built-ins are).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from llm.alignment.ppo.interfaces import RewardOutput, Samples
from llm.settings.registry import REWARD_TYPES
from llm.utils.errors import UserError

if TYPE_CHECKING:
    from llm.alignment.ppo.context import PPOContext
    from llm.alignment.ppo.loading import Place
    from llm.settings.ppo import PPOConfig


class RewardFunction:
    """A reward: ``score(samples) -> RewardOutput`` (``(B,)`` outcome scores, optional ``(B, T)`` dense)."""

    samples_seen = 0  # model rewards: samples this process ran forwards over (as PolicyModel.samples_seen)

    @classmethod
    def from_config(cls, c: PPOConfig, place: Place, run: PPOContext) -> RewardFunction:
        """The reward ``c.reward`` asks for, its models (if any) on ``place``; a model's tokenizer is
        ``run.reward_tokenizer``, the actor's ``run.tokenizer`` (never loaded again)."""
        raise NotImplementedError

    def score(self, samples: Samples) -> RewardOutput:
        raise NotImplementedError


@dataclass(frozen=True)
class RewardType:
    name: str
    cls: type[RewardFunction]
    needs: tuple[str, ...] = ()  # reward.<field>s that must be set for this type
    has_model: bool = False  # a reward model: reward.dtype / reward.offload apply
    value_head: bool = False  # its model has a scalar head at every token: the critic may start from it

    def build(self, c: PPOConfig, place: Place, run: PPOContext) -> RewardFunction:
        return self.cls.from_config(c, place, run)


REWARDS = REWARD_TYPES  # name -> RewardType (llm.settings.registry, read by validation too)


def register_reward(
    name: str, *, needs: tuple[str, ...] = (), has_model: bool = False, value_head: bool = False
) -> Callable[[type[RewardFunction]], type[RewardFunction]]:
    """Class decorator: ``reward.type: name`` builds this class (``from_config``); see the module docstring."""

    def register(cls: type[RewardFunction]) -> type[RewardFunction]:
        known = dict.get(REWARDS, name)  # not REWARDS.get: that would load the built-ins while they register
        if known is not None and known.cls is not cls:
            raise ValueError(f"reward type {name!r} is registered already ({known.cls.__qualname__})")
        dict.__setitem__(REWARDS, name, RewardType(name, cls, tuple(needs), has_model, value_head))
        return cls

    return register


# Rewards are float32 tensors from here on: a Python float beyond this (1e39) is finite but becomes inf there,
# and one inf makes the step's loss and then every weight NaN.
FLOAT32_MAX = 3.4028234663852886e38


def check_score(value, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise UserError(
            f"{where} returned {value!r}; a reward must be a finite number (a bad sample is never "
            "silently turned into a zero reward)"
        )
    if abs(value) > FLOAT32_MAX:
        raise UserError(
            f"{where} returned {value!r}; a reward must be a finite float32 number (|r| <= 3.4e38: rewards are "
            "float32 tensors, where this one would be infinite and turn the loss and the weights into NaN)"
        )
    return float(value)
