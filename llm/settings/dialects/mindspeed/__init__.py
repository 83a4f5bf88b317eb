"""MindSpeed-LLM's Ray PPO files (``python ray_gpt.py --config-name ppo_trainer_llama32_1b``) read as they are.

Their layout (``configs/rlxf/ppo_trainer_*.yaml``, read by hydra in ``ray_gpt.py``)::

    defaults: [{model: [llama32-1b]}]    # hydra config group: model/<name>.yaml beside the file
    training: {...}                      # Megatron arguments shared by the four roles
    actor_rollout_ref: {actor_rollout: {...}, ref: {...}}
    critic: {...}
    reward: {...}
    algorithm: {...}                     # read by the driver (core_algos.py); names as ours
    resource_pool: {actor_rollout: [2], ref: [1], critic: [1], reward: [1]}   # devices on each node

A role's arguments are its model file < ``training`` < its own section, merged
(``parse_args_from_config``, mindspeed_llm/tasks/posttrain/rlxf/training/initialize.py) and handed to
Megatron's argument parser. ``translate`` makes the same merge and maps every name onto this project's
fields with MindSpeed's meaning: ``RULES`` is the table (docs/dialects.md shows it, generated). A
name that cannot take effect here stops the run, unless its value means what this trainer does anyway
(then a line in the log says so); our own field names are accepted too (``init_from_config``, ``type``).
"""

from llm.settings.dialects.mindspeed.architecture import ARCHITECTURE, KERNELS, check_architecture
from llm.settings.dialects.mindspeed.convert import translate
from llm.settings.dialects.mindspeed.files import is_mindspeed_layout
from llm.settings.dialects.mindspeed.names import RULES
from llm.settings.dialects.mindspeed.rule_types import (
    ACTOR,
    ALL,
    MINDSPEED_SECTIONS,
    ROLE_PLACES,
    TRAINED,
    Given,
    Rule,
    Translation,
)

__all__ = [
    "ACTOR",
    "ALL",
    "ARCHITECTURE",
    "KERNELS",
    "MINDSPEED_SECTIONS",
    "ROLE_PLACES",
    "RULES",
    "TRAINED",
    "Given",
    "Rule",
    "Translation",
    "check_architecture",
    "is_mindspeed_layout",
    "translate",
]
