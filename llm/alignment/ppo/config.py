"""PPO configuration in MindSpeed-LLM's layout: ``training`` defaults that roles override, one section
per role, ``algorithm``, ``resource_pool`` and ``data``. Every section is a dataclass; every value is
type-checked (``llm.utils.fields``) and sizes are bounded (``metadata={"min": ...}``); unknown keys stop the
run naming the section, the key and the closest valid names.

Files: JSON or YAML, in this layout or in MindSpeed-LLM's own (``defaults`` model files,
``actor_rollout_ref: {actor_rollout, ref}``, Megatron names, ``resource_pool`` lists), which
``llm.alignment.ppo.mindspeed`` translates into this one.

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
from dataclasses import dataclass, field
from typing import Any

from llm.alignment.ppo.algorithm import ADV_ESTIMATORS, KL_CONTROLLERS, kl_kinds
from llm.utils import fields
from llm.utils.errors import UserError, closest
from llm.utils.paths import resolve_input_path, resolve_paths, tried

logger = logging.getLogger(__name__)


def _f(default: Any, text: str | None = None, low: float | None = None) -> Any:
    """A field with its help text and lower bound (``fields.field_bounds``)."""
    metadata: dict[str, Any] = {}
    if text:
        metadata["help"] = text
    if low is not None:
        metadata["min"] = low
    return field(default=default, metadata=metadata)


@dataclass
class TrainingSection:
    """Shared defaults; each role section may override the optimisation fields and the micro-batch size."""

    output_dir: str = "output/ppo"
    seed: int = _f(42, low=0)
    learning_rate: float = _f(1e-6, low=0)
    weight_decay: float = _f(0.0, low=0)
    adam_beta1: float = _f(0.9, low=0)
    adam_beta2: float = _f(0.999, low=0)
    adam_epsilon: float = _f(1e-8, low=0)
    max_grad_norm: float = _f(1.0, "gradient clipping (global L2 norm); 0: none", low=0)
    lr_warmup_steps: int = _f(0, "linear warmup over this many optimizer steps, then a constant rate", low=0)
    max_steps: int = _f(100, low=1)
    logging_steps: int = _f(1, low=1)
    save_steps: int = _f(0, "a checkpoint every this many steps; 0: none", low=0)
    save_total_limit: int | None = _f(None, "checkpoints kept (the oldest are deleted); null: all", low=1)
    resume_from_checkpoint: str | None = None
    overwrite_output_dir: bool = _f(
        False,
        "train in an output_dir holding another run's results (nothing is deleted); false: such a dir stops the run",
    )
    bf16: bool = field(
        default=False,
        metadata={
            "help": "bf16 weights for every model (frozen ones unless ref.dtype / reward.dtype say otherwise), no "
            "autocast; actor and critic AdamW on fp32 master weights: the O2 scheme"
        },
    )
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
    micro_batch_size: int = _f(8, "samples per forward (packed into one row) of every role", low=1)


@dataclass
class ModelSection:
    model_name_or_path: str | None = None
    tokenizer_name_or_path: str | None = None
    init_from_config: bool = False
    micro_batch_size: int | None = _f(None, "samples per forward of this role; null: training.micro_batch_size", low=1)


@dataclass
class TrainedSection(ModelSection):
    """A role with an optimizer (actor, critic): each null field takes the ``training`` value."""

    learning_rate: float | None = _f(None, low=0)
    weight_decay: float | None = _f(None, low=0)
    adam_beta1: float | None = _f(None, low=0)
    adam_beta2: float | None = _f(None, low=0)
    adam_epsilon: float | None = _f(None, low=0)
    max_grad_norm: float | None = _f(None, low=0)
    lr_warmup_steps: int | None = _f(None, low=0)


@dataclass
class ActorRolloutSection(TrainedSection):
    do_sample: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = _f(0, low=0)
    max_prompt_length: int = _f(512, low=1)
    max_response_length: int = _f(256, low=1)
    num_samples_per_step: int = _f(1, "responses sampled per prompt", low=1)
    ppo_mini_batch_size: int = _f(8, "samples per optimizer step (over all ranks of the role)", low=1)
    ppo_epochs: int = _f(1, low=1)
    clip_ratio: float = _f(0.2, low=0)
    clip_ratio_low: float | None = _f(None, low=0)
    clip_ratio_high: float | None = _f(None, low=0)
    shuffle_minibatch: bool = True
    entropy_coeff: float = _f(0.0, low=0)
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


@dataclass
class CriticSection(TrainedSection):
    cliprange_value: float | None = _f(0.2, low=0)
    critic_mini_batch_size: int = _f(8, "samples per optimizer step (over all ranks of the role)", low=1)
    critic_update_epochs: int = _f(1, low=1)
    value_loss_coef: float = _f(1.0, low=0)


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


def check_reward_url(url: str) -> None:
    """``reward.url`` must be an http:// or https:// URL with a host (never file://, ftp://, ...)."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a bad port
    except ValueError as err:
        raise UserError(f"reward.url {url!r} is not a valid URL ({err})") from None
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise UserError(
            f"reward.url {url!r}: only http:// and https:// URLs with a host are allowed (e.g. "
            "http://127.0.0.1:8000/score)"
        )


