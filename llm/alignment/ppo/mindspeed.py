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
fields with MindSpeed's meaning: ``RULES`` is the table (README "PPO configuration" has it in prose). A
name that cannot take effect here stops the run, unless its value means what this trainer does anyway
(then a line in the log says so); our own field names are accepted too (``init_from_config``, ``type``).
"""

from __future__ import annotations

import glob
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import yaml

from llm.alignment.ppo.sections import SECTIONS
from llm.utils import fields
from llm.utils.errors import UserError, closest
from llm.utils.paths import resolve_input_path, search_dirs, tried


class _Loader(yaml.SafeLoader):
    """YAML as OmegaConf (hydra) reads it: ``1e-7`` is a number (YAML 1.1 wants ``1.0e-7``), dates stay
    text; a key given twice in one mapping is an error (it would silently override)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen = set()
            for key, _ in node.value:
                if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                    if key.value in seen:
                        raise yaml.constructor.ConstructorError(
                            None, None, f"key {key.value!r} is given twice", key.start_mark
                        )
                    seen.add(key.value)
        return super().construct_mapping(node, deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.VERBOSE,
    ),
    list("-+0123456789."),
)
_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in _Loader.yaml_implicit_resolvers.items()
}


def load_yaml(text: str, path: str) -> Any:
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise UserError(f"{path}: not valid YAML ({getattr(err, 'problem', None) or err}{at})") from None


def is_mindspeed_layout(raw: dict) -> bool:
    return "actor_rollout_ref" in raw or isinstance(raw.get("defaults"), list)


MINDSPEED_SECTIONS = (
    "defaults",
    "training",
    "actor_rollout_ref",
    "critic",
    "reward",
    "algorithm",
    "resource_pool",
    "data",
)
ROLE_PLACES = {
    "actor_rollout": "actor_rollout_ref.actor_rollout",
    "ref": "actor_rollout_ref.ref",
    "critic": "critic",
    "reward": "reward",
}
TRAINED = ("actor_rollout", "critic")
ALL = tuple(ROLE_PLACES)
ACTOR = ("actor_rollout",)


@dataclass
class Given:
    name: str
    value: Any
    where: str  # where the user wrote it: "training.lr", "critic.lr", "model/llama32-1b.yaml: bf16"
    own: bool  # in the role's own section (not merged in from training or a model file)


@dataclass(frozen=True)
class Rule:
    roles: tuple[str, ...]  # the roles that read it in MindSpeed's PPO
    apply: Callable[[Translation, str, Given], None]
    source: str  # where MindSpeed-LLM / Megatron reads it (the justification of the mapping)


class Translation:
    """One MindSpeed file into this project's layout (``out``), with lines for the log (``notes``)."""

    def __init__(self, path: str, notes: list[str]) -> None:
        self.path, self.notes, self.sections = path, notes, SECTIONS
        self.out: dict[str, dict] = {name: {} for name in SECTIONS}
        self.origin: dict[tuple[str, str], str] = {}
        self.merged: dict[str, dict[str, Given]] = {}
        self.models: dict[str, str] = {}  # role -> the Hugging Face directory of its ``load``
        self.ranks: dict[str, int] = {}  # role -> processes (MindSpeed's per-rank batch sizes scale by it)
        self.kernels: set[str] = set()

    def fail(self, where: str, message: str) -> UserError:
        return UserError(f"{self.path}: {where}: {message}")

    def note(self, where: str, message: str) -> None:
        line = f"{where}: {message}"
        if line not in self.notes:
            self.notes.append(line)

    def typed(self, g: Given, annotation: Any) -> Any:
        return fields.check_value(g.value, annotation, f"{self.path}: {g.where}")

    def set(self, section: str, name: str, value: Any, where: str) -> None:
        """Our ``section.name`` from ``where``; type-checked against the field, a second different value stops."""
        cls = self.sections[section]
        value = fields.check_value(value, fields.type_hints(cls)[name], f"{self.path}: {where}")
        fields.check_bounds(name, value, fields.field_bounds(cls), f"{self.path}: {where}")
        if (section, name) in self.origin and self.out[section][name] != value:
            first = self.origin[section, name]
            raise self.fail(
                where, f"{value!r} contradicts {first} ({self.out[section][name]!r}): both set {section}.{name}"
            )
        self.out[section][name], self.origin[section, name] = value, where

    def default(self, section: str, name: str, value: Any, why: str) -> None:
        if (section, name) not in self.origin:
            self.out[section][name], self.origin[section, name] = value, why
            self.note(f"{section}.{name}", f"{value!r} ({why})")

    def given(self, role: str, name: str) -> Given | None:
        return self.merged.get(role, {}).get(name)


# ---- the rules ------------------------------------------------------------------------------


def to(field: str, section: str | None = None, convert: Callable[[Any], Any] | None = None):
    """Copy the value to our ``section.field`` (default: the role's own section)."""

    def apply(t: Translation, role: str, g: Given) -> None:
        t.set(section or role, field, g.value if convert is None else convert(g.value), g.where)

    return apply


