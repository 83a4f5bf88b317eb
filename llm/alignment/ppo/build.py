"""Build the PPO roles and the trainer from a ``PPOConfig``.

Each role is built by ``build_role(config, name)`` in the process that will run it: this one by
default, or a Ray actor (ray_roles.py). Seeded random initialisation (``init_from_config``) makes a
role built in another process hold the same weights as one built here.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

from llm.alignment.ppo.config import PPOConfig
from llm.alignment.ppo.offload import OffloadedTrainableRole, offload_when_idle
from llm.alignment.ppo.roles import (
    ActorRole,
    CriticRole,
    HttpReward,
    ORMReward,
    PolicyModel,
    PolicyUpdate,
    PRMReward,
    RewardFunction,
    RuleReward,
    TrainableRole,
    ValueUpdate,
    same_vocabulary,
)
from llm.alignment.ppo.trainer import PPOTrainer, Prompt, prompts_from_records
from llm.data.readers import load_dataset_records
from llm.data.tokenize import single_token_id
from llm.utils.distributed import Layout
from llm.utils.errors import UserError
from llm.utils.modeling import load_model, load_tokenizer
from llm.utils.paths import resolve_paths

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Place:
    """Where a role's models go: ``device`` ("cuda" in a Ray GPU worker) and, for one rank of an FSDP2
    group, the group's ``layout`` (None: the whole model in this process)."""

    device: str = "cpu"
    layout: Layout | None = None


def _optim(c: PPOConfig, model, role: str, place: Place) -> TrainableRole:
    t = c.training
    cls = TrainableRole
    if t.adam_offload:
        if place.layout is not None:
            raise UserError(
                f"training.adam_offload with {role} sharded over an FSDP2 group: not supported; give {role} one "
                "device, or use the group's own offload (sharding offload) instead"
            )
        if torch.device(place.device).type == "cpu":
            logger.info(
                "training.adam_offload: %s runs on the CPU, its optimizer state is in host memory already", role
            )
        else:
            logger.info("training.adam_offload: %s keeps its AdamW state (fp32 master + moments) on the host", role)
            cls = OffloadedTrainableRole
    return cls(  # each setting: the role's own value, else training's
        model,
        c.lr(role),
        c.optim(role, "weight_decay"),
        (c.optim(role, "adam_beta1"), c.optim(role, "adam_beta2")),
        c.optim(role, "adam_epsilon"),
        c.optim(role, "max_grad_norm"),
        c.optim(role, "lr_warmup_steps"),
    )


def _dtype(c: PPOConfig, frozen: str | None = None) -> torch.dtype:
    """The trained models' dtype (``training.bf16``), or a frozen role's own ``dtype`` when it sets one."""
    if frozen is not None:
        return getattr(torch, frozen)
    return torch.bfloat16 if c.training.bf16 else torch.float32


def _offload_idle(c: PPOConfig, role, model, name: str, place: Place, methods: tuple[str, ...]):
    """``offload_when_idle`` when ``<name>.offload`` asks for it and there is a device to leave."""
    if not getattr(c, name).offload:
        return role
    if place.layout is not None:
        raise UserError(
            f"{name}.offload with {name} sharded over an FSDP2 group: not supported; give {name} one device, or "
            "leave the shards where they are (each rank holds only its part)"
        )
    if torch.device(place.device).type == "cpu":
        logger.info("%s.offload: %s runs on the CPU, nothing to offload", name, name)
        return role
    logger.info("%s.offload: the %s model stays in host memory between its forwards", name, name)
    return offload_when_idle(role, model, place.device, methods)


def actor_tokenizer(c: PPOConfig):
    a = c.actor_rollout
    return load_tokenizer(a.tokenizer_name_or_path or a.model_name_or_path)


def _load(
    c: PPOConfig,
    auto_class: type,
    path: str,
    from_config: bool,
    tok,
    place: Place,
    trained: bool,
    dtype: str | None = None,
    **kw,
):
    """One of the run's models on ``place``: trained (gradient checkpointing as configured) or frozen
    (in ``dtype`` when given)."""
    model = load_model(
        auto_class,
        path,
        init_from_config=from_config,
        seed=c.training.seed,
        dtype=_dtype(c, dtype),
        pad_token_id=tok.pad_token_id,
        layout=place.layout,
        **kw,
    ).to(place.device)
    if trained and c.training.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if trained and place.layout is not None:
        _sum_gradients(model)
    return model if trained else model.eval().requires_grad_(False)


