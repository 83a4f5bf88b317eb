"""PPO's ``reward`` as a list: several rewards in one run, each one of the registered types (rule, orm, prm, http),
weighted and summed (TRL's ``reward_funcs`` + ``reward_weights``).

``reward`` is one section (as it always was) or a list of sections; each section has a ``weight`` (default 1) and a
``name`` (default: the rule's function name, else the type; ``_<index>`` is appended to a derived name another
entry also has). The run's reward is ``sum(weight_i x reward_i)``: the outcome scores summed with their weights at
the last response token, the dense (PRM step) rewards summed with their weights at their tokens, exactly where one
reward of that kind puts them. What shapes the reward (``normalize_reward``, ``reward_clip``, DAPO's
``overlong_buffer_len`` / ``overlong_penalty_factor``, ``algorithm.missing_eos_penalty``) acts on the total, as TRL
normalises the weighted sum: in a list they are the first entry's, and another entry setting them is refused.

The config holds the first entry as ``PPOConfig.reward`` and the others as ``PPOConfig.extra_rewards``
(``PPOConfig.rewards``: all of them), so a one-element list is the same run as one section, with the same
fingerprint. ``build_reward_list`` reads the list (``llm.settings.load``), ``validate_rewards`` checks every entry
(``llm.settings.ppo_validation``), ``reward_names`` gives the names the metrics use.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from llm.settings import fields
from llm.settings.ppo import PPOConfig, RewardSection
from llm.settings.registry import PRM_AGGREGATIONS, model_types, reward_type
from llm.utils.errors import UserError

# fields that shape the total reward, not one component: set in the first entry of a list only
TOTAL_FIELDS = ("normalize_reward", "reward_clip", "overlong_buffer_len", "overlong_penalty_factor")
_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def build_reward_list(entries: Any, path: str) -> list[RewardSection]:
    """The sections of ``reward: [...]`` as the file gives them, each type-checked (messages name ``reward[i]``)."""
    if not isinstance(entries, list) or not entries:
        raise UserError(
            f"{path}: reward is an empty list; give one reward section (an object) or a list of at least one, "
            'e.g. [{"type": "rule", "weight": 0.5}, {"type": "orm", "model_name_or_path": "...", "weight": 0.5}]'
        )
    for i, entry in enumerate(entries):
        if not isinstance(entry, Mapping):
            raise UserError(
                f"{path}: reward[{i}] must be an object of field: value pairs (one reward section), got {entry!r}"
            )
    return [fields.build(RewardSection, entry, path, section=f"reward[{i}]") for i, entry in enumerate(entries)]


def labels(c: PPOConfig) -> list[str]:
    """How messages name each reward section: ``reward`` for one, ``reward[i]`` in a list."""
    return ["reward"] if not c.extra_rewards else [f"reward[{i}]" for i in range(len(c.rewards))]


def check_reward_section(r: RewardSection, label: str, path: str) -> None:
    """One section: its type (the registry), the fields the type needs, what applies to a model only, the weight."""
    kind = reward_type(r.type, f"{path}: " + (f"{label}.type: " if "[" in label else ""))  # lists the valid ones
    if r.prm_aggregation not in PRM_AGGREGATIONS:
        *most, last = PRM_AGGREGATIONS
        raise UserError(f"{path}: {label}.prm_aggregation must be {', '.join(most)} or {last}")
    for need in kind.needs:
        if not getattr(r, need):
            raise UserError(f"{path}: {label}.type={r.type!r} needs {label}.{need}")
    if r.implicit_granularity not in ("token", "step"):
        raise UserError(f"{path}: {label}.implicit_granularity must be token or step, got {r.implicit_granularity!r}")
    if r.implicit_granularity != "token" and r.type != "implicit_prm":
        raise UserError(f"{path}: {label}.implicit_granularity is reward.type implicit_prm's: remove it")
    if r.timeout <= 0:
        raise UserError(f"{path}: {label}.timeout must be > 0, got {r.timeout}")
    if not kind.has_model:
        for name, value, default in (("dtype", r.dtype, None), ("offload", r.offload, False)):
            if value != default:
                raise UserError(
                    f"{path}: {label}.{name} applies to a reward model (type {' or '.join(model_types())}); "
                    f"{label}.type is {r.type!r}, which has none"
                )
    if isinstance(r.weight, bool) or not math.isfinite(r.weight) or r.weight <= 0:
        raise UserError(
            f"{path}: {label}.weight must be a finite number > 0 (its share of the total reward), got {r.weight!r}; "
            "leave a reward out of the list rather than giving it weight 0"
        )


def validate_rewards(c: PPOConfig, path: str) -> None:
    """Every reward section (``check_reward_section``); in a list also the names, the total-reward fields and the
    placement of the reward models."""
    for r, label in zip(c.rewards, labels(c)):
        check_reward_section(r, label, path)
    if not c.extra_rewards:
        if c.reward.name is not None:
            _check_name(c.reward.name, "reward", path)
        return
    for i, r in enumerate(c.extra_rewards, 1):
        for name in TOTAL_FIELDS:
            if getattr(r, name) != getattr(RewardSection, name):
                raise UserError(
                    f"{path}: reward[{i}].{name}: it shapes the total reward (the weighted sum), not one entry: set "
                    f"it in reward[0] and remove it here"
                )
    seen: dict[str, int] = {}
    for i, r in enumerate(c.rewards):
        if r.name is None:
            continue
        _check_name(r.name, f"reward[{i}]", path)
        if r.name in seen:
            raise UserError(
                f"{path}: reward[{i}].name {r.name!r} is reward[{seen[r.name]}]'s name too: give each reward its "
                "own name (the metrics reward/NAME/mean tell them apart)"
            )
        seen[r.name] = i
    models = [i for i, r in enumerate(c.rewards) if reward_type(r.type).has_model]
    pool = c.resource_pool
    if len(models) > 1 and pool.use_ray and pool.reward > 1:
        raise UserError(
            f"{path}: reward[{models[1]}].type={c.rewards[models[1]].type!r}: a second reward model with "
            f"resource_pool.reward={pool.reward:g} (an FSDP2 group sharding the reward role) is not supported; set "
            "resource_pool.reward to 1 or less (the models then share the role's process and device), or keep one "
            "reward model in the list"
        )
    reward_names(c)  # a derived name an explicit one already takes


def _check_name(name: str, label: str, path: str) -> None:
    if not _NAME.fullmatch(name) or name in ("total",):
        raise UserError(
            f"{path}: {label}.name {name!r}: use letters, digits, '_', '.' or '-' (it names metrics: "
            "reward/NAME/mean), and not 'total'"
        )


def _derived_name(r: RewardSection) -> str:
    if r.type == "rule":
        return re.sub(r"[^A-Za-z0-9_.-]", "_", r.rule.rpartition(":")[2]) or "rule"
    return r.type


def reward_names(c: PPOConfig) -> tuple[str, ...]:
    """Each reward's name in the metrics: its ``name``, else derived (``_derived_name``), with ``_<index>`` when
    another entry has the same one."""
    derived = [r.name or _derived_name(r) for r in c.rewards]
    names = [
        n if r.name is not None or derived.count(n) == 1 else f"{n}_{i}"
        for i, (r, n) in enumerate(zip(c.rewards, derived))
    ]
    for i, n in enumerate(names):
        if names.count(n) > 1:
            raise UserError(
                f"{c.source or 'config'}: reward[{i}]: the name {n!r} is another reward's too; give reward[{i}].name"
            )
    return tuple(names)
