"""A stable fingerprint of what a run trains, stored with each checkpoint (``checkpoint-N/checkpoint.json``).

Two runs with the same fingerprint train the same model from the same data with the same hyper-parameters,
so one may resume the other's checkpoints. Fingerprinted: the model and tokenizer paths, the training data
(each path with the size and a SHA-256 of each file's content: sampled for files over 64 MiB), every training
hyper-parameter, the global batch size. Not fingerprinted: where and how the run writes, logs, evaluates and
stops (output_dir, resume_from_checkpoint, logging/saving/eval settings, max_steps, num_train_epochs,
report_to, dataloader workers, the dev set) and how it is laid out over processes and memory (the
per-device batch and accumulation split of the same global batch, sharding, tensor parallelism, recompute,
offload, the PPO resource pool), since a checkpoint resumes under any of those.

``run_fingerprint(model_args, data_args, training_args, use_chat_template=...)`` (the flat scripts) or
``run_fingerprint(ppo_config, use_chat_template=...)`` returns a ``Fingerprint``: ``digest`` (hex) and ``values``
(the readable dict it hashes); ``differing_fields(a, b)`` names the fields two ``values`` dicts disagree on.
``use_chat_template`` is the run's effective choice, which the build derives once from the tokenizer (its run
record: ``llm.alignment.context.RunContext``, ``llm.alignment.ppo.context.PPOContext``); this module loads nothing.

Fields added after checkpoints were written (``ADDED_LATER`` for PPO's ``section.field`` names,
``FLAT_ADDED_LATER`` for the flat scripts' field names): at the value that gives the behaviour from before the
field existed they are left out, so a config that does not set them keeps its fingerprint.
``run_fingerprint(label_args)``: what ``llm/run_label.py``'s labels are made with (every field but how many
problems, where and how fast), so a rerun resumes only labels of the same settings.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from dataclasses import dataclass
from typing import Any

FINGERPRINT_VERSION = 1

# Files up to this size are hashed whole; larger ones by a few sampled blocks (plus their size).
_FULL_HASH_LIMIT = 64 << 20
_SAMPLE_BLOCK = 4 << 20

# Fields of model/data (and any other non-TrainingArguments) dataclasses that do not change what is trained.
_EXCLUDED = {
    "output_dir",
    "overwrite_output_dir",
    "resume_from_checkpoint",
    "dev_dataset_path",
    "max_eval_samples",  # how much of the dev set is evaluated
    "use_flash_attention",
    "flash_mask",
    "recompute_granularity",
    "virtual_pp_degree",
    "benchmark",
    "autotuner_benchmark",
    "lora_merge",  # what is saved at the end, not what is trained
    "eval_random_init",  # evaluation only
    # llm/run_label.py: how much and where it labels, not what a label is
    "max_problems",
    "completion_timeout",
    "vllm_gpu_memory_utilization",
    "ray_workers",
    "ray_address",
}

# transformers.TrainingArguments fields that change what is trained (an allow-list: its many other fields
# are about logging, saving, evaluation, hubs, devices and data loading).
_HF_TRAINING_FIELDS = (
    "learning_rate",
    "lr_scheduler_type",
    "lr_scheduler_kwargs",
    "warmup_steps",
    "optim",
    "optim_args",
    "optim_target_modules",
    "weight_decay",
    "adam_beta1",
    "adam_beta2",
    "adam_epsilon",
    "max_grad_norm",
    "label_smoothing_factor",
    "neftune_noise_alpha",
    "bf16",
    "fp16",
    "tf32",
    "seed",
    "data_seed",
    "full_determinism",
    "average_tokens_across_devices",
    "train_sampling_strategy",
    "dataloader_drop_last",
)

# Fields our TrainingArguments subclasses add that do not change what is trained.
_EXCLUDED_OWN_TRAINING = {
    "overwrite_output_dir",
    "evaluation_strategy",
    "warmup_ratio",  # folded into warmup_steps
    "tensor_parallel_degree",
    "sharding_parallel_degree",
    "sharding",
    "recompute",
    "unified_checkpoint",
    "config_notes",
    "prm_threshold",  # evaluation only
    "prm_threshold_subset",
    "bon_aggregations",
}

# PPO: "section.field" (or "section.*") that do not change what is trained.
_PPO_EXCLUDED = {
    "training.output_dir",
    "training.overwrite_output_dir",
    "training.resume_from_checkpoint",
    "training.max_steps",
    "training.logging_steps",
    "training.save_steps",
    "training.save_total_limit",
    "training.report_to",
    "training.disable_tqdm",
    "training.log_samples",
    "training.gradient_checkpointing",
    "training.adam_offload",
    "training.micro_batch_size",
    "actor_rollout.micro_batch_size",
    "actor_rollout.gather_weights_for_generation",
    "actor_rollout.vllm_gpu_memory_utilization",
    "actor_rollout.vllm_max_model_len",
    "actor_rollout.vllm_sleep",
    "training.readout_chunk",
    "critic.micro_batch_size",
    "ref.micro_batch_size",
    "ref.offload",
    "reward.micro_batch_size",
    "reward.offload",
    "reward.timeout",
    "reward.name",  # a metric's name
    "resource_pool.*",
    "prime.micro_batch_size",
}

# PPO fields added after checkpoints of FINGERPRINT_VERSION 1 were written, each with the value that does what the
# run did before the field existed (its default, which tests/test_derived_once.py holds to it): at that
# value they are left out, so an unchanged config keeps its fingerprint and its old checkpoints resume; set to
# anything else they are fingerprinted as every other field. A new PPO field goes here with its default.
ADDED_LATER = {
    "actor_rollout.policy_loss": "vanilla",
    "actor_rollout.clip_ratio_c": 3.0,
    "actor_rollout.loss_agg_mode": "token-mean",
    "actor_rollout.mask_truncated_completions": False,
    "actor_rollout.async_rollout": False,
    "actor_rollout.max_staleness": 1,
    "algorithm.norm_adv_by_std_in_grpo": True,
    "algorithm.filter_groups": False,
    "algorithm.filter_groups_range": None,
    "algorithm.max_num_gen_batches": 10,
    "reward.overlong_buffer_len": 0,
    "reward.overlong_penalty_factor": 1.0,
    "reward.implicit_granularity": "token",
    "reward.weight": 1.0,
    "reward.critique_samples": 1,
    "reward.max_critique_tokens": 64,
    "reward.critique_temperature": 0.0,
}

# The same for the flat scripts' fields (ModelArgument, DataArgument, TrainingArguments and their subclasses), by
# field name: a new field goes here with its default, so the configs that do not set it keep their fingerprints.
FLAT_ADDED_LATER: dict[str, Any] = {
    "soft_labels": False,
    "prm_kind": "discriminative",
    # the generative PRM's (prm_kind generative)
    "critique_loss_weight": 1.0,
    "verdict_loss_weight": 1.0,
    "critique_samples": 1,
    "max_critique_tokens": 64,
    "critique_temperature": 0.0,
    "implicit_beta": 0.05,  # prm_kind implicit's fields (refused with another kind unless at these values)
    "implicit_loss": "ce",
    "implicit_reference": None,
    "head_learning_rate": None,  # an ORM's score head at its own learning rate
}

# Fields whose value is a (comma-separated list of) data file(s) or directories: fingerprinted by content.
_DATA_FIELDS = {"train_dataset_path", "data.train_dataset_path", "problems_path"}


@dataclass(frozen=True)
class Fingerprint:
    digest: str  # hex SHA-256 of ``values``
    values: dict[str, Any]  # field name -> JSON value (data paths: path, size and content hash of each file)

    def __str__(self) -> str:
        return self.digest


def run_fingerprint(*configs: Any, use_chat_template: bool | None = None) -> Fingerprint:
    """The fingerprint of a run: ``run_fingerprint(model_args, data_args, training_args)`` for the flat scripts,
    ``run_fingerprint(ppo_config)`` for PPO. ``use_chat_template``: the choice the run makes (the build's, from
    the tokenizer when the config leaves it unset); None: the config's setting as written."""
    values = fingerprint_values(*configs, use_chat_template=use_chat_template)
    text = json.dumps({"version": FINGERPRINT_VERSION, "values": values}, sort_keys=True, ensure_ascii=True)
    return Fingerprint(hashlib.sha256(text.encode()).hexdigest(), values)


