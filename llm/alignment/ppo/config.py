"""PPO configuration in MindSpeed-LLM's layout: ``training`` defaults that roles override, one section
per role, ``algorithm``, ``resource_pool`` and ``data``. Every section is a dataclass; unknown keys stop
the run naming the section, the key and the closest valid names.

Command line: ``--section.field value`` (``--actor_rollout.learning_rate 1e-6``); a bare
``--field value`` sets a ``training`` field.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from llm.alignment.ppo.algorithm import ADV_ESTIMATORS, KL_KINDS
from llm.utils.errors import UserError, closest


@dataclass
class TrainingSection:
    """Shared defaults; each role section may override the optimisation fields."""

    output_dir: str = "output/ppo"
    seed: int = 42
    learning_rate: float = 1e-6
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0
    lr_warmup_steps: int = 0
    max_steps: int = 100
    logging_steps: int = 1
    save_steps: int = 0
    save_total_limit: int | None = None
    resume_from_checkpoint: str | None = None
    bf16: bool = False
    gradient_checkpointing: bool = field(
        default=False,
        metadata={
            "help": "activation checkpointing of actor and critic in their update forwards (transformers' "
            "non-reentrant checkpointing): activations are recomputed in backward instead of stored"
        },
    )
    adam_offload: bool = field(
        default=False,
        metadata={
            "help": "keep the AdamW state of actor and critic (fp32 master weights and both moments, ~12 B/param) "
            "in host memory and run the optimizer step there: gradients are copied to the host, the new weights "
            "back. Nothing to move when the role runs on the CPU (noted in the log)"
        },
    )
    report_to: str = "tensorboard"
    disable_tqdm: bool = False
    micro_batch_size: int = 8


@dataclass
class ModelSection:
    model_name_or_path: str | None = None
    tokenizer_name_or_path: str | None = None
    init_from_config: bool = False


@dataclass
class ActorRolloutSection(ModelSection):
    learning_rate: float | None = None
    do_sample: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_prompt_length: int = 512
    max_response_length: int = 256
    num_samples_per_step: int = 1
    ppo_mini_batch_size: int = 8
    ppo_epochs: int = 1
    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    shuffle_minibatch: bool = True
    entropy_coeff: float = 0.0
    ignore_eos: bool = False  # generate max_response_length tokens regardless of EOS (benchmarks)
    gather_weights_for_generation: bool = field(
        default=True,
        metadata={
            "help": "an actor (or rollout copy) sharded over an FSDP2 group all-gathers its full weights once per "
            "generate call and keeps them while decoding, instead of at every decoding step: every rank then "
            "holds the whole model during generation; false for a model whose full weights do not fit one device"
        },
    )
    rollout_log_probs: bool = field(
        default=False,
        metadata={
            "help": "take the actor's old log-probs from the logits that generation computes anyway (as TRL "
            "does) instead of a separate packed forward after it: one actor forward less per step. The two "
            "differ by float rounding (KV-cached vs full forward; ~1e-6 in fp32, more in bf16). Not with "
            "kl_penalty 'full', which needs the actor's whole distribution: that keeps the forward"
        },
    )
    num_gpus_for_train: int = 1
    num_gpus_for_infer: int = 1


@dataclass
class CriticSection(ModelSection):
    learning_rate: float | None = None
    cliprange_value: float | None = 0.2
    critic_mini_batch_size: int = 8
    critic_update_epochs: int = 1
    value_loss_coef: float = 1.0


@dataclass
class FrozenModelSection(ModelSection):
    """A role whose model is not trained (reference, reward)."""

    dtype: str | None = field(
        default=None,
        metadata={
            "help": "weights of this frozen model: float32 or bfloat16 (half the memory, scores to bf16 "
            "precision); null: as the trained models (bfloat16 with training.bf16, else float32)"
        },
    )
    offload: bool = field(
        default=False,
        metadata={
            "help": "keep this frozen model in host memory between its forwards, moving it to its device for "
            "each call and back after; nothing to move when it runs on the CPU (noted in the log)"
        },
    )


@dataclass
class RefSection(FrozenModelSection):
    pass


@dataclass
class RewardSection(FrozenModelSection):
    type: str = "rule"  # orm | prm | rule | http
    rule: str = "llm.alignment.ppo.rules:math_exact_match"
    url: str | None = None
    timeout: float = 30.0
    step_separator: str = "\n"
    placeholder_token: str = "ки"
    reward_tokens: str = "+,-"
    prm_aggregation: str = "dense"  # dense | min | last | mean
    normalize_reward: bool = False
    reward_clip: float | None = None


@dataclass
class KLCtrlSection:
    type: str = "fixed"
    kl_coef: float = 0.05
    target_kl: float = 6.0
    horizon: float = 10000.0


@dataclass
class AlgorithmSection:
    adv_estimator: str = "gae"
    gamma: float = 1.0
    lam: float = 0.95
    kl_penalty: str = "kl"
    use_kl_in_reward: bool = True
    kl_loss_coef: float = 0.0  # > 0: KL as a loss term (GRPO style) instead of / besides the reward
    kl_ctrl: KLCtrlSection = field(default_factory=KLCtrlSection)
    whiten_advantages: bool = True
    missing_eos_penalty: float | None = None


@dataclass
class DataSection:
    train_dataset_path: str | None = None
    dev_dataset_path: str | None = None
    dataset_probs: str | None = None
    rollout_batch_size: int = 8  # prompts per step
    use_chat_template: bool = False


ROLES = ("actor_rollout", "ref", "critic", "reward")


def _help(default: Any, text: str) -> Any:
    return field(default=default, metadata={"help": text})


@dataclass
class ResourcePool:
    """Where the roles run. Default: all four in this process (every amount 1, ``use_ray`` false).

    With ``use_ray`` each role, or each ``colocate`` group, runs in Ray actor processes placed through
    one placement group: one process for a share of a device (< 1) or one device, N processes forming
    an FSDP2 group for N devices. The amounts count ``device`` units.
    """

    actor_rollout: float = _help(
        1,
        "devices for the actor (its training and, without a rollout copy, its generation); with Ray < 1 is a "
        "share of one device and N > 1 a group of N actors sharding the model with FSDP2",
    )
    ref: float = _help(1, "devices for the frozen reference policy (Ray: a share < 1, or N > 1 for FSDP2)")
    critic: float = _help(1, "devices for the critic, value model and optimizer (Ray: a share < 1, or N > 1 for FSDP2)")
    reward: float = _help(1, "devices for the reward role: model, rule or HTTP client (Ray: a share < 1, or N > 1)")
    rollout: float = _help(
        0,
        "devices for a separate generation copy of the actor that receives its weights after every update "
        "(Ray; bounded by weight_sync_timeout); 0: the actor generates with its own weights",
    )
    use_ray: bool = _help(False, "run the roles in Ray actors (pip install ray); false: all roles in this process")
    device: str = _help(
        "cpu", "what the amounts count and where role models run: cpu (Ray CPUs) or gpu (Ray GPUs, models on CUDA)"
    )
    colocate: list[list[str]] = field(
        default_factory=list,
        metadata={
            "help": 'groups of roles sharing one Ray actor process and its devices, e.g. [["actor_rollout", '
            '"ref"], ["critic", "reward"]]; the members of a group need equal amounts'
        },
    )
    address: str | None = _help(
        None,
        "Ray cluster: null joins the cluster `ray start` made on this node (else starts a local one); 'auto' "
        "must find a running cluster; 'HOST:PORT' the head node of a cluster",
    )
    call_timeout: float = _help(
        1800.0, "seconds a role call (build, generate, score, update, save) may take before the run stops naming it"
    )
    weight_sync_timeout: float = _help(
        300.0, "seconds the actor -> rollout copy weight sync may take before the run stops naming it"
    )
    concurrent_roles: bool = _help(
        True,
        "with Ray: the independent calls of a phase run at the same time in their own actors (scoring: actor "
        "and reference log-probs, values, reward; update: actor and critic); colocated roles still take turns "
        "in their shared process. Same numbers either way; false: one call after another",
    )

    def amount(self, role: str) -> float:
        return getattr(self, role)


SECTIONS: dict[str, type] = {
    "training": TrainingSection,
    "actor_rollout": ActorRolloutSection,
    "critic": CriticSection,
    "ref": RefSection,
    "reward": RewardSection,
    "algorithm": AlgorithmSection,
    "data": DataSection,
    "resource_pool": ResourcePool,
}


@dataclass
class PPOConfig:
    training: TrainingSection
    actor_rollout: ActorRolloutSection
    critic: CriticSection
    ref: RefSection
    reward: RewardSection
    algorithm: AlgorithmSection
    data: DataSection
    resource_pool: ResourcePool
    defaults: dict = field(default_factory=dict)

    @property
    def clip_low(self) -> float:
        a = self.actor_rollout
        return a.clip_ratio if a.clip_ratio_low is None else a.clip_ratio_low

    @property
    def clip_high(self) -> float:
        a = self.actor_rollout
        return a.clip_ratio if a.clip_ratio_high is None else a.clip_ratio_high

    def lr(self, role: str) -> float:
        value = getattr(self, role).learning_rate
        return self.training.learning_rate if value is None else value

    @property
    def uses_critic(self) -> bool:
        return self.algorithm.adv_estimator == "gae"


def _build(cls: type, values: dict, where: str) -> Any:
    if not isinstance(values, dict):
        raise UserError(f"{where}: must be a JSON object")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in values.items():
        if key not in fields:
            raise UserError(f"{where}: unknown key {key!r}; closest valid names: {closest(key, fields)}")
        factory = fields[key].default_factory
        if isinstance(factory, type) and dataclasses.is_dataclass(factory):
            value = _build(factory, value, f"{where}.{key}")
        kwargs[key] = value
    try:
        return cls(**kwargs)
    except TypeError as err:
        raise UserError(f"{where}: {err}") from None


def _coerce(text: str, current: Any) -> Any:
    if isinstance(current, bool):
        if text.lower() in ("true", "1", "yes"):
            return True
        if text.lower() in ("false", "0", "no"):
            return False
        raise UserError(f"expected true or false, got {text!r}")
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_ppo_config(argv: list[str]) -> PPOConfig:
    if not argv or not argv[0].endswith(".json"):
        raise UserError("usage: run_ppo.py CONFIG.json [--section.field value ...]")
    path = argv[0]
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise UserError(f"{path}: no such file") from None
    except json.JSONDecodeError as err:
        raise UserError(f"{path}: not valid JSON ({err.msg} at line {err.lineno}, column {err.colno})") from None
    if not isinstance(raw, dict):
        raise UserError(f"{path}: must hold one JSON object with sections {', '.join(SECTIONS)}")
    for key in raw:
        if key not in SECTIONS and key != "defaults":
            raise UserError(
                f"{path}: unknown section {key!r}; closest valid names: {closest(key, [*SECTIONS, 'defaults'])}"
            )
    sections = {name: _build(cls, raw.get(name, {}), f"{path}: {name}") for name, cls in SECTIONS.items()}
    cli = argv[1:]
    if len(cli) % 2:
        raise UserError("command line: give --section.field value pairs")
    for flag, text in zip(cli[::2], cli[1::2]):
        if not flag.startswith("--"):
            raise UserError(f"command line: expected --section.field, got {flag!r}")
        name = flag[2:]
        section, _, key = name.rpartition(".")
        section = section or "training"
        if section == "algorithm.kl_ctrl":
            target = sections["algorithm"].kl_ctrl
        elif section in sections:
            target = sections[section]
        else:
            raise UserError(f"command line: unknown section {section!r}; closest: {closest(section, SECTIONS)}")
        if not hasattr(target, key):
            valid = [f.name for f in dataclasses.fields(target)]
            raise UserError(f"command line: {section} has no field {key!r}; closest valid names: {closest(key, valid)}")
        setattr(target, key, _coerce(text, getattr(target, key)))
    config = PPOConfig(**sections, defaults=raw.get("defaults", {}))
    validate_ppo_config(config, path)
    return config


def validate_ppo_config(c: PPOConfig, path: str) -> None:
    a, alg = c.actor_rollout, c.algorithm
    if alg.adv_estimator not in ADV_ESTIMATORS:
        raise UserError(f"{path}: algorithm.adv_estimator must be one of {ADV_ESTIMATORS}, got {alg.adv_estimator!r}")
    if alg.kl_penalty not in KL_KINDS:
        raise UserError(f"{path}: algorithm.kl_penalty must be one of {KL_KINDS}, got {alg.kl_penalty!r}")
    if alg.kl_ctrl.type not in ("fixed", "adaptive"):
        raise UserError(f"{path}: algorithm.kl_ctrl.type must be fixed or adaptive, got {alg.kl_ctrl.type!r}")
    if c.reward.type not in ("orm", "prm", "rule", "http"):
        raise UserError(f"{path}: reward.type must be orm, prm, rule or http, got {c.reward.type!r}")
    if c.reward.prm_aggregation not in ("dense", "min", "last", "mean"):
        raise UserError(f"{path}: reward.prm_aggregation must be dense, min, last or mean")
    if c.reward.type in ("orm", "prm") and not c.reward.model_name_or_path:
        raise UserError(f"{path}: reward.type={c.reward.type!r} needs reward.model_name_or_path")
    if c.reward.type == "http" and not c.reward.url:
        raise UserError(f"{path}: reward.type='http' needs reward.url")
    if not a.model_name_or_path:
        raise UserError(f"{path}: actor_rollout.model_name_or_path is required (the SFT model)")
    if not c.data.train_dataset_path:
        raise UserError(f"{path}: data.train_dataset_path is required (a prompt file)")
    batch = c.data.rollout_batch_size * a.num_samples_per_step
    for name, size in (
        ("actor_rollout.ppo_mini_batch_size", a.ppo_mini_batch_size),
        ("critic.critic_mini_batch_size", c.critic.critic_mini_batch_size),
    ):
        if size <= 0 or batch % size:
            raise UserError(f"{path}: {name}={size} must divide rollout_batch_size x num_samples_per_step = {batch}")
    if alg.adv_estimator in ("grpo", "rloo") and a.num_samples_per_step < 2:
        raise UserError(f"{path}: adv_estimator={alg.adv_estimator!r} needs actor_rollout.num_samples_per_step >= 2")
    if not a.do_sample and a.num_samples_per_step > 1:
        raise UserError(
            f"{path}: num_samples_per_step > 1 with do_sample false gives identical samples: set do_sample true"
        )
    validate_memory(c, path)
    validate_resource_pool(c.resource_pool, path)


FROZEN_DTYPES = ("float32", "bfloat16")


def validate_memory(c: PPOConfig, path: str) -> None:
    """The memory savers: booleans, and the frozen roles' dtypes."""
    for name in ("gradient_checkpointing", "adam_offload"):
        if not isinstance(getattr(c.training, name), bool):
            raise UserError(f"{path}: training.{name} must be true or false, got {getattr(c.training, name)!r}")
    for role in ("ref", "reward"):
        section = getattr(c, role)
        if section.dtype is not None and section.dtype not in FROZEN_DTYPES:
            raise UserError(
                f"{path}: {role}.dtype must be float32, bfloat16 or null (as the trained models), got {section.dtype!r}"
            )
        if not isinstance(section.offload, bool):
            raise UserError(f"{path}: {role}.offload must be true or false, got {section.offload!r}")
    if c.reward.type in ("rule", "http"):
        for name, value, default in (("dtype", c.reward.dtype, None), ("offload", c.reward.offload, False)):
            if value != default:
                raise UserError(
                    f"{path}: reward.{name} applies to a reward model (type orm or prm); reward.type is "
                    f"{c.reward.type!r}, which has none"
                )


