"""``reward.type: rule``: a Python function of the user's, ``reward.rule = "module:function"``, called as
``function(prompt, response, reference) -> float`` (ready-made ones: ``llm.alignment.ppo.rewards.rule_functions``)."""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from llm.alignment.ppo.interfaces import RewardOutput, RoleFailure, Samples
from llm.alignment.ppo.rewards.base import RewardFunction, check_score, register_reward
from llm.utils.errors import UserError

logger = logging.getLogger(__name__)

# modules of ready-made rules that moved: configs written with the old name keep working (and keep their fingerprint)
MOVED_MODULES = {"llm.alignment.ppo.rules": "llm.alignment.ppo.rewards.rule_functions"}

if TYPE_CHECKING:
    from llm.alignment.ppo.context import PPOContext
    from llm.alignment.ppo.loading import Place
    from llm.settings.ppo import PPOConfig


def import_function(spec: str, field: str) -> Callable:
    """The function ``spec`` (``'package.module:function'``) names, imported: the code of a user's config, which
    they trust. Anything wrong (no such module or function, the module failing as it loads) stops the run with
    one message naming ``field``."""
    module_name, _, fn_name = spec.partition(":")
    if not module_name or not fn_name:
        raise UserError(f"{field} {spec!r}: must be 'package.module:function'")
    if module_name in MOVED_MODULES:
        logger.info("%s %s: module %s is now %s", field, spec, module_name, MOVED_MODULES[module_name])
        module_name = MOVED_MODULES[module_name]
    try:
        fn = getattr(importlib.import_module(module_name), fn_name)
    except (ImportError, AttributeError, ValueError) as err:
        raise UserError(f"{field} {spec!r}: cannot import ({err}); use 'package.module:function'") from None
    except BaseException as err:  # noqa: BLE001 - the module's own code failed while it was imported
        raise UserError(f"{field} {spec!r}: importing {module_name} raised {type(err).__name__}: {err}") from None
    if not callable(fn):
        raise UserError(f"{field} {spec!r}: {fn_name} is not a function")
    return fn


@register_reward("rule")
class RuleReward(RewardFunction):
    """``module:function(prompt, response, reference) -> float``. The module is imported and the function
    run in this process: a rule is code the user trusts. Anything it raises (``SystemExit`` and
    ``KeyboardInterrupt`` included) stops the run with a message naming the function and the sample."""

    def __init__(self, spec: str) -> None:
        self.fn = import_function(spec, "reward.rule")
        self.spec = spec

    @classmethod
    def from_config(cls, c: PPOConfig, place: Place, run: PPOContext) -> RuleReward:
        return cls(c.reward.rule)

    def score(self, samples: Samples) -> RewardOutput:
        out = []
        for i in range(len(samples)):
            try:
                value = self.fn(samples.prompts[i], samples.responses[i], samples.references[i])
            except BaseException as err:  # noqa: BLE001 - any user-code failure (SystemExit too) stops the run here
                raise RoleFailure(
                    f"reward.rule {self.spec} raised {type(err).__name__}: {err} on sample {i} "
                    f"(prompt {samples.prompts[i][:80]!r}, response {samples.responses[i][:80]!r}); the run stops: "
                    "fix the function"
                ) from None
            out.append(check_score(value, f"reward.rule {self.spec} on sample {i}"))
        return RewardOutput(torch.tensor(out))
