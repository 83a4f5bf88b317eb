"""Reading and checking a PPO configuration in MindSpeed-LLM's layout (the schema: sections.py, whose names
are importable from here too): ``training`` defaults that roles override, one section per role,
``algorithm``, ``resource_pool`` and ``data``. Every value is type-checked (``llm.settings.fields``) and sizes
are bounded (``metadata={"min": ...}``); unknown keys stop the run naming the section, the key and the
closest valid names. Choices that are registries (``reward.type``: rewards/; estimators and KL
controllers: algorithm.py) are checked against the registry, which lists the valid names.

Files: JSON or YAML, in this layout or in MindSpeed-LLM's own (``defaults`` model files,
``actor_rollout_ref: {actor_rollout, ref}``, Megatron names, ``resource_pool`` lists), which
``llm.settings.dialects.mindspeed`` translates into this one.

Command line: ``--section.field value`` (``--actor_rollout.learning_rate 1e-6``), parsed by the field's
type; a bare ``--field value`` sets a ``training`` field.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from collections.abc import Mapping
from typing import Any

from llm.settings import fields
from llm.settings.dialects import mindspeed
from llm.settings.dialects.openrlhf import LAUNCH_SCRIPT_EXTENSIONS, read_launch_script
from llm.settings.ppo import (  # noqa: F401 - the schema, importable from here too
    LORA_ROLES,
    ROLES,
    SECTIONS,
    ActorRolloutSection,
    AlgorithmSection,
    CriticSection,
    DataSection,
    KLCtrlSection,
    PPOConfig,
    RefSection,
    ResourcePool,
    RewardSection,
    TrainingSection,
    shares_actor_base,
)
from llm.settings.registry import ADV_ESTIMATORS, KL_CONTROLLERS, PRM_AGGREGATIONS, kl_kinds, model_types, reward_type
from llm.utils.errors import UserError, closest
from llm.utils.lora import check_lora_fields
from llm.utils.paths import resolve_input_path, resolve_paths, tried

logger = logging.getLogger(__name__)


# Keys this project's PPO once had, or that belong elsewhere: each stops the run with what to write instead.
MOVED = {
    ("", "defaults"): "MindSpeed-LLM's list of model files, read in MindSpeed's layout (sections training, "
    "actor_rollout_ref: {actor_rollout, ref}, critic, reward); in this layout give each role's "
    "model_name_or_path (actor_rollout, ref, critic, reward)",
    ("actor_rollout", "num_gpus_for_train"): "MindSpeed's split of the actor's devices, not read in this layout: set "
    "the actor's training devices as resource_pool.actor_rollout",
    ("actor_rollout", "num_gpus_for_infer"): "MindSpeed's split of the actor's devices, not read in this layout: set "
    "the devices of a separate generation copy as resource_pool.rollout (with resource_pool.use_ray true)",
    ("data", "dev_dataset_path"): "PPO here evaluates no dev set (the log has the rollout's scores every step): "
    "remove it",
}
CONFIG_EXTENSIONS = (".json", ".yaml", ".yml")


def read_config(path: str) -> tuple[dict, str]:
    """The object in a JSON or YAML config file (found from the working directory or the repository root)."""
    found = resolve_input_path(path)
    if found is None:
        raise UserError(f"{path}: no such file (looked in: {tried(path)})")
    try:
        with open(found, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"{path}: cannot read it ({err})") from None
    if path.endswith(".json"):
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as err:
            raise UserError(f"{path}: not valid JSON ({err.msg} at line {err.lineno}, column {err.colno})") from None
    else:
        raw = mindspeed.load_yaml(text, path)
    if not isinstance(raw, dict):
        raise UserError(f"{path}: must hold one object with sections {', '.join(SECTIONS)}")
    return raw, found


def _section(cls: type, values: Any, path: str, name: str) -> Any:
    """``cls`` from the values of section ``name``, each checked against its annotation and bounds."""
    if not isinstance(values, Mapping):
        raise UserError(f"{path}: {name} must be an object of field: value pairs, got {values!r}")
    known, hints, bounds = fields.init_fields(cls), fields.type_hints(cls), fields.field_bounds(cls)
    kwargs = {}
    for key, value in values.items():
        if (name, key) in MOVED:
            raise UserError(f"{path}: {name}.{key}: {MOVED[name, key]}")
        if key not in known:
            raise UserError(f"{path}: {name}: unknown key {key!r}; closest valid names: {closest(str(key), known)}")
        if dataclasses.is_dataclass(hints[key]):
            kwargs[key] = _section(hints[key], value, path, f"{name}.{key}")
            continue
        where = f"{path}: {name}.{key}"
        kwargs[key] = fields.check_value(value, hints[key], where)
        fields.check_bounds(key, kwargs[key], bounds, where)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as err:
        raise UserError(f"{path}: {name}: {err}") from None


def apply_command_line(raw: dict, cli: list[str]) -> None:
    """``--section.field value`` / ``--section.field=value`` pairs into ``raw``, each parsed by the field's
    type (``fields.parse_text``); ``--field`` alone names a ``training`` field."""
    for name, text in fields.command_line_pairs(cli, lambda name: None):
        section, _, key = name.rpartition(".")
        section = section or "training"
        top, *subs = section.split(".")
        if top not in SECTIONS:
            raise UserError(f"command line: unknown section {section!r}; closest: {closest(section, SECTIONS)}")
        cls, target = SECTIONS[top], raw.setdefault(top, {})
        for sub in subs:
            hint = fields.type_hints(cls).get(sub)
            if not dataclasses.is_dataclass(hint) or not isinstance(target, dict):
                raise UserError(f"command line: {section!r} is not a section")
            cls, target = hint, target.setdefault(sub, {})
        if key not in fields.init_fields(cls) or not isinstance(target, dict):
            valid = list(fields.init_fields(cls))
            raise UserError(f"command line: {section} has no field {key!r}; closest valid names: {closest(key, valid)}")
        target[key] = fields.parse_text(text, fields.type_hints(cls)[key], f"command line: --{name}")


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def _input_path(value: str, name: str, path: str) -> str:
    """A model or tokenizer path: resolved (working directory, then repository root) and made absolute, so
    Ray workers read the same files; a missing one stops the run unless it may be a hub id (``org/name``)."""
    found = resolve_paths(value, name, path, required=not _HUB_ID.fullmatch(value))
    return os.path.abspath(found) if os.path.exists(found) else found


def resolve_input_paths(c: PPOConfig, path: str) -> None:
    """Relative input paths of the file (``llm.utils.paths``): both ``python llm/run_ppo.py ...`` from the
    repository root and ``cd llm && python run_ppo.py config/...`` find them. Outputs stay relative to the
    working directory; the reward rule is a module name, not a path."""
    for role in ROLES:
        section = getattr(c, role)
        for name in ("model_name_or_path", "tokenizer_name_or_path"):
            if getattr(section, name):
                setattr(section, name, _input_path(getattr(section, name), f"{role}.{name}", path))
    if c.data.train_dataset_path:  # required when the prompts are read (load_prompts), not to parse
        found = resolve_paths(c.data.train_dataset_path, "data.train_dataset_path", path, required=False)
        c.data.train_dataset_path = ",".join(os.path.abspath(p) if os.path.exists(p) else p for p in found.split(","))
    resume = c.training.resume_from_checkpoint
    if resume and resume.lower() not in ("auto", "true", "last", "false", "none"):
        c.training.resume_from_checkpoint = resolve_paths(resume, "training.resume_from_checkpoint", path)


def parse_ppo_config(argv: list[str]) -> PPOConfig:
    """``CONFIG.{json,yaml} [--section.field value ...]`` -> a checked ``PPOConfig``."""
    if not argv or not argv[0].endswith((*CONFIG_EXTENSIONS, *LAUNCH_SCRIPT_EXTENSIONS)):
        raise UserError("usage: run_ppo.py CONFIG.json|CONFIG.yaml|LAUNCH_SCRIPT.sh [--section.field value ...]")
    path = argv[0]
    notes: list[str] = []
    if path.endswith(LAUNCH_SCRIPT_EXTENSIONS):  # an OpenLLaMA2 / OpenRLHF command line (dialects/openrlhf.py)
        raw, found = read_launch_script(path, "ppo", notes), path
    else:
        raw, found = read_config(path)
    if mindspeed.is_mindspeed_layout(raw):
        raw = mindspeed.translate(raw, path, found, notes)
    for key in raw:
        if ("", key) in MOVED:
            raise UserError(f"{path}: {key}: {MOVED['', key]}")
        if key not in SECTIONS:
            raise UserError(f"{path}: unknown section {key!r}; closest valid names: {closest(str(key), SECTIONS)}")
    apply_command_line(raw, argv[1:])
    sections = {name: _section(cls, raw.get(name, {}), path, name) for name, cls in SECTIONS.items()}
    config = PPOConfig(**sections, source=path, notes=notes)
    resolve_input_paths(config, path)
    validate_ppo_config(config, path)
    for note in config.notes:
        logger.info("%s: %s", path, note)
    return config


def validate_ppo_config(c: PPOConfig, path: str) -> None:
    """What the types cannot say: choices, ranges, sizes that must divide, fields that need one another."""
    a, alg = c.actor_rollout, c.algorithm
    for name, value, valid in (
        ("adv_estimator", alg.adv_estimator, tuple(ADV_ESTIMATORS)),
        ("kl_penalty", alg.kl_penalty, kl_kinds()),
        ("kl_ctrl.type", alg.kl_ctrl.type, tuple(KL_CONTROLLERS)),
    ):
        if value not in valid:
            raise UserError(
                f"{path}: algorithm.{name} must be one of {', '.join(valid)}, got {value!r} "
                f"(closest: {closest(str(value), valid)})"
            )
    kind = reward_type(c.reward.type, f"{path}: ")  # the registry (rewards/): an unknown type lists the valid ones
    if c.reward.prm_aggregation not in PRM_AGGREGATIONS:
        *most, last = PRM_AGGREGATIONS
        raise UserError(f"{path}: reward.prm_aggregation must be {', '.join(most)} or {last}")
    for need in kind.needs:
        if not getattr(c.reward, need):
            raise UserError(f"{path}: reward.type={c.reward.type!r} needs reward.{need}")
    if not a.model_name_or_path:
        raise UserError(f"{path}: actor_rollout.model_name_or_path is required (the SFT model)")
    if not c.data.train_dataset_path:
        raise UserError(f"{path}: data.train_dataset_path is required (a prompt file)")
    for role in ("actor_rollout", "critic") if c.uses_critic else ("actor_rollout",):
        if c.lr(role) == 0:
            raise UserError(
                f"{path}: the {role} learning_rate is 0 ({role}.learning_rate, else training.learning_rate): "
                "training would change nothing; give a positive learning rate"
            )
    for name, value, low, high in (
        ("actor_rollout.temperature", a.temperature, 0, None),
        ("actor_rollout.top_p", a.top_p, 0, 1),
        ("reward.timeout", c.reward.timeout, 0, None),
        ("algorithm.kl_ctrl.target_kl", alg.kl_ctrl.target_kl, 0, None),
        ("algorithm.kl_ctrl.horizon", alg.kl_ctrl.horizon, 0, None),
    ):
        if value <= low or (high is not None and value > high):
            span = f"in ({low}, {high}]" if high is not None else f"> {low}"
            raise UserError(f"{path}: {name} must be {span}, got {value}")
    for name, value in (("algorithm.gamma", alg.gamma), ("algorithm.lam", alg.lam)):
        if value > 1:
            raise UserError(f"{path}: {name} must be in [0, 1], got {value}")
    for role in ("actor_rollout", "critic"):
        for beta in ("adam_beta1", "adam_beta2"):
            if c.optim(role, beta) >= 1:
                raise UserError(f"{path}: {beta} of {role} must be in [0, 1), got {c.optim(role, beta)}")
    for role in ("ref", "critic"):  # both read the actor's token ids
        tok = getattr(c, role).tokenizer_name_or_path
        if tok and tok != (a.tokenizer_name_or_path or a.model_name_or_path):
            raise UserError(
                f"{path}: {role}.tokenizer_name_or_path {tok!r}: the {role} reads the actor's token ids, so it uses "
                "the actor's tokenizer (actor_rollout.tokenizer_name_or_path); remove it"
            )
    batch = c.data.rollout_batch_size * a.num_samples_per_step
    sizes = [("actor_rollout.ppo_mini_batch_size", a.ppo_mini_batch_size)]
    if c.uses_critic:  # GRPO / RLOO / REINFORCE++ have no critic: its mini-batch size is not read
        sizes.append(("critic.critic_mini_batch_size", c.critic.critic_mini_batch_size))
    for name, size in sizes:
        if batch % size:
            raise UserError(f"{path}: {name}={size} must divide rollout_batch_size x num_samples_per_step = {batch}")
    grouped = ADV_ESTIMATORS[alg.adv_estimator].grouped
    if grouped and a.num_samples_per_step < 2:
        raise UserError(f"{path}: adv_estimator={alg.adv_estimator!r} needs actor_rollout.num_samples_per_step >= 2")
    if not a.do_sample and a.num_samples_per_step > 1:
        logger.warning(
            "%s: actor_rollout.do_sample is false (greedy) with num_samples_per_step=%d: the %d samples of each "
            "prompt are identical%s",
            path,
            a.num_samples_per_step,
            a.num_samples_per_step,
            " (so their group advantages are 0)" if grouped else "",
        )
    validate_memory(c, path)
    validate_resource_pool(c.resource_pool, path)
    validate_lora(c, path)
    validate_rollout_engine(c, path)


ROLLOUT_ENGINES = ("hf", "vllm")


def validate_rollout_engine(c: PPOConfig, path: str) -> None:
    """``rollout_engine`` and what vLLM cannot do here."""
    a, pool = c.actor_rollout, c.resource_pool
    if a.rollout_is_cap is not None and a.rollout_log_probs:
        raise UserError(
            f"{path}: actor_rollout.rollout_is_cap with rollout_log_probs true: the old log-probs would be the "
            "engine's own, so every weight would be 1; set rollout_log_probs false (the trainer's forward) to "
            "correct for the engine, or remove rollout_is_cap"
        )
    if a.rollout_engine not in ROLLOUT_ENGINES:
        raise UserError(
            f"{path}: actor_rollout.rollout_engine must be hf or vllm, got {a.rollout_engine!r} "
            f"(closest: {closest(str(a.rollout_engine), ROLLOUT_ENGINES)})"
        )
    if a.rollout_engine != "vllm":
        for name, default in (("vllm_gpu_memory_utilization", 0.3), ("vllm_max_model_len", None), ("vllm_sleep", True)):
            if getattr(a, name) != default:
                raise UserError(f"{path}: actor_rollout.{name} applies to rollout_engine vllm; rollout_engine is hf")
        return
    generating = "rollout" if pool.rollout > 0 else "actor_rollout"
    if pool.amount(generating) > 1:
        raise UserError(
            f"{path}: actor_rollout.rollout_engine vllm with resource_pool.{generating}={pool.amount(generating):g}: "
            "the engine runs in one process (tensor parallelism inside vLLM is not wired here); give the generating "
            "role one device (a rollout copy, resource_pool.rollout 1, leaves the actor its FSDP2 group)"
        )
    engine_log_probs = "rollout_log_probs" if a.rollout_log_probs else "rollout_is_cap" if a.rollout_is_cap else None
    if engine_log_probs and (a.top_p < 1 or a.top_k > 0 or not a.do_sample):
        raise UserError(
            f"{path}: actor_rollout.{engine_log_probs} with rollout_engine vllm needs do_sample true, top_p 1 and "
            "top_k 0: vLLM's log-probs are taken after its top-p / top-k masking (and at temperature 1 when greedy), "
            f"not from the distribution the trainer uses; turn {engine_log_probs} off"
        )
    if a.vllm_gpu_memory_utilization > 1:
        raise UserError(
            f"{path}: actor_rollout.vllm_gpu_memory_utilization must be in (0, 1], got {a.vllm_gpu_memory_utilization}"
        )


FROZEN_DTYPES = ("float32", "bfloat16")


def validate_memory(c: PPOConfig, path: str) -> None:
    """The memory savers: the frozen roles' dtypes, and no model settings on a reward without a model."""
    for role in ("ref", "reward"):
        section = getattr(c, role)
        if section.dtype is not None and section.dtype not in FROZEN_DTYPES:
            raise UserError(
                f"{path}: {role}.dtype must be float32, bfloat16 or null (as the trained models), got {section.dtype!r}"
            )
    if not reward_type(c.reward.type, f"{path}: ").has_model:
        for name, value, default in (("dtype", c.reward.dtype, None), ("offload", c.reward.offload, False)):
            if value != default:
                raise UserError(
                    f"{path}: reward.{name} applies to a reward model (type {' or '.join(model_types())}); "
                    f"reward.type is {c.reward.type!r}, which has none"
                )