def same(annotation: Any, ok: Callable[[Any, Translation, str], bool], meaning: str, fix: str):
    """Accepted when ``ok`` (the value means what this trainer does: ``meaning`` goes to the log); else stop."""

    def apply(t: Translation, role: str, g: Given) -> None:
        value = t.typed(g, annotation)
        if not ok(value, t, role):
            raise t.fail(g.where, f"{value!r} cannot take effect here: {fix}")
        t.note(g.where, f"{value!r}: {meaning}")

    return apply


def kernel(t: Translation, role: str, g: Given) -> None:
    t.typed(g, bool | str | int | float)
    t.kernels.add(g.name)


def no_effect(why: str, annotation: Any = bool):
    """Accepted (typed) with ``why`` in the log: in MindSpeed's PPO it changes nothing that differs here."""

    def apply(t: Translation, role: str, g: Given) -> None:
        t.typed(g, annotation)
        t.note(g.where, f"{g.value!r}: {why}")

    return apply


def _parallel(name: str):
    return same(
        int,
        lambda v, t, role: v == 1,
        "no model parallelism, as here",
        f"Megatron's {name} is not available here; set it to 1 and give the role N devices in resource_pool "
        "(with use_ray: N ranks shard its model with FSDP2)",
    )


def _tp(t: Translation, role: str) -> int:
    g = t.given(role, "tensor_model_parallel_size")
    return g.value if g is not None and isinstance(g.value, int) else 1


def _load(t: Translation, role: str, g: Given) -> None:
    value = t.typed(g, str)
    found = resolve_input_path(value)
    if found is None:
        raise t.fail(g.where, f"{value!r} does not exist (looked in: {tried(value)})")
    found = os.path.abspath(found)
    megatron = [n for n in ("latest_checkpointed_iteration.txt", "release") if os.path.exists(os.path.join(found, n))]
    if megatron or glob.glob(os.path.join(found, "iter_*")):
        raise t.fail(
            g.where,
            f"{value!r} is a Megatron checkpoint ({(megatron or ['iter_*'])[0]}); this trainer loads Hugging Face "
            "models: convert it back (MindSpeed-LLM's checkpoint conversion, Megatron-mcore -> Hugging Face) and "
            "give that directory",
        )
    if not os.path.isfile(os.path.join(found, "config.json")):
        raise t.fail(g.where, f"{value!r} has no config.json: give a Hugging Face model directory")
    t.set(role, "model_name_or_path", found, g.where)
    t.models[role] = found
    if role == "reward" and ("reward", "type") not in t.origin:
        t.set("reward", "type", "orm", g.where)
        t.note(g.where, "the reward model (reward.type orm: its score at the last response token, as MindSpeed's)")


def _save(t: Translation, role: str, g: Given) -> None:
    t.set("training", "output_dir", t.typed(g, str), g.where)
    label = "actor" if role == "actor_rollout" else role
    t.note(g.where, f"training.output_dir: the {label} is written to {os.path.join(g.value, label)}/ (Hugging Face)")


def _tokenizer(t: Translation, role: str, g: Given) -> None:
    value = t.typed(g, str)
    if role in ("actor_rollout", "reward"):
        t.set(role, "tokenizer_name_or_path", value, g.where)
        return
    actor = t.given("actor_rollout", "tokenizer_name_or_path")
    if g.own and (actor is None or actor.value != value):
        raise t.fail(g.where, f"{role} reads the actor's token ids, so it uses the actor's tokenizer: remove it")


def _bf16(t: Translation, role: str, g: Given) -> None:
    t.typed(g, bool)  # the roles' values are compared in _precision


def _mini_batch(field: str):
    def apply(t: Translation, role: str, g: Given) -> None:
        per_rank = t.typed(g, int)
        ranks = t.ranks[role]
        t.set(role, field, per_rank * ranks, g.where)
        if ranks > 1:
            t.note(g.where, f"{per_rank} per rank x {ranks} ranks: {field} {per_rank * ranks} (ours counts all ranks)")

    return apply


def _warmup(t: Translation, role: str, g: Given) -> None:
    name = g.name
    if name == "lr_warmup_iters" and t.given(role, "lr_warmup_fraction") is not None:
        t.note(g.where, "no effect: lr_warmup_fraction wins, as in Megatron")
        return
    amount = t.typed(g, float if name == "lr_warmup_fraction" else int)
    iters, batch = t.given(role, "train_iters"), t.given("actor_rollout", "global_batch_size")
    if amount == 0:
        t.set(role, "lr_warmup_steps", 0, g.where)
        return
    if iters is None or batch is None:
        raise t.fail(
            g.where, "a warmup needs training.train_iters and global_batch_size (Megatron counts it in samples)"
        )
    iters, batch = t.typed(iters, int), t.typed(batch, int)
    samples = amount * iters * batch if name == "lr_warmup_fraction" else amount * batch
    # Megatron's scheduler advances by 1 per actor optimizer step, by critic_mini_batch_size per critic step
    mini = t.given("critic", "critic_mini_batch_size")
    increment = 1 if role == "actor_rollout" else (mini.value if mini is not None else 1)
    steps = max(1, round(samples / increment))
    t.set(role, "lr_warmup_steps", steps, g.where)
    t.note(g.where, f"{amount}: {steps} optimizer steps of linear warmup ({samples:g} scheduler samples / {increment})")