def _sum_gradients(model) -> None:
    """FSDP2 averages gradients over the group; a PPO rank's loss is already its share of the whole
    mini-batch's (normalised by all its tokens, roles.py), so the ranks' gradients must be summed: divide
    factor 1, with plain sum reductions (gloo has no pre-multiplied sum)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def build_reward(c: PPOConfig, place: Place) -> RewardFunction:
    r, micro = c.reward, c.micro("reward")
    if r.type == "rule":
        return RuleReward(r.rule)
    if r.type == "http":
        return HttpReward(r.url, r.timeout, r.max_retries, r.retry_backoff, r.max_response_bytes)
    tok = load_tokenizer(r.tokenizer_name_or_path or r.model_name_or_path)
    if r.type == "orm":
        model = _load(
            c,
            AutoModelForSequenceClassification,
            r.model_name_or_path,
            r.init_from_config,
            tok,
            place,
            False,
            r.dtype,
            num_labels=1,
        )
        return _offload_idle(c, ORMReward(model, tok, actor_tokenizer(c), micro), model, "reward", place, ("score",))
    tokens = [t.strip() for t in r.reward_tokens.split(",")]
    if len(tokens) != 2:
        raise UserError(f"reward.reward_tokens must be 'positive,negative', got {r.reward_tokens!r}")
    ids = (
        single_token_id(tok, tokens[0], "reward.reward_tokens"),
        single_token_id(tok, tokens[1], "reward.reward_tokens"),
    )
    placeholder_id = single_token_id(tok, r.placeholder_token, "reward.placeholder_token")
    model = _load(c, AutoModelForCausalLM, r.model_name_or_path, r.init_from_config, tok, place, False, r.dtype)
    prm = PRMReward(
        model,
        tok,
        actor_tokenizer(c),
        r.step_separator,
        r.placeholder_token,
        ids,
        placeholder_id,
        r.prm_aggregation,
        micro,
    )
    return _offload_idle(c, prm, model, "reward", place, ("score",))


def policy_update(c: PPOConfig) -> PolicyUpdate:
    a, alg = c.actor_rollout, c.algorithm
    return PolicyUpdate(
        a.ppo_mini_batch_size, c.clip_low, c.clip_high, a.entropy_coeff, alg.kl_loss_coef, alg.kl_penalty
    )


def value_update(c: PPOConfig) -> ValueUpdate:
    cr = c.critic
    return ValueUpdate(cr.critic_mini_batch_size, cr.cliprange_value, cr.value_loss_coef)


def build_actor(c: PPOConfig, place: Place) -> ActorRole:
    a, tok = c.actor_rollout, actor_tokenizer(c)
    model = _load(c, AutoModelForCausalLM, a.model_name_or_path, a.init_from_config, tok, place, True)
    micro = c.micro("actor_rollout")
    optim = _optim(c, model, "actor_rollout", place)
    return ActorRole(model, tok, a.temperature, micro, optim, policy_update(c), a.gather_weights_for_generation)


def build_ref(c: PPOConfig, place: Place) -> PolicyModel:
    """The frozen SFT model: the actor's own checkpoint (or seeded config) unless ``ref`` names another."""
    a, tok = c.actor_rollout, actor_tokenizer(c)
    path = c.ref.model_name_or_path or a.model_name_or_path
    from_config = a.init_from_config if path == a.model_name_or_path else c.ref.init_from_config
    model = _load(c, AutoModelForCausalLM, path, from_config, tok, place, False, c.ref.dtype)
    if (
        path != a.model_name_or_path
        and model.config.vocab_size != AutoConfig.from_pretrained(a.model_name_or_path).vocab_size
    ):
        raise UserError("ref and actor_rollout models have different vocabularies: the reference must be the SFT model")
    ref = PolicyModel(model, tok, a.temperature, c.micro("ref"))
    return _offload_idle(c, ref, model, "ref", place, ("log_probs",))


def build_rollout(c: PPOConfig, place: Place) -> PolicyModel:
    """A generation copy of the actor: the actor's initial weights, then whatever ``sync_from`` sends."""
    a, tok = c.actor_rollout, actor_tokenizer(c)
    model = _load(c, AutoModelForCausalLM, a.model_name_or_path, a.init_from_config, tok, place, False)
    return PolicyModel(model, tok, a.temperature, c.micro("rollout"), a.gather_weights_for_generation)