def validate_resource_pool(pool: ResourcePool, path: str) -> None:
    if not isinstance(pool.use_ray, bool):
        raise UserError(f"{path}: resource_pool.use_ray must be true or false, got {pool.use_ray!r}")
    for role in (*ROLES, "rollout"):
        amount = pool.amount(role)
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or amount < 0:
            raise UserError(f"{path}: resource_pool.{role} must be a number of devices >= 0, got {amount!r}")
        if not pool.use_ray:
            if amount != (0 if role == "rollout" else 1):
                what = "a separate rollout copy" if role == "rollout" else "placing roles on their own devices"
                raise UserError(
                    f"{path}: resource_pool.{role}={amount}: {what} needs Ray: set resource_pool.use_ray true "
                    "(pip install ray), or leave it at its default to run every role in this process"
                )
            continue
        if amount == 0 and role != "rollout":
            raise UserError(f"{path}: resource_pool.{role}=0: every role needs a device or a share of one (> 0)")
        if amount > 1 and not float(amount).is_integer():
            raise UserError(
                f"{path}: resource_pool.{role}={amount}: more than one device must be a whole number (each rank "
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
        value = getattr(pool, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise UserError(f"{path}: resource_pool.{name} must be a number of seconds > 0, got {value!r}")
    if not isinstance(pool.colocate, list) or not all(isinstance(g, list) for g in pool.colocate):
        raise UserError(f'{path}: resource_pool.colocate must be a list of role lists, e.g. [["actor_rollout", "ref"]]')
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
            listed = ", ".join(f"{role}={pool.amount(role)}" for role in group)
            raise UserError(
                f"{path}: resource_pool.colocate: {group} share one process and its devices, so they need equal "
                f"amounts ({listed})"
            )