def _decay(t: Translation, role: str, g: Given) -> None:
    style = t.typed(g, str)
    if style != "constant":
        raise t.fail(
            g.where,
            f"{style!r}: this trainer's learning rate is constant after the warmup; set lr_decay_style: constant",
        )


def _cliprange_value(value: float) -> float | None:
    return value if value > 0 else None  # critic.py: no clipping unless cliprange_value > 0


def _data_path(t: Translation, role: str, g: Given) -> None:
    value = t.typed(g, str).strip()
    if len(value.split()) > 1:
        raise t.fail(
            g.where,
            f"{value!r} is a Megatron blend (weight prefix ...): give data.train_dataset_path 'a,b' and "
            "data.dataset_probs 'w_a,w_b' instead",
        )
    found = resolve_input_path(value)
    if found is not None and not found.endswith((".bin", ".idx")):
        t.set("data", "train_dataset_path", os.path.abspath(found), g.where)
        return
    bases = [""] if os.path.isabs(value) else search_dirs()
    built = sorted(p for b in bases for p in glob.glob(os.path.join(b, value) + "*") if p.endswith((".bin", ".idx")))
    what = (
        f"is a Megatron preprocessed prefix ({os.path.basename(built[0])}: token ids written by preprocess_data.py)"
        if built
        else f"does not exist (looked in: {tried(value)})"
    )
    raise t.fail(
        g.where,
        f"{value!r} {what}. This trainer reads the prompt records themselves: give as data_path the file that "
        "preprocess_data.py read (JSON lines, JSON, Parquet or a Hugging Face dataset directory: "
        '{"src": prompt, "tgt": reference} or {"prompt", "answer"}), with data.map_keys for other column names '
        "(what --map-keys said)",
    )


def _split(t: Translation, role: str, g: Given) -> None:
    text = str(g.value)
    parts = [p.strip() for p in re.split(r"[,/]", text)]
    try:
        numbers = [float(p) for p in parts]
    except ValueError:
        raise t.fail(g.where, f"{text!r}: expected train,valid,test weights like 100,0,0") from None
    if not numbers or numbers[0] <= 0 or any(n != 0 for n in numbers[1:]):
        raise t.fail(g.where, f"{text!r}: PPO here trains on every prompt of the file and evaluates none: 100,0,0")


def _stage(t: Translation, role: str, g: Given) -> None:
    stage = t.typed(g, str)
    if stage != "ray_ppo":
        hint = " (GRPO: algorithm.adv_estimator grpo with n_samples_per_prompt >= 2)" if stage == "ray_grpo" else ""
        raise t.fail(g.where, f"{stage!r}: this reader runs MindSpeed's PPO (stage ray_ppo){hint}")


def _temperature(t: Translation, role: str, g: Given) -> None:
    t.typed(g, float)  # applied in _sampling, which knows do_sample


ARCHITECTURE: dict[str, tuple[str, Callable[[Any], Any]]] = {
    # Megatron model-file name -> (what config.json calls it, its value there)
    "num_layers": ("num_hidden_layers", lambda c: c.num_hidden_layers),
    "hidden_size": ("hidden_size", lambda c: c.hidden_size),
    "ffn_hidden_size": ("intermediate_size", lambda c: c.intermediate_size),
    "num_attention_heads": ("num_attention_heads", lambda c: c.num_attention_heads),
    "num_query_groups": ("num_key_value_heads", lambda c: c.num_key_value_heads),
    "group_query_attention": (
        "num_key_value_heads < num_attention_heads",
        lambda c: c.num_key_value_heads < c.num_attention_heads,
    ),
    "max_position_embeddings": ("max_position_embeddings", lambda c: c.max_position_embeddings),
    "padded_vocab_size": ("vocab_size", lambda c: c.vocab_size),
    "rotary_base": ("rope_theta", lambda c: _rope(c).get("rope_theta", getattr(c, "rope_theta", None))),
    "norm_epsilon": ("rms_norm_eps", lambda c: getattr(c, "rms_norm_eps", None)),
    "untie_embeddings_and_output_weights": ("not tie_word_embeddings", lambda c: not c.tie_word_embeddings),
    "rope_scaling_type": ("rope_type", lambda c: _rope(c).get("rope_type")),
    "rope_scaling_factor": ("rope factor", lambda c: _rope(c).get("factor")),
    "low_freq_factor": ("low_freq_factor", lambda c: _rope(c).get("low_freq_factor")),
    "high_freq_factor": ("high_freq_factor", lambda c: _rope(c).get("high_freq_factor")),
    "original_max_position_embeddings": (
        "original_max_position_embeddings",
        lambda c: _rope(c).get("original_max_position_embeddings"),
    ),
    "attention_dropout": ("attention_dropout", lambda c: getattr(c, "attention_dropout", 0.0)),
    "hidden_dropout": ("hidden dropout (none in these models)", lambda c: getattr(c, "hidden_dropout", 0.0)),
    "disable_bias_linear": (
        "no attention_bias / mlp_bias",
        lambda c: not (getattr(c, "attention_bias", False) or getattr(c, "mlp_bias", False)),
    ),
    "swiglu": ("hidden_act silu", lambda c: getattr(c, "hidden_act", None) == "silu"),
    "normalization": ("RMSNorm (rms_norm_eps)", lambda c: "RMSNorm" if hasattr(c, "rms_norm_eps") else "LayerNorm"),
    "position_embedding_type": ("rope", lambda c: "rope" if _rope(c) or hasattr(c, "rope_theta") else "absolute"),
}


