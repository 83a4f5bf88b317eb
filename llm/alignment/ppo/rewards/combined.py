"""Several rewards in one run (``reward`` as a list: ``llm.settings.reward_list``), weighted and summed.

``build_rewards`` builds each entry with its type's ``from_config`` on a copy of the config holding that entry as
``reward`` (and its tokenizer as the context's ``reward_tokenizer``): every model is loaded once, on the reward role's
place; a list's models share that role's process and device. ``WeightedRewards.score`` calls each in turn and
returns their weighted sum in the one ``RewardOutput`` the trainer reads:

- ``scores`` (B,): ``sum(weight_i x scores_i)``, the outcome placed at the last response token (a multi-turn
  episode's last model token) as one reward's is;
- ``dense`` (B, T): ``sum(weight_i x dense_i)`` over the rewards that have one (a PRM with ``prm_aggregation:
  dense``), each step's reward at the token where one PRM puts it; None when none has one;
- ``components``: each reward's own (B,) value, unweighted (its outcome score plus the sum of its dense rewards),
  for the metrics (``reward/<name>/mean``) and ``samples.jsonl``.

One section (the plain ``reward`` object) with weight 1 is built as before, without this wrapper.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from llm.alignment.ppo.interfaces import RewardOutput, Samples
from llm.alignment.ppo.rewards.base import RewardFunction
from llm.settings.registry import reward_type
from llm.settings.reward_list import reward_names
from llm.utils.errors import UserError

if TYPE_CHECKING:
    from llm.alignment.ppo.context import PPOContext
    from llm.alignment.ppo.loading import Place
    from llm.settings.ppo import PPOConfig


class WeightedRewards(RewardFunction):
    """``parts``: ``(name, weight, reward)``; ``score`` is their weighted sum (the module docstring)."""

    def __init__(self, parts: list[tuple[str, float, RewardFunction]]) -> None:
        self.parts = parts

    @property
    def samples_seen(self) -> int:  # the model rewards' forwards, all of them
        return sum(reward.samples_seen for _, _, reward in self.parts)

    def score(self, samples: Samples) -> RewardOutput:
        total = torch.zeros(len(samples))
        dense: torch.Tensor | None = None
        components = {}
        for name, weight, reward in self.parts:
            out = reward.score(samples)
            scores = out.scores.float()
            total = total + weight * scores
            if out.dense is not None:
                dense = weight * out.dense.float() if dense is None else dense + weight * out.dense.float()
                scores = scores + out.dense.float().sum(1)
            components[name] = scores
        return RewardOutput(total, dense, components)


def build_rewards(c: PPOConfig, place: Place, run: PPOContext) -> RewardFunction:
    """The run's reward: the one ``reward`` section's type (as always), or the weighted sum of a list's."""
    if not c.extra_rewards and c.reward.weight == 1:
        return reward_type(c.reward.type).build(c, place, run)
    parts = []
    for i, (name, r) in enumerate(zip(reward_names(c), c.rewards)):
        one = dataclasses.replace(c, reward=r, extra_rewards=())
        try:
            built = reward_type(r.type).build(one, place, run.for_reward(i, one))
        except UserError as err:  # its messages name reward.FIELD: say which entry of the list
            raise UserError(f"reward[{i}] ({name}): {err}") from None
        parts.append((name, float(r.weight), built))
    return WeightedRewards(parts)
