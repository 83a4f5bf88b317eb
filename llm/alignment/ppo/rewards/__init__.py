"""PPO's rewards, one module per kind, each type registered by name (``REWARDS``: the registry ``REWARD_TYPES`` of llm/settings/registry.py), which the
config check and the builder both read:

- ``rule`` (rule.py): a Python function ``module:function(prompt, response, reference)``;
- ``http`` (http.py): a scoring server;
- ``orm`` / ``prm`` (model.py): a trained outcome / process reward model;
- ``implicit_prm`` (implicit.py): a trained implicit PRM, dense per-token or per-step rewards.
- several of them, weighted and summed (combined.py: ``reward`` as a list).
- ``generative_prm`` (generative.py): a generative PRM (a critique, then a verdict, per step).

Adding a type: a ``RewardFunction`` subclass with ``from_config`` and ``score``, decorated with
``@register_reward("name", needs=..., has_model=...)``, in a module imported here.
"""

from llm.alignment.ppo.rewards.base import (
    REWARDS,
    RewardFunction,
    RewardType,
    check_score,
    register_reward,
)
from llm.alignment.ppo.rewards.combined import WeightedRewards, build_rewards
from llm.alignment.ppo.rewards.generative import GenerativePRMReward
from llm.alignment.ppo.rewards.http import HttpReward
from llm.alignment.ppo.rewards.implicit import ImplicitPRMReward
from llm.alignment.ppo.rewards.model import (
    ORMReward,
    PRMReward,
    char_to_token_end,
    decoded_lengths,
    retokenise,
    same_vocabulary,
    split_steps,
)
from llm.alignment.ppo.rewards.rule import RuleReward
from llm.settings.registry import PRM_AGGREGATIONS, model_types, reward_type
from llm.settings.shared import check_reward_url

__all__ = [
    "PRM_AGGREGATIONS",
    "REWARDS",
    "GenerativePRMReward",
    "HttpReward",
    "ImplicitPRMReward",
    "ORMReward",
    "PRMReward",
    "RewardFunction",
    "RewardType",
    "RuleReward",
    "WeightedRewards",
    "build_rewards",
    "char_to_token_end",
    "check_reward_url",
    "check_score",
    "decoded_lengths",
    "model_types",
    "register_reward",
    "retokenise",
    "reward_type",
    "same_vocabulary",
    "split_steps",
]