def _rope(config: Any) -> dict:
    return dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})


def _architecture(t: Translation, role: str, g: Given) -> None:
    t.typed(g, bool | int | float | str)  # compared with config.json once load is known (check_architecture)


KERNELS = (
    "use_flash_attn",
    "use_mc2",
    "use_fused_rmsnorm",
    "use_fused_swiglu",
    "use_fused_rotary_pos_emb",
    "use_rotary_position_embeddings",
    "no_masked_softmax_fusion",
    "attention_softmax_in_fp32",
    "no_gradient_accumulation_fusion",
    "make_vocab_size_divisible_by",
    "init_method_std",
)
HERE = "what this trainer does"
S_INIT = "rlxf/training/initialize.py parse_args_from_config (model < training < role), Megatron validate_args"
S_ACTOR = "rlxf/workers/actor_train_infer.py"
S_CRITIC = "rlxf/workers/critic.py"
S_TRAINER = "rlxf/ray_trainer/ppo_trainer.py"
S_SCHED = "Megatron training.py get_optimizer_param_scheduler / OptimizerParamScheduler"
S_OPT = "Megatron arguments.py _add_regularization_args, optimizer (Adam + clip_grad_norm)"

RULES: dict[str, Rule] = {
    # run: the driver and the actor's data / generation
    "stage": Rule(ALL, _stage, "ray_gpt.py main_task: get_trainer(config.training.stage)"),
    "train_iters": Rule(ALL, to("max_steps", "training"), f"{S_TRAINER} train: while iteration < train_iters"),
    "save_interval": Rule(ALL, to("save_steps", "training"), f"{S_TRAINER} train: iteration % save_interval"),
    "global_batch_size": Rule(
        ACTOR, to("rollout_batch_size", "data"), f"{S_ACTOR} run_inference: gbs // dp prompts per inference rank"
    ),
    "seq_length": Rule(ACTOR, lambda t, r, g: None, f"{S_ACTOR} run_inference: max_new_tokens = seq_length - mpl"),
    "max_prompt_length": Rule(ACTOR, to("max_prompt_length"), f"{S_ACTOR} dataset seq_length=max_prompt_length"),
    "data_path": Rule(ACTOR, _data_path, f"{S_ACTOR} train_valid_test_datasets_provider: data_prefix=data_path"),
    "split": Rule(ACTOR, _split, f"{S_ACTOR} build_blended_mtf_dataset(splits_string=split): only train is read"),
    "no_shuffle": Rule(ACTOR, to("shuffle", "data", lambda v: not v), "mindspeed arguments.py --no-shuffle"),
    "seed": Rule(ALL, to("seed", "training"), "initialize.py _set_random_seed(args.seed); Megatron default 1234"),
    "tokenizer_type": Rule(
        ALL,
        same(str, lambda v, t, r: v == "PretrainedFromHF", "a Hugging Face tokenizer, " + HERE, "PretrainedFromHF"),
        "Megatron build_tokenizer",
    ),
    "tokenizer_name_or_path": Rule(ALL, _tokenizer, "reward.py AutoTokenizer.from_pretrained; actor generation"),
    "is_instruction_dataset": Rule(
        ALL,
        same(bool, lambda v, t, r: v, "prompt records (instruction data), " + HERE, "prompts are instruction data"),
        "mindspeed arguments.py --is-instruction-dataset",
    ),
    "variable_seq_lengths": Rule(ALL, no_effect("sequences are packed without padding here"), "arguments.py"),
    "pad_to_multiple_of": Rule(ALL, no_effect("sequences are packed without padding here", int), S_ACTOR),
    "no_shared_storage": Rule(ALL, no_effect("no data index cache is built here"), "arguments.py _add_dataset_args"),
    "log_interval": Rule(ALL, no_effect("MindSpeed's PPO logs every iteration, as here", int), S_TRAINER),
    "distributed_backend": Rule(
        ALL,
        same(str, lambda v, t, r: v in ("nccl", "hccl", "gloo"), "collectives: gloo for CPU, NCCL for GPU", "nccl"),
        "Megatron init_process_group(backend=distributed_backend)",
    ),
    # the actor: generation and the policy update
    "do_sample": Rule(ACTOR, to("do_sample"), f"{S_ACTOR} generate(do_sample=...); MindSpeed default false"),
    "temperature": Rule(ACTOR, _temperature, f"{S_ACTOR} generate(temperature=...): sampling only"),
    "top_p": Rule(
        ACTOR, no_effect("MindSpeed's PPO does not pass it to generate (no filtering), as here", float), S_ACTOR
    ),
    "top_k": Rule(
        ACTOR, no_effect("MindSpeed's PPO does not pass it to generate (no filtering), as here", int), S_ACTOR
    ),
    "num_samples_per_step": Rule(
        ACTOR,
        no_effect(
            "prompts per generate call on an inference rank (memory/speed, not samples per prompt); here a rank "
            "generates its share of the step in one call",
            int,
        ),
        f"{S_ACTOR} run_inference: num_infer_steps = gbs // (dp * num_samples_per_step)",
    ),
    "n_samples_per_prompt": Rule(
        ACTOR, to("num_samples_per_step"), f"{S_ACTOR} run_inference: each prompt repeated n_samples_per_prompt times"
    ),
    "use_kv_cache": Rule(ACTOR, no_effect("generation here always uses the KV cache (same tokens)"), S_ACTOR),
    "ppo_mini_batch_size": Rule(ACTOR, _mini_batch("ppo_mini_batch_size"), f"{S_ACTOR} make_minibatch_iterator"),
    "ppo_epochs": Rule(ACTOR, to("ppo_epochs"), f"{S_ACTOR} make_minibatch_iterator(epochs=ppo_epochs)"),
    "clip_ratio": Rule(ACTOR, to("clip_ratio"), "core_algos.py compute_policy_loss(cliprange=clip_ratio)"),
    "shuffle_minibatch": Rule(ACTOR, to("shuffle_minibatch"), f"{S_ACTOR} dataloader_kwargs shuffle"),
    "entropy_coeff": Rule(
        ACTOR,
        no_effect("MindSpeed's PPO loss (loss_func_ppo) has no entropy term, so neither has this run", float),
        f"{S_ACTOR} loss_func_ppo: policy_loss = pg_loss",
    ),
    "num_gpus_for_train": Rule(ACTOR, lambda t, r, g: None, "initialize.py TRAIN_SIZE + INFER_SIZE == actor pool"),
    "num_gpus_for_infer": Rule(ACTOR, lambda t, r, g: None, "initialize.py: the actor's inference group"),
    # the critic
    "cliprange_value": Rule(("critic",), to("cliprange_value", convert=_cliprange_value), f"{S_CRITIC} loss_func"),
    "critic_mini_batch_size": Rule(("critic",), _mini_batch("critic_mini_batch_size"), f"{S_CRITIC} (per rank)"),
    "critic_update_epochs": Rule(("critic",), to("critic_update_epochs"), f"{S_CRITIC} make_minibatch_iterator"),
    # every role
    "load": Rule(ALL, _load, "Megatron load_checkpoint(args.load) in each worker"),
    "micro_batch_size": Rule(ALL, to("micro_batch_size"), "forward_backward_batch: split by micro_batch_size"),
    "bf16": Rule(ALL, _bf16, "Megatron --bf16 per role"),
    "fp16": Rule(
        ALL,
        same(bool, lambda v, t, r: not v, "not fp16", "fp16 with loss scaling is not available here: use bf16"),
        "Megatron --fp16",
    ),
    "tensor_model_parallel_size": Rule(ALL, _parallel("tensor parallelism"), S_INIT),
    "pipeline_model_parallel_size": Rule(ALL, _parallel("pipeline parallelism"), S_INIT),
    "context_parallel_size": Rule(ALL, _parallel("context parallelism"), S_INIT),
    "expert_model_parallel_size": Rule(ALL, _parallel("expert parallelism"), S_INIT),
    "sequence_parallel": Rule(
        ALL,
        same(
            bool,
            lambda v, t, r: not v or _tp(t, r) == 1,
            "off (Megatron turns it off at tensor_model_parallel_size 1)",
            "sequence parallelism needs Megatron tensor parallelism: set it false",
        ),
        "Megatron validate_args: sequence_parallel = False when tensor_model_parallel_size == 1",
    ),
    "use_mcore_models": Rule(
        ALL,
        same(
            bool,
            lambda v, t, r: v,
            "the transformer of the checkpoint in load (MindSpeed's PPO builds mcore models only)",
            "MindSpeed's PPO needs mcore models (critic.py raises otherwise): set it true",
        ),
        f"{S_CRITIC} model_provider: 'supports mcore only'",
    ),
    "no_load_optim": Rule(ALL, no_effect("load gives the weights only, " + HERE), "Megatron load_checkpoint"),
    "no_load_rng": Rule(ALL, no_effect("load gives the weights only, " + HERE), "Megatron load_checkpoint"),
    "finetune": Rule(
        ALL,
        same(
            bool,
            lambda v, t, r: v,
            "start at step 0 from the weights in load, " + HERE,
            "resume with training.resume_from_checkpoint instead (finetune: true)",
        ),
        "Megatron --finetune",
    ),
    # the trained roles' optimizer and schedule
    "lr": Rule(TRAINED, to("learning_rate"), f"{S_SCHED}: max_lr=args.lr"),
    "lr_decay_style": Rule(TRAINED, _decay, f"{S_SCHED}; Megatron default linear"),
    "min_lr": Rule(TRAINED, no_effect("only a decaying schedule reaches it; constant keeps lr", float), S_SCHED),
    "lr_decay_iters": Rule(TRAINED, no_effect("only a decaying schedule uses it", int), S_SCHED),
    "lr_warmup_fraction": Rule(TRAINED, _warmup, f"{S_SCHED}: fraction x train_iters x gbs samples"),
    "lr_warmup_iters": Rule(TRAINED, _warmup, f"{S_SCHED}: lr_warmup_iters x gbs samples"),
    "lr_warmup_init": Rule(
        TRAINED,
        same(float, lambda v, t, r: v == 0, "warmup from 0, " + HERE, "warmup starts from 0 here: set 0.0"),
        S_SCHED,
    ),
    "weight_decay": Rule(TRAINED, to("weight_decay"), f"{S_OPT}; Megatron default 0.01"),
    "clip_grad": Rule(TRAINED, to("max_grad_norm"), f"{S_OPT} (global L2 norm)"),
    "adam_beta1": Rule(TRAINED, to("adam_beta1"), S_OPT),
    "adam_beta2": Rule(TRAINED, to("adam_beta2"), S_OPT),
    "adam_eps": Rule(TRAINED, to("adam_epsilon"), S_OPT),
    "optimizer": Rule(
        TRAINED, same(str, lambda v, t, r: v == "adam", "AdamW, " + HERE, "only adam (AdamW) here"), S_OPT
    ),
    "use_distributed_optimizer": Rule(
        TRAINED, no_effect("a role on N devices shards its optimizer state with FSDP2 here"), "Megatron"
    ),
    "save": Rule(TRAINED, _save, "Megatron save_checkpoint(args.save) from ppo_trainer.py"),
    "recompute_granularity": Rule(
        TRAINED,
        lambda t, r, g: _recompute(t, r, g),
        "Megatron --recompute-granularity full: whole layers recomputed",
    ),
    "recompute_method": Rule(TRAINED, no_effect("every decoder layer is checkpointed here", str), "Megatron"),
    "recompute_num_layers": Rule(TRAINED, no_effect("every decoder layer is checkpointed here", int), "Megatron"),
    **{
        name: Rule(
            TRAINED, no_effect("Megatron scales losses only with fp16", float), "Megatron get_megatron_optimizer"
        )
        for name in ("initial_loss_scale", "loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis")
    },
    # model files: the architecture is the checkpoint's (config.json), checked; kernel choices
    **{name: Rule(ALL, _architecture, "configs/rlxf/model/*.yaml -> Megatron model") for name in ARCHITECTURE},
    **{name: Rule(ALL, kernel, "Megatron / MindSpeed kernel choice") for name in KERNELS},
}