def fingerprint_values(*configs: Any, use_chat_template: bool | None = None) -> dict[str, Any]:
    if len(configs) == 1 and _is_ppo_config(configs[0]):
        values = _ppo_values(configs[0])
        key = "data.use_chat_template"
    else:
        values = {}
        for args in configs:
            values.update(_flat_values(args))
        values, key = dict(sorted(values.items())), "use_chat_template"
    if use_chat_template is not None and key in values:
        # unset (None) means "when the tokenizer has a chat template": the answer is what the run does. A tokenizer
        # without one gives false, the old default, so such runs' checkpoints saved before the default changed match.
        values[key] = use_chat_template
    return values


# --- the flat scripts ---------------------------------------------------------------------------------
def _flat_values(args: Any) -> dict[str, Any]:
    import transformers

    if isinstance(args, transformers.TrainingArguments):
        hf = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
        names = [n for n in _HF_TRAINING_FIELDS if n in hf]
        names += [
            f.name
            for f in dataclasses.fields(args)
            if f.init
            and f.name not in hf
            and f.name not in _EXCLUDED_OWN_TRAINING
            and not _added_later(FLAT_ADDED_LATER, f.name, getattr(args, f.name))
        ]
        values = {n: _json_value(getattr(args, n)) for n in names}
        values["global_train_batch_size"] = _global_batch(args)
        return values
    if not dataclasses.is_dataclass(args):
        raise TypeError(f"run_fingerprint: expected argument dataclasses or a PPOConfig, got {type(args).__name__}")
    out = {}
    for f in dataclasses.fields(args):
        if not f.init or f.name in _EXCLUDED or _added_later(FLAT_ADDED_LATER, f.name, getattr(args, f.name)):
            continue
        value = getattr(args, f.name)
        out[f.name] = _data_value(value) if f.name in _DATA_FIELDS else _json_value(_local_path(f.name, value))
    return out