def validate_resource_pool(pool: ResourcePool, path: str) -> None:
    for role in (*ROLES, "rollout"):
        amount = pool.amount(role)
        if not pool.use_ray:
            if amount != (0 if role == "rollout" else 1):
                what = "a separate rollout copy" if role == "rollout" else "placing roles on their own devices"
                raise UserError(
                    f"{path}: resource_pool.{role}={amount:g}: {what} needs Ray: set resource_pool.use_ray true "
                    "(pip install ray), or leave it at its default to run every role in this process"
                )
            continue
        if amount == 0 and role != "rollout":
            raise UserError(f"{path}: resource_pool.{role}=0: every role needs a device or a share of one (> 0)")
        if amount > 1 and not float(amount).is_integer():
            raise UserError(
                f"{path}: resource_pool.{role}={amount:g}: more than one device must be a whole number (each rank "
                "of the role's FSDP2 group holds one device); below one it is a share of a single device"
            )
    if not pool.use_ray:
        for name, value, default in (("colocate", pool.colocate, []), ("address", pool.address, None)):
            if value != default:
                raise UserError(f"{path}: resource_pool.{name} is used only with resource_pool.use_ray true")
        return
    if pool.device not in ("cpu", "gpu"):
        raise UserError(f"{path}: resource_pool.device must be cpu or gpu, got {pool.device!r}")
    for name in ("call_timeout", "weight_sync_timeout"):
        if getattr(pool, name) <= 0:
            raise UserError(
                f"{path}: resource_pool.{name} must be a number of seconds > 0, got {getattr(pool, name):g}"
            )
    seen: set[str] = set()
    for group in pool.colocate:
        for role in group:
            if role not in ROLES:
                raise UserError(
                    f"{path}: resource_pool.colocate: unknown role {role!r}; colocate any of {', '.join(ROLES)} "
                    f"(closest: {closest(str(role), ROLES)})"
                )
            if role in seen:
                raise UserError(f"{path}: resource_pool.colocate: {role!r} is listed twice; a role runs in one place")
            seen.add(role)
        if len(group) < 2:
            raise UserError(f"{path}: resource_pool.colocate: {group} has one role; a group needs two or more")
        amounts = {pool.amount(role) for role in group}
        if len(amounts) > 1:
            listed = ", ".join(f"{role}={pool.amount(role):g}" for role in group)
            raise UserError(
                f"{path}: resource_pool.colocate: {group} share one process and its devices, so they need equal "
                f"amounts ({listed})"
            )