def _recompute(t: Translation, role: str, g: Given) -> None:
    value = t.typed(g, str)
    if value != "full":
        raise t.fail(g.where, f"{value!r}: only full recomputation (every decoder layer) is available here")
    t.set("training", "gradient_checkpointing", True, g.where)


# ---- the translation ------------------------------------------------------------------------


def _model_files(t: Translation, defaults: Any, directory: str) -> dict[str, tuple[str, dict]]:
    """hydra's defaults list: ``{model: [name, ...]}`` entries load ``model/<name>.yaml`` beside the file;
    each holds ``{name: {Megatron arguments}}``."""
    if defaults is None:
        return {}
    if not isinstance(defaults, list):
        raise t.fail("defaults", "must be a list like [{model: [llama32-1b]}] (hydra's defaults list)")
    models: dict[str, tuple[str, dict]] = {}
    for entry in defaults:
        if entry == "_self_":
            continue
        if not isinstance(entry, dict) or set(entry) != {"model"}:
            raise t.fail("defaults", f"{entry!r}: only the model group is read ({{model: [name, ...]}})")
        names = entry["model"] if isinstance(entry["model"], list) else [entry["model"]]
        for name in names:
            if not isinstance(name, str):
                raise t.fail("defaults", f"model {name!r}: give the model file's name (model/<name>.yaml)")
            rel = os.path.join("model", f"{name}.yaml")
            file = os.path.join(directory, rel)
            if not os.path.isfile(file):
                raise t.fail("defaults", f"model {name!r}: no file {file}")
            with open(file, encoding="utf-8") as f:
                content = load_yaml(f.read(), file)
            if not isinstance(content, dict) or not all(isinstance(v, dict) for v in content.values()):
                raise UserError(f"{file}: must hold {{model name: {{Megatron arguments}}}}, like {{{name}: {{...}}}}")
            models.update({key: (f"{rel}: {key}", value) for key, value in content.items()})
    return models