def build_critic(c: PPOConfig, place: Place) -> CriticRole:
    """Initialised from the reward model when it is an ORM (its backbone and head), else from the actor."""
    tok = actor_tokenizer(c)
    r = c.reward
    if c.critic.model_name_or_path:
        path, from_config = c.critic.model_name_or_path, c.critic.init_from_config
    elif r.type == "orm" and same_vocabulary(load_tokenizer(r.tokenizer_name_or_path or r.model_name_or_path), tok):
        path, from_config = r.model_name_or_path, r.init_from_config
    else:
        if r.type == "orm":  # the critic reads the actor's token ids: an ORM of another vocabulary cannot
            logger.warning(
                "critic: the ORM reward model %s has another tokenizer than the actor's, so the critic starts from "
                "the actor's model (%s) instead (the reward re-tokenises the text); set critic.model_name_or_path "
                "to choose another",
                r.model_name_or_path,
                c.actor_rollout.model_name_or_path,
            )
        path, from_config = c.actor_rollout.model_name_or_path, c.actor_rollout.init_from_config
    model = _load(c, AutoModelForSequenceClassification, path, from_config, tok, place, True, num_labels=1)
    return CriticRole(model, tok, c.micro("critic"), _optim(c, model, "critic", place), value_update(c))


BUILDERS = {
    "actor_rollout": build_actor,
    "ref": build_ref,
    "critic": build_critic,
    "reward": build_reward,
    "rollout": build_rollout,
}


def role_names(c: PPOConfig) -> list[str]:
    """The roles this run needs, in build order."""
    names = ["actor_rollout", "ref", "reward"]
    if c.uses_critic:
        names.append("critic")
    if c.resource_pool.rollout > 0:
        names.append("rollout")
    return names


def build_role(c: PPOConfig, name: str, place: Place = Place()):
    role = BUILDERS[name](c, place)
    logger.info("built role %s (%s) on %s", name, type(role).__name__, place)
    return role


@contextlib.contextmanager
def placed_roles(c: PPOConfig) -> Iterator[dict]:
    """The roles by name: built here by default, or Ray proxies (ended, with their actors, on exit)."""
    if not c.resource_pool.use_ray:
        yield {name: build_role(c, name) for name in role_names(c)}
        return
    from llm.alignment.ppo.ray_roles import ray_roles

    with ray_roles(c, role_names(c)) as roles:
        yield roles


def load_prompts(c: PPOConfig, map_keys: dict[str, str] | None = None) -> list[Prompt]:
    """The prompt file tokenised with the actor's tokenizer; a bad record stops the run before any model loads.
    ``map_keys`` (default ``data.map_keys``) renames the records' columns as they are read (``llm.data.readers``).
    A missing prompt file stops here, naming the directories it was looked for in."""
    t, d = c.training, c.data
    paths = resolve_paths(d.train_dataset_path, "data.train_dataset_path", c.source or "config")
    keys = d.map_keys if map_keys is None else map_keys
    records = list(load_dataset_records(paths, "prompt", probs=d.dataset_probs, seed=t.seed, map_keys=keys))
    return prompts_from_records(
        records, actor_tokenizer(c), c.actor_rollout.max_prompt_length, c.data.use_chat_template
    )


def trainer_for_models(c: PPOConfig, prompts: list[Prompt], tok, policy, ref, critic, reward) -> PPOTrainer:
    """A trainer in this process over four models already in memory (tests, benchmarks): the same roles,
    optimizers and update settings that ``build_role`` makes from checkpoints, with an ORM reward."""
    a, micro, place = c.actor_rollout, c.micro, Place()
    return PPOTrainer(
        c,
        prompts,
        tok,
        ActorRole(
            policy,
            tok,
            a.temperature,
            micro("actor_rollout"),
            _optim(c, policy, "actor_rollout", place),
            policy_update(c),
        ),
        ORMReward(reward.eval(), tok, tok, micro("reward")),
        PolicyModel(ref.eval(), tok, a.temperature, micro("ref")),
        CriticRole(critic, tok, micro("critic"), _optim(c, critic, "critic", place), value_update(c)),
    )


def build_ppo(c: PPOConfig, prompts: list[Prompt], roles: dict) -> PPOTrainer:
    """The trainer over ``roles`` (from ``placed_roles``)."""
    logger.info(
        "PPO: %d prompts; roles %s (%s); reward %s; advantages %s",
        len(prompts),
        ", ".join(roles),
        "Ray actors" if c.resource_pool.use_ray else "in this process",
        c.reward.type,
        c.algorithm.adv_estimator,
    )
    return PPOTrainer(
        c,
        prompts,
        actor_tokenizer(c),
        roles["actor_rollout"],
        roles["reward"],
        roles["ref"],
        roles.get("critic"),
        roles.get("rollout"),
    )