def _added_later(table: dict[str, Any], key: str, value: Any) -> bool:
    """``key`` was added after checkpoints were written and ``value`` does what runs did before it existed."""
    return key in table and value == table[key]


def _global_batch(args: Any) -> int:
    """per_device_train_batch_size x gradient_accumulation_steps x data-parallel processes: the same global
    batch split another way trains the same model (losses are normalised by the global item count)."""
    try:
        dp = args.layout.dp
    except Exception:  # noqa: BLE001 - a layout problem is reported by validate_arguments, not here
        dp = int(os.environ.get("WORLD_SIZE", "1"))
    return int(args.per_device_train_batch_size) * int(args.gradient_accumulation_steps) * dp


# --- PPO --------------------------------------------------------------------------------------------
def _is_ppo_config(config: Any) -> bool:
    return dataclasses.is_dataclass(config) and hasattr(config, "training") and hasattr(config, "actor_rollout")


def _ppo_values(config: Any) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        section = getattr(config, f.name)
        if not dataclasses.is_dataclass(section) or f"{f.name}.*" in _PPO_EXCLUDED:
            continue  # source, notes, extra_rewards
        _section_values(f.name, section, values)
    # ``reward`` as a list (llm.settings.reward_list): the first entry is ``reward``, the others ``reward[i]``
    for i, section in enumerate(getattr(config, "extra_rewards", ()), 1):
        _section_values(f"reward[{i}]", section, values, "reward")
    return dict(sorted(values.items()))


def _section_values(prefix: str, section: Any, values: dict[str, Any], kind: str | None = None) -> None:
    """``kind``: the section whose exclusions apply (``reward`` for ``reward[i]``), else ``prefix``."""
    for f in dataclasses.fields(section):
        key, rule = f"{prefix}.{f.name}", f"{kind or prefix}.{f.name}"
        if not f.init or rule in _PPO_EXCLUDED:
            continue  # not init: derived from the fields (reward.label_tokens)
        value = getattr(section, f.name)
        if _added_later(ADDED_LATER, rule, value):
            continue
        if dataclasses.is_dataclass(value):
            _section_values(key, value, values)
        elif key in _DATA_FIELDS:
            values[key] = _data_value(value)
        else:
            values[key] = _json_value(_local_path(f.name, value))


# --- values -----------------------------------------------------------------------------------------
def _local_path(name: str, value: Any) -> Any:
    """A model/tokenizer path that exists here, as an absolute path (the same run launched from another
    working directory); anything else (a hub id) as is."""
    if name.endswith("_name_or_path") and isinstance(value, str) and value and os.path.exists(value):
        return os.path.realpath(value)
    return value


def _json_value(value: Any) -> Any:
    """A JSON-able, deterministic form of a config value."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, dict):
        return {str(k): _json_value(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _json_value(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if hasattr(value, "value") and type(value).__module__ != "builtins":  # enums (lr_scheduler_type, optim)
        return _json_value(value.value)
    return str(value)


def _data_value(value: Any) -> Any:
    """A data path field: for each comma-separated path, the path with the size and content hash of its file(s)."""
    if not isinstance(value, str) or not value:
        return _json_value(value)
    return [_path_entry(p.strip()) for p in value.split(",") if p.strip()]


def _path_entry(path: str) -> dict[str, Any]:
    if os.path.exists(path):
        path = os.path.realpath(path)
    if os.path.isfile(path):
        return {"path": path, **_file_digest(path)}
    if os.path.isdir(path):
        files = []
        for root, dirs, names in os.walk(path):
            dirs.sort()
            for name in sorted(names):
                full = os.path.join(root, name)
                files.append({"file": os.path.relpath(full, path), **_file_digest(full)})
        return {"path": path, "files": files}
    return {"path": path, "missing": True}


def _file_digest(path: str) -> dict[str, Any]:
    size = os.path.getsize(path)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= _FULL_HASH_LIMIT:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
            return {"size": size, "sha256": h.hexdigest()}
        for offset in (0, (size - _SAMPLE_BLOCK) // 2, size - _SAMPLE_BLOCK):
            f.seek(offset)
            h.update(f.read(_SAMPLE_BLOCK))
    return {"size": size, "sha256_sampled": h.hexdigest()}