def _ours(t: Translation, section: str) -> set[str]:
    return set(fields.init_fields(t.sections[section]))


def _merge(t: Translation, raw: dict, models: dict) -> None:
    """Each role's arguments, model file < training < own section; our own names go straight to ``out``."""
    training = raw.get("training") or {}
    if not isinstance(training, dict):
        raise t.fail("training", "must be a mapping of Megatron arguments")
    shared = {}
    for key, value in training.items():
        if key in RULES:
            shared[key] = Given(key, value, f"training.{key}", False)
        elif key in _ours(t, "training"):
            t.set("training", key, value, f"training.{key}")
        else:
            valid = [*RULES, *_ours(t, "training")]
            raise t.fail(f"training.{key}", f"unknown name; closest valid names: {closest(str(key), valid)}")
    pair = raw.get("actor_rollout_ref")
    if not isinstance(pair, dict) or "actor_rollout" not in pair:
        raise t.fail("actor_rollout_ref", "must hold actor_rollout: {...} (and ref: {...})")
    for key in pair:
        if key not in ("actor_rollout", "ref"):
            raise t.fail(f"actor_rollout_ref.{key}", "unknown role; actor_rollout_ref holds actor_rollout and ref")
    sections = {
        "actor_rollout": pair["actor_rollout"],
        "ref": pair.get("ref"),
        **{r: raw.get(r) for r in ("critic", "reward")},
    }
    for role, own in sections.items():
        place = ROLE_PLACES[role]
        own = {} if own is None else own
        if not isinstance(own, dict):
            raise t.fail(place, "must be a mapping of arguments")
        merged: dict[str, Given] = {}
        if "model" in own:
            name = own["model"]
            if name not in models:
                raise t.fail(f"{place}.model", f"{name!r} is not among the model files in defaults ({sorted(models)})")
            where, values = models[name]
            merged.update({k: Given(k, v, f"{where}.{k}", False) for k, v in values.items()})
        merged.update(shared)
        for key, value in own.items():
            if key == "model":
                continue
            if key in RULES:
                merged[key] = Given(key, value, f"{place}.{key}", True)
            elif key in _ours(t, role):
                t.set(role, key, value, f"{place}.{key}")
            else:
                valid = [*RULES, *_ours(t, role)]
                raise t.fail(f"{place}.{key}", f"unknown name; closest valid names: {closest(str(key), valid)}")
        for key, g in merged.items():
            if key not in RULES:
                raise t.fail(g.where, f"unknown name; closest valid names: {closest(str(key), RULES)}")
        t.merged[role] = merged