@dataclass
class RewardSection(FrozenModelSection):
    type: str = "rule"  # orm | prm | rule | http
    rule: str = "llm.alignment.ppo.rules:math_exact_match"
    url: str | None = _f(None, "type http: the scoring server, an http:// or https:// URL (redirects are not followed)")
    timeout: float = _f(30.0, "seconds one HTTP reward request may take in all (connect, send, whole answer)", low=0)
    max_retries: int = _f(2, "type http: retries of a failed request (connection error, timeout, 429, 5xx)", low=0)
    retry_backoff: float = _f(1.0, "type http: seconds before the first retry, doubled before each next one", low=0)
    max_response_bytes: int = _f(16 * 2**20, "type http: the largest answer read; a longer one is an error", low=1)
    step_separator: str = "\n"
    placeholder_token: str = "ки"
    reward_tokens: str = "+,-"
    prm_aggregation: str = "dense"  # dense | min | last | mean
    normalize_reward: bool = False
    reward_clip: float | None = _f(None, low=0)

    def __post_init__(self) -> None:
        """What the lower bounds cannot say: the URL scheme and upper bounds (a run must not wait for ever)."""
        if self.url is not None:
            check_reward_url(self.url)
        for name, high in (("max_retries", 10), ("retry_backoff", 60.0), ("max_response_bytes", 2**30)):
            if getattr(self, name) > high:
                raise UserError(f"reward.{name} must be at most {high:g}, got {getattr(self, name):g}")


@dataclass
class KLCtrlSection:
    type: str = "fixed"
    kl_coef: float = _f(0.05, low=0)
    target_kl: float = _f(6.0, low=0)
    horizon: float = _f(10000.0, low=0)


@dataclass
class AlgorithmSection:
    adv_estimator: str = "gae"
    gamma: float = _f(1.0, low=0)
    lam: float = _f(0.95, low=0)
    kl_penalty: str = "kl"
    use_kl_in_reward: bool = True
    kl_loss_coef: float = _f(0.0, "> 0: KL as a loss term (GRPO style) instead of / besides the reward", low=0)
    kl_ctrl: KLCtrlSection = field(default_factory=KLCtrlSection)
    whiten_advantages: bool = True
    missing_eos_penalty: float | None = None


@dataclass
class DataSection:
    train_dataset_path: str | None = None
    dataset_probs: str | None = None
    rollout_batch_size: int = _f(8, "prompts per step", low=1)
    use_chat_template: bool = False
    shuffle: bool = _f(True, "draw the prompts in a seeded random order per pass; false: in file order")
    map_keys: dict[str, str] | None = field(
        default=None,
        metadata={
            "help": 'rename the columns of the prompt file as it is read, {"field this project reads": "column in '
            'the file"} (MindSpeed\'s --map-keys), e.g. {"src": "question", "tgt": "answer"}'
        },
    )


ROLES = ("actor_rollout", "ref", "critic", "reward")


