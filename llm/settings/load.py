"""The one configuration path of every script: read the file (``files``: JSON, YAML, an OpenRLHF launch
script) -> translate a dialect (``dialects``: PaddleNLP names, MindSpeed-LLM's layout, OpenRLHF flags) ->
lay the command-line overrides over it (``command_line``) -> fill the typed dataclasses (``fields``) ->
validate (``flat.validate_arguments`` / ``ppo_validation.validate_ppo_config``; the run script calls the
flat one after parsing, PPO's is called here).

``parse_arguments(argv, types)`` gives the flat scripts' ``(ModelArgument, DataArgument, TrainingArguments)``
(their subclasses for reward models and DPO); ``parse_ppo_config(argv)`` gives a checked ``PPOConfig``;
``parse_search_config(argv)`` a checked ``SearchConfig`` (``run_search.py``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

from llm.settings import fields
from llm.settings.command_line import Schema, merge, parse_overrides
from llm.settings.dialects import mindspeed
from llm.settings.dialects.paddle import PADDLE_NAMES, translate
from llm.settings.files import JSON_EXTENSIONS, LAUNCH_SCRIPT_EXTENSIONS, YAML_EXTENSIONS, read_config_file
from llm.settings.flat import ARGUMENT_TYPES, INPUT_PATHS, TRAINING_BOUNDS, TrainingArguments
from llm.settings.ppo import OPTIONAL_SECTIONS, ROLES, SECTIONS, PPOConfig
from llm.settings.ppo_validation import validate_ppo_config
from llm.settings.reward_list import build_reward_list
from llm.settings.search import SEARCH_SECTIONS, SearchConfig, validate_search_config
from llm.utils.errors import UserError, closest
from llm.utils.logging import log_config_notes
from llm.utils.paths import resolve_paths


# --- the flat scripts (SFT, reward models, DPO, the reward server) --------------------------------------
def parse_arguments(
    argv: list[str], types: tuple[type, ...] = ARGUMENT_TYPES, paddle: Mapping[str, Any] = PADDLE_NAMES
) -> tuple[Any, ...]:
    """``CONFIG.json [--field value ...]`` -> one instance per dataclass in ``types``.

    Every key goes to the dataclass that declares it and is type-checked (``llm.settings.fields``);
    PaddleNLP's own names in ``paddle`` are translated first (``llm.settings.dialects.paddle``); relative input
    paths are resolved (``llm.utils.paths``). Lines worth logging land in ``TrainingArguments.config_notes``.
    """
    script = next((cls.script for cls in types if hasattr(cls, "script")), "sft")
    usage = "usage: run_x.py CONFIG.json|LAUNCH_SCRIPT.sh [--field value ...]"
    source = read_config_file(
        argv[0] if argv else "",
        script,
        (*JSON_EXTENSIONS, *LAUNCH_SCRIPT_EXTENSIONS),
        usage,
        "one JSON object of field: value pairs",
    )
    path, notes = source.path, source.notes
    owner = {name: cls for cls in types for name in fields.init_fields(cls)}
    annotations = {name: fields.type_hints(cls)[name] for name, cls in owner.items()}
    config = translate(source.raw, set(owner), path, notes, paddle)
    for key in config:
        if key not in owner:
            raise UserError(f"{path}: unknown key {key!r}; closest valid names: {closest(key, owner)}")
    overrides = parse_overrides(argv[1:], Schema(flat=annotations, dialect=paddle))
    merged = {**config, **translate(overrides, set(owner), "command line", notes, paddle)}
    for name in INPUT_PATHS:
        if isinstance(merged.get(name), str):
            merged[name] = resolve_paths(merged[name], name, path, required=False)
    parsed = []
    for cls in types:
        values = {k: v for k, v in merged.items() if owner[k] is cls}
        parsed.append(fields.build(cls, values, path, TRAINING_BOUNDS))
    for args in parsed:
        if isinstance(args, TrainingArguments):
            args.config_notes = notes
            object.__setattr__(args, "config_source", path)  # for later messages; not a field, not fingerprinted
    return tuple(parsed)


# --- PPO ------------------------------------------------------------------------------------------------
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
CONFIG_EXTENSIONS = (*JSON_EXTENSIONS, *YAML_EXTENSIONS)
ALL_SECTIONS = {**SECTIONS, **OPTIONAL_SECTIONS}
PPO_SCHEMA = Schema(sections=ALL_SECTIONS, default_section="training")


def parse_ppo_config(argv: list[str]) -> PPOConfig:
    """``CONFIG.{json,yaml} [--section.field value ...]`` -> a checked ``PPOConfig``."""
    source = read_config_file(
        argv[0] if argv else "",
        "ppo",
        (*CONFIG_EXTENSIONS, *LAUNCH_SCRIPT_EXTENSIONS),
        "usage: run_ppo.py CONFIG.json|CONFIG.yaml|LAUNCH_SCRIPT.sh [--section.field value ...]",
        f"one object with sections {', '.join(ALL_SECTIONS)}",
    )
    path, raw, notes = source.path, source.raw, source.notes
    if mindspeed.is_mindspeed_layout(raw):
        raw = mindspeed.translate(raw, path, source.found, notes)
    for key, values in raw.items():
        if ("", key) in MOVED:
            raise UserError(f"{path}: {key}: {MOVED['', key]}")
        if key not in ALL_SECTIONS:
            raise UserError(f"{path}: unknown section {key!r}; closest valid names: {closest(str(key), ALL_SECTIONS)}")
        for name in values if isinstance(values, Mapping) else ():
            if (key, name) in MOVED:
                raise UserError(f"{path}: {key}.{name}: {MOVED[key, name]}")
    overrides = parse_overrides(argv[1:], PPO_SCHEMA)
    reward_list = raw.get("reward") if isinstance(raw.get("reward"), list) else None
    if reward_list is not None and "reward" in overrides:
        raise UserError(
            f"command line: --reward.{next(iter(overrides['reward']), 'FIELD')}: {path} gives reward as a list, and "
            "an override cannot say which entry it sets: edit the entry in the file"
        )
    raw = merge(raw, overrides)
    extra_rewards: tuple = ()
    if reward_list is not None:  # several weighted rewards (llm.settings.reward_list): the first is ``reward``
        first, *rest = build_reward_list(reward_list, path)
        raw, extra_rewards = {**raw, "reward": {}}, tuple(rest)
    sections = {name: fields.build(cls, raw.get(name, {}), path, section=name) for name, cls in SECTIONS.items()}
    if reward_list is not None:
        sections["reward"] = first
    sections.update(
        {
            name: fields.build(cls, raw[name], path, section=name)
            for name, cls in OPTIONAL_SECTIONS.items()
            if name in raw
        }
    )
    config = PPOConfig(**sections, extra_rewards=extra_rewards, source=path, notes=notes)
    resolve_input_paths(config, path)
    validate_ppo_config(config, path)
    log_config_notes(config.notes, path)
    return config


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
    roles = [(role, getattr(c, role)) for role in ROLES if role != "reward"]
    roles += [(f"reward[{i}]" if c.extra_rewards else "reward", r) for i, r in enumerate(c.rewards)]
    for role, section in roles:
        for name in ("model_name_or_path", "tokenizer_name_or_path"):
            if getattr(section, name):
                setattr(section, name, _input_path(getattr(section, name), f"{role}.{name}", path))
    for name in ("model_name_or_path", "ref_model_name_or_path") if c.prime is not None else ():
        if getattr(c.prime, name):
            setattr(c.prime, name, _input_path(getattr(c.prime, name), f"prime.{name}", path))
    if c.data.train_dataset_path:  # required when the prompts are read (load_prompts), not to parse
        found = resolve_paths(c.data.train_dataset_path, "data.train_dataset_path", path, required=False)
        c.data.train_dataset_path = ",".join(os.path.abspath(p) if os.path.exists(p) else p for p in found.split(","))
    resume = c.training.resume_from_checkpoint
    if resume and resume.lower() not in ("auto", "true", "last", "false", "none"):
        c.training.resume_from_checkpoint = resolve_paths(resume, "training.resume_from_checkpoint", path)


# --- PRM-guided search ----------------------------------------------------------------------------------
SEARCH_SCHEMA = Schema(sections=SEARCH_SECTIONS, default_section="search")


def parse_search_config(argv: list[str]) -> SearchConfig:
    """``CONFIG.{json,yaml} [--section.field value ...]`` -> a checked, read-only ``SearchConfig``: input paths
    resolved as PPO's (the working directory, then the repository root) before the sections are built."""
    source = read_config_file(
        argv[0] if argv else "",
        "search",
        CONFIG_EXTENSIONS,
        "usage: run_search.py CONFIG.json|CONFIG.yaml [--section.field value ...]",
        f"one object with sections {', '.join(SEARCH_SECTIONS)}",
    )
    path, raw = source.path, source.raw
    for key in raw:
        if key not in SEARCH_SECTIONS:
            raise UserError(
                f"{path}: unknown section {key!r}; closest valid names: {closest(str(key), SEARCH_SECTIONS)}"
            )
    raw = merge(raw, parse_overrides(argv[1:], SEARCH_SCHEMA))
    for section in ("policy", "prm"):
        values = raw.get(section)
        for name in ("model_name_or_path", "tokenizer_name_or_path"):
            if isinstance(values, Mapping) and isinstance(values.get(name), str):
                raw[section] = values = {**values, name: _input_path(values[name], f"{section}.{name}", path)}
    data = raw.get("data")
    if isinstance(data, Mapping) and isinstance(data.get("problems_path"), str):
        found = resolve_paths(data["problems_path"], "data.problems_path", path)
        raw["data"] = {**data, "problems_path": ",".join(os.path.abspath(p) for p in found.split(","))}
    sections = {name: fields.build(cls, raw.get(name, {}), path, section=name) for name, cls in SEARCH_SECTIONS.items()}
    config = SearchConfig(**sections, source=path, notes=tuple(source.notes))
    validate_search_config(config, path)
    return config