def _pool(t: Translation, raw: Any) -> None:
    """``resource_pool``: a list of devices per node for each role (RayResourcePool(process_on_nodes)); the
    actor's split into training and generation devices by num_gpus_for_train / num_gpus_for_infer."""
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise t.fail("resource_pool", "must be a mapping")
    counts: dict[str, float] = {}
    for key, value in raw.items():
        where = f"resource_pool.{key}"
        if key in ALL and isinstance(value, list):
            per_node = fields.check_value(value, list[int], f"{t.path}: {where}")
            if not per_node or min(per_node) < 1:
                raise t.fail(where, f"{value}: devices on each node, each >= 1 (e.g. [2], or [8, 8] on two nodes)")
            counts[key] = sum(per_node)
            if len(per_node) > 1:
                t.note(
                    where, f"{value}: {sum(per_node)} devices; one placement group packs them onto as few nodes as fit"
                )
        elif key in _ours(t, "resource_pool"):
            t.set("resource_pool", key, value, where)
            if key in ALL:
                counts[key] = t.out["resource_pool"][key]
        else:
            raise t.fail(where, f"unknown name; closest valid names: {closest(str(key), _ours(t, 'resource_pool'))}")
    train, infer = t.given("actor_rollout", "num_gpus_for_train"), t.given("actor_rollout", "num_gpus_for_infer")
    if (train is None) != (infer is None):
        given = train or infer
        raise t.fail(given.where, "give both num_gpus_for_train and num_gpus_for_infer (MindSpeed needs both)")
    actor = counts.get("actor_rollout", 1)
    if train is not None:
        n_train, n_infer = t.typed(train, int), t.typed(infer, int)
        if n_train < 1 or n_infer < 0 or n_train + n_infer != actor:
            raise t.fail(
                train.where,
                f"{n_train} + num_gpus_for_infer {n_infer} must be resource_pool.actor_rollout ({actor}): MindSpeed "
                "splits the actor's devices into a training and an inference group",
            )
        actor = n_train
        if n_infer:
            t.set("resource_pool", "rollout", n_infer, infer.where)
            t.note(infer.where, f"{n_infer}: resource_pool.rollout, a generation copy synced after every update")
    for role in ALL:
        amount = actor if role == "actor_rollout" else counts.get(role, 1)
        t.set("resource_pool", role, amount, f"resource_pool.{role}")
    t.ranks = {role: int(a) if a >= 1 else 1 for role, a in ((r, t.out["resource_pool"][r]) for r in ALL)}
    if ("resource_pool", "device") not in t.origin:
        import torch

        t.default(
            "resource_pool",
            "device",
            "gpu" if torch.cuda.is_available() else "cpu",
            "MindSpeed counts accelerators: gpu when this machine has CUDA, else cpu",
        )
    pool = t.out["resource_pool"]
    spread = pool.get("rollout", 0) > 0 or any(pool[r] != 1 for r in ALL)
    t.default(
        "resource_pool",
        "use_ray",
        pool["device"] == "gpu" or spread,
        "MindSpeed runs its roles on Ray; one process when every role has one CPU device",
    )


def _precision(t: Translation) -> None:
    def bf16(role: str) -> bool:
        g = t.given(role, "bf16")
        return bool(g is not None and g.value)

    if bf16("actor_rollout") != bf16("critic"):
        raise t.fail("bf16", "actor_rollout and critic differ: the trained models share training.bf16 here")
    t.set("training", "bf16", bf16("actor_rollout"), "bf16 of actor_rollout and critic")
    for role in ("ref", "reward"):
        if bf16(role) != bf16("actor_rollout"):
            t.set(role, "dtype", "bfloat16" if bf16(role) else "float32", f"{ROLE_PLACES[role]}.bf16")