@dataclass
class ResourcePool:
    """Where the roles run. Default: all four in this process (every amount 1, ``use_ray`` false).

    With ``use_ray`` each role, or each ``colocate`` group, runs in Ray actor processes placed through
    one placement group: one process for a share of a device (< 1) or one device, N processes forming
    an FSDP2 group for N devices. The amounts count ``device`` units.
    """

    actor_rollout: float = _f(
        1,
        "devices for the actor (its training and, without a rollout copy, its generation); with Ray < 1 is a "
        "share of one device and N > 1 a group of N actors sharding the model with FSDP2",
        low=0,
    )
    ref: float = _f(1, "devices for the frozen reference policy (Ray: a share < 1, or N > 1 for FSDP2)", 0)
    critic: float = _f(1, "devices for the critic, value model and optimizer (Ray: a share < 1, or N > 1 for FSDP2)", 0)
    reward: float = _f(1, "devices for the reward role: model, rule or HTTP client (Ray: a share < 1, or N > 1)", 0)
    rollout: float = _f(
        0,
        "devices for a separate generation copy of the actor that receives its weights after every update "
        "(Ray; bounded by weight_sync_timeout); 0: the actor generates with its own weights",
        low=0,
    )
    use_ray: bool = _f(False, "run the roles in Ray actors (pip install ray); false: all roles in this process")
    device: str = _f(
        "cpu", "what the amounts count and where role models run: cpu (Ray CPUs) or gpu (Ray GPUs, models on CUDA)"
    )
    colocate: list[list[str]] = field(
        default_factory=list,
        metadata={
            "help": 'groups of roles sharing one Ray actor process and its devices, e.g. [["actor_rollout", '
            '"ref"], ["critic", "reward"]]; the members of a group need equal amounts'
        },
    )
    address: str | None = _f(
        None,
        "Ray cluster: null joins the cluster `ray start` made on this node (else starts a local one); 'auto' "
        "must find a running cluster; 'HOST:PORT' the head node of a cluster",
    )
    call_timeout: float = _f(
        1800.0, "seconds a role call (build, generate, score, update, save) may take before the run stops naming it"
    )
    weight_sync_timeout: float = _f(
        300.0, "seconds the actor -> rollout copy weight sync may take before the run stops naming it"
    )
    concurrent_roles: bool = _f(
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
    source: str = ""  # the config file, for messages
    notes: list[str] = field(default_factory=list)  # lines for the log: what a MindSpeed name became, ...

    @property
    def clip_low(self) -> float:
        a = self.actor_rollout
        return a.clip_ratio if a.clip_ratio_low is None else a.clip_ratio_low

    @property
    def clip_high(self) -> float:
        a = self.actor_rollout
        return a.clip_ratio if a.clip_ratio_high is None else a.clip_ratio_high

    def optim(self, role: str, name: str) -> Any:
        """An optimisation setting of a trained role: its own value, else the ``training`` one."""
        value = getattr(getattr(self, role), name)
        return getattr(self.training, name) if value is None else value

    def lr(self, role: str) -> float:
        return self.optim(role, "learning_rate")

    def micro(self, role: str) -> int:
        """Samples per forward of ``role`` (``rollout``: the actor's)."""
        value = getattr(self, "actor_rollout" if role == "rollout" else role).micro_batch_size
        return self.training.micro_batch_size if value is None else value

    @property
    def uses_critic(self) -> bool:
        estimator = ADV_ESTIMATORS.get(self.algorithm.adv_estimator)  # None: refused by validate_ppo_config
        return estimator is not None and estimator.needs_critic


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
    from llm.alignment.ppo.mindspeed import load_yaml

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
        raw = load_yaml(text, path)
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
    from llm.alignment.ppo import mindspeed

    if not argv or not argv[0].endswith(CONFIG_EXTENSIONS):
        raise UserError("usage: run_ppo.py CONFIG.json|CONFIG.yaml [--section.field value ...]")
    path = argv[0]
    raw, found = read_config(path)
    notes: list[str] = []
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
    for name, size in (
        ("actor_rollout.ppo_mini_batch_size", a.ppo_mini_batch_size),
        ("critic.critic_mini_batch_size", c.critic.critic_mini_batch_size),
    ):
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


FROZEN_DTYPES = ("float32", "bfloat16")


def validate_memory(c: PPOConfig, path: str) -> None:
    """The memory savers: the frozen roles' dtypes, and no model settings on a reward without a model."""
    for role in ("ref", "reward"):
        section = getattr(c, role)
        if section.dtype is not None and section.dtype not in FROZEN_DTYPES:
            raise UserError(
                f"{path}: {role}.dtype must be float32, bfloat16 or null (as the trained models), got {section.dtype!r}"
            )
    if c.reward.type in ("rule", "http"):
        for name, value, default in (("dtype", c.reward.dtype, None), ("offload", c.reward.offload, False)):
            if value != default:
                raise UserError(
                    f"{path}: reward.{name} applies to a reward model (type orm or prm); reward.type is "
                    f"{c.reward.type!r}, which has none"
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
