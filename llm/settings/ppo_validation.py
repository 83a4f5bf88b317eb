"""Checking a PPO configuration (the schema: ``llm.settings.ppo``) for what the types and lower bounds cannot
say: choices, ranges, sizes that must divide, fields that need one another. Choices that are registries
(``reward.type``, estimators, KL controllers, PRM aggregations: ``llm.settings.registry``) are checked against
the registry, which lists the valid names. Reading the file, dialects and overrides: ``llm.settings.load``.
"""

from __future__ import annotations

import logging

from llm.settings.environment_validation import validate_environment
from llm.settings.ppo import (
    LORA_ROLES,
    ROLES,
    PPOConfig,
    ResourcePool,
    shares_actor_base,
)
from llm.settings.prime_validation import validate_prime
from llm.settings.registry import (
    ADV_ESTIMATORS,
    KL_CONTROLLERS,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    kl_kinds,
)
from llm.settings.reward_list import labels, validate_rewards
from llm.utils.errors import UserError, closest
from llm.utils.lora import check_lora_fields

logger = logging.getLogger(__name__)


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
    POLICY_LOSSES.lookup(a.policy_loss, f"{path}: ")
    LOSS_AGG_MODES.lookup(a.loss_agg_mode, f"{path}: ")
    if a.policy_loss == "dual_clip" and a.clip_ratio_c <= 1:
        raise UserError(
            f"{path}: actor_rollout.clip_ratio_c must be > 1 with policy_loss dual_clip (it bounds a negative "
            f"advantage's loss at clip_ratio_c x |A|, above the clipped surrogate's 1 - clip_ratio_low), got "
            f"{a.clip_ratio_c:g}"
        )
    validate_rewards(c, path)  # each reward section (one, or a list: llm.settings.reward_list)
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
    validate_dapo(c, path)
    validate_async(c, path)
    validate_environment(c, path)
    validate_prime(c, path)


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
    """The memory savers: the frozen roles' dtypes (no model settings on a reward without a model: reward_list.py)."""
    for role, section in (("ref", c.ref), *zip(labels(c), c.rewards)):
        if section.dtype is not None and section.dtype not in FROZEN_DTYPES:
            raise UserError(
                f"{path}: {role}.dtype must be float32, bfloat16 or null (as the trained models), got {section.dtype!r}"
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
    if (
        pool.use_ray
        and c.algorithm.uses_reference
        and not any({"actor_rollout", "ref"} <= set(group) for group in pool.colocate)
    ):
        raise UserError(
            f"{path}: actor_rollout.lora with resource_pool.use_ray: the reference is the actor's own model with the "
            'adapter disabled, so it must run in the actor\'s process: add ["actor_rollout", "ref"] to '
            "resource_pool.colocate (with equal amounts), or give ref.model_name_or_path to load a separate reference"
        )


def validate_dapo(c: PPOConfig, path: str) -> None:
    """DAPO's dynamic sampling (``algorithm.filter_groups``) and overlong shaping (``reward.overlong_buffer_len``):
    llm.alignment.ppo.dapo."""
    a, alg, rw = c.actor_rollout, c.algorithm, c.reward
    if alg.filter_groups:
        grouped = [name for name, estimator in ADV_ESTIMATORS.items() if estimator.grouped]
        if not ADV_ESTIMATORS[alg.adv_estimator].grouped:
            raise UserError(
                f"{path}: algorithm.filter_groups drops the groups of a prompt's samples whose rewards are all equal, "
                f"which needs a grouped estimator; adv_estimator is {alg.adv_estimator!r}: set algorithm.adv_estimator "
                f"to one of {', '.join(grouped)}, or filter_groups false"
            )
        if a.num_samples_per_step < 2:
            raise UserError(
                f"{path}: algorithm.filter_groups compares the samples of each prompt: it needs "
                f"actor_rollout.num_samples_per_step >= 2, got {a.num_samples_per_step}"
            )
        band = alg.filter_groups_range
        if band is not None and not (len(band) == 2 and band[0] <= band[1]):
            raise UserError(
                f"{path}: algorithm.filter_groups_range must be [low, high] with low <= high (the band a group's mean "
                f"reward must lie in to be trained on, e.g. [0.2, 0.8]), got {band}"
            )
    else:
        for name in ("max_num_gen_batches", "filter_groups_range"):
            if getattr(alg, name) != getattr(type(alg), name):  # set, but not read
                logger.warning("%s: algorithm.%s applies with algorithm.filter_groups true only", path, name)
    if rw.overlong_buffer_len and rw.overlong_buffer_len >= a.max_response_length:
        raise UserError(
            f"{path}: reward.overlong_buffer_len={rw.overlong_buffer_len} must be less than "
            f"actor_rollout.max_response_length={a.max_response_length} (the punishment starts at max_response_length "
            "- overlong_buffer_len tokens): lower overlong_buffer_len, or 0 to turn the overlong punishment off"
        )
    if not rw.overlong_buffer_len and rw.overlong_penalty_factor != type(rw).overlong_penalty_factor:
        logger.warning("%s: reward.overlong_penalty_factor applies with reward.overlong_buffer_len > 0 only", path)


def validate_async(c: PPOConfig, path: str) -> None:
    """``async_rollout`` / ``max_staleness`` (llm/alignment/ppo/async_rollout.py): one rollout in flight on a
    separate copy of the actor, whose old log-probs are the generating policy's."""
    a, alg, pool = c.actor_rollout, c.algorithm, c.resource_pool
    if not a.async_rollout:
        if a.max_staleness != 1:
            raise UserError(
                f"{path}: actor_rollout.max_staleness applies to async_rollout true; async_rollout is false "
                "(set async_rollout: true, or remove max_staleness)"
            )
        return
    if a.max_staleness > 1:
        raise UserError(
            f"{path}: actor_rollout.max_staleness={a.max_staleness}: one rollout is in flight at a time, so the "
            "staleness is at most 1; set max_staleness 1 (one-step-off) or 0 (wait for each update: synchronous)"
        )
    if alg.kl_penalty == "full":
        raise UserError(
            f"{path}: actor_rollout.async_rollout with algorithm.kl_penalty full: the exact KL needs the actor's "
            "forward over the reference's hidden states at the generating weights, which the rollout copy does not "
            "run; use kl_penalty kl, abs, mse or low_var_kl, or async_rollout false"
        )
    if alg.filter_groups:
        raise UserError(
            f"{path}: actor_rollout.async_rollout with algorithm.filter_groups: dynamic sampling generates a "
            "varying number of rounds per step, which one rollout in flight cannot hold; set filter_groups false "
            "or async_rollout false"
        )
    if pool.use_ray and pool.rollout == 0:
        raise UserError(
            f"{path}: actor_rollout.async_rollout on Ray needs a rollout copy that generates while the actor "
            "updates: set resource_pool.rollout (devices for it, e.g. 1, or a share like 0.5), or run in one "
            "process (resource_pool.use_ray false: the copy is a second in-process model)"
        )
    if pool.use_ray and a.rollout_engine == "vllm" and not a.rollout_log_probs:
        raise UserError(
            f"{path}: actor_rollout.async_rollout with a vLLM rollout copy on Ray: the old log-probs must be the "
            "generating policy's and the engine has no packed forward; set rollout_log_probs true (the engine's own, "
            "needs do_sample true, top_p 1, top_k 0), or rollout_engine hf"
        )