def _sampling(t: Translation) -> None:
    """MindSpeed's generation samples at ``temperature`` (default 0.7) only with do_sample (default false);
    its log-probs are always at temperature 1."""
    t.default("actor_rollout", "do_sample", False, "MindSpeed default: --do-sample not given")
    g = t.given("actor_rollout", "temperature")
    if not t.out["actor_rollout"]["do_sample"]:
        if g is not None:
            t.note(g.where, f"{g.value}: no effect with do_sample false (greedy), as in MindSpeed")
        t.set("actor_rollout", "temperature", 1.0, "greedy generation (log-probs at temperature 1, as MindSpeed's)")
        return
    value = g.value if g is not None else 0.7
    t.set("actor_rollout", "temperature", value, g.where if g else "MindSpeed default temperature 0.7")
    if value != 1.0:
        t.note(
            "temperature",
            f"{value}: sampling and log-probs at {value} here (MindSpeed samples at it but scores log-probs at 1)",
        )


def check_architecture(t: Translation) -> None:
    """The model file describes the model; here the checkpoint's config.json does: they must agree."""
    from transformers import AutoConfig

    for role, directory in t.models.items():
        config = None
        for name, g in t.merged[role].items():
            if name not in ARCHITECTURE:
                continue
            config = config or AutoConfig.from_pretrained(directory)
            label, read = ARCHITECTURE[name]
            have = read(config)
            want = g.value
            equal = (
                math.isclose(float(want), float(have), rel_tol=1e-9)
                if isinstance(want, (int, float)) and not isinstance(want, bool) and isinstance(have, (int, float))
                else want == have
            )
            if not equal:
                raise t.fail(
                    g.where,
                    f"{want!r} but {directory}/config.json has {label} = {have!r}: the model file must describe the "
                    f"checkpoint in {ROLE_PLACES[role]}.load",
                )


def translate(raw: dict, path: str, found: str, notes: list[str]) -> dict:
    """A MindSpeed-layout config (hydra YAML or the same in JSON) as a dict in this project's layout."""
    t = Translation(path, notes)
    for key in raw:
        if key not in MINDSPEED_SECTIONS:
            inside = (
                " (in MindSpeed's layout it goes inside actor_rollout_ref)" if key in ("actor_rollout", "ref") else ""
            )
            raise t.fail(key, f"unknown section{inside}; closest valid names: {closest(str(key), MINDSPEED_SECTIONS)}")
    _merge(t, raw, _model_files(t, raw.get("defaults"), os.path.dirname(os.path.abspath(found))))
    _pool(t, raw.get("resource_pool"))
    for role, merged in t.merged.items():
        # the parallel sizes first: a refused one explains the settings that depend on it (sequence_parallel)
        for name, g in sorted(merged.items(), key=lambda item: not item[0].endswith("_parallel_size")):
            rule = RULES[name]
            if role not in rule.roles:
                if g.own:
                    readers = " and ".join(ROLE_PLACES[r] for r in rule.roles)
                    raise t.fail(
                        g.where, f"MindSpeed's PPO reads {name} only in {readers}: move it there (or to training)"
                    )
                continue  # merged in from training or a model file for the roles that read it
            rule.apply(t, role, g)
    seq = t.given("actor_rollout", "seq_length")
    if seq is not None:
        length = t.typed(seq, int) - t.out["actor_rollout"].get("max_prompt_length", 512)
        if length < 1:
            raise t.fail(seq.where, f"{seq.value} leaves no room for a response after max_prompt_length")
        t.set("actor_rollout", "max_response_length", length, f"{seq.where} - max_prompt_length")
    _precision(t)
    _sampling(t)
    # MindSpeed's defaults where they differ from ours (mindspeed_llm/training/arguments.py, Megatron arguments.py)
    t.default("actor_rollout", "shuffle_minibatch", False, "MindSpeed default: --shuffle-minibatch not given")
    t.default("actor_rollout", "ppo_mini_batch_size", t.ranks["actor_rollout"], "MindSpeed default 1 per rank")
    t.default("critic", "critic_mini_batch_size", t.ranks["critic"], "MindSpeed default 1 per rank")
    t.default("training", "seed", 1234, "Megatron default")
    algorithm = raw.get("algorithm") if isinstance(raw.get("algorithm"), dict) else {}
    for role in TRAINED if algorithm.get("adv_estimator", "gae") == "gae" else ACTOR:
        t.default(role, "weight_decay", 0.01, "Megatron default")
        if t.given(role, "lr_decay_style") is None:
            raise t.fail(
                ROLE_PLACES[role],
                "lr_decay_style is not set, and Megatron's default is linear decay, which this trainer does not do: "
                "set lr_decay_style: constant",
            )
    if "reward" not in t.models and ("reward", "type") not in t.origin:
        raise t.fail("reward", "give load (the reward model), or our type: rule with rule: module:function")
    check_architecture(t)
    if t.kernels:
        t.note(
            "kernels",
            f"{', '.join(sorted(t.kernels))}: Megatron/Ascend kernel choices; the Hugging Face model "
            "computes the same function with its own",
        )
    for section in ("algorithm", "data"):
        values = raw.get(section) or {}
        if not isinstance(values, dict):
            raise t.fail(section, "must be a mapping")
        for key, value in values.items():
            if key in _ours(t, section):
                t.set(section, key, value, f"{section}.{key}")
            else:
                t.out[section][key] = value  # the section's own check names the closest valid keys
    return {name: values for name, values in t.out.items() if values}