def validate_lora(c: PPOConfig, path: str) -> None:
    """The flat trainers' checks of each trained role's LoRA fields, then what PPO's placement cannot do."""
    pool = c.resource_pool
    for role in LORA_ROLES:
        section = getattr(c, role)
        try:
            check_lora_fields(section, prefix=f"{role}.")
        except UserError as err:
            raise UserError(f"{path}: {err}") from None
        if section.lora and pool.use_ray and pool.amount(role) > 1:
            raise UserError(
                f"{path}: {role}.lora with resource_pool.{role}={pool.amount(role):g}: a role on more than one device "
                "is sharded with FSDP2, which is not available for LoRA in this build (peft's adapters are not "
                f"placed with the sharded base); give {role} one device (or a share of one), or set {role}.lora false"
            )
    if not shares_actor_base(c):
        return
    for name, value, default in (("dtype", c.ref.dtype, None), ("offload", c.ref.offload, False)):
        if value != default:
            raise UserError(
                f"{path}: ref.{name}: with actor_rollout.lora the reference is the actor's own model with the adapter "
                "disabled (no model of its own), so it has no dtype or offload of its own; remove ref."
                f"{name}, or give ref.model_name_or_path to load a separate reference"
            )
    if pool.use_ray and not any({"actor_rollout", "ref"} <= set(group) for group in pool.colocate):
        raise UserError(
            f"{path}: actor_rollout.lora with resource_pool.use_ray: the reference is the actor's own model with the "
            'adapter disabled, so it must run in the actor\'s process: add ["actor_rollout", "ref"] to '
            "resource_pool.colocate (with equal amounts), or give ref.model_name_or_path to load a separate reference"
        )
