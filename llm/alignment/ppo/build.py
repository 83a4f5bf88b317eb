"""Build the PPO roles and the trainer from a ``PPOConfig`` and its ``PPOContext`` (context.py: the tokenizers,
loaded once, and the values derived from them; the config is never written).

Each role is built by ``build_role(config, name, run=context)`` in the process that will run it: this one by
default, or a Ray actor (ray_roles.py, which is handed ``build_role`` with the context). Seeded random
initialisation (``init_from_config``) makes a role built in another process hold the same weights as one built
here. The reward is whatever ``reward.type`` names in the reward registry (rewards/). ``ppo_trainer(config)`` runs
the whole sequence (context, prompts, roles, trainer), as ``run_ppo.py`` does.

For models already in memory (tests, benchmarks, notebooks), ``build_from_models`` is the programmatic
constructor: the same roles, optimizers and update settings without checkpoints or a config file's models.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator

from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from llm.alignment.ppo.context import PPOContext
from llm.alignment.ppo.loading import Place, load, model_dtype, offload_idle, optimizer_for
from llm.alignment.ppo.lora import ActorBase, with_lora
from llm.alignment.ppo.prompts import Prompt, prompts_from_records
from llm.alignment.ppo.rewards import ORMReward, RewardFunction, build_rewards, reward_type, same_vocabulary
from llm.alignment.ppo.roles import ActorRole, CriticRole, PolicyModel
from llm.alignment.ppo.trainer import PPOTrainer
from llm.alignment.ppo.update import PolicyUpdate, ValueUpdate
from llm.data.readers import load_dataset_records
from llm.settings.ppo import PPOConfig, shares_actor_base
from llm.utils.errors import UserError
from llm.utils.modeling import load_config, model_stop_ids
from llm.utils.paths import resolve_paths

logger = logging.getLogger(__name__)

__all__ = [
    "PPOContext",
    "Place",
    "build_from_models",
    "build_ppo",
    "build_role",
    "load_prompts",
    "placed_roles",
    "ppo_trainer",
    "role_names",
]


def build_reward(c: PPOConfig, place: Place, run: PPOContext) -> RewardFunction:
    """The registered reward type ``reward.type`` (rewards/), built by its ``from_config``; a list of rewards:
    each built so, weighted and summed (rewards/combined.py)."""
    return build_rewards(c, place, run)


def policy_update(c: PPOConfig) -> PolicyUpdate:
    a, alg = c.actor_rollout, c.algorithm
    return PolicyUpdate(
        a.ppo_mini_batch_size,
        c.clip_low,
        c.clip_high,
        a.entropy_coeff,
        alg.kl_loss_coef,
        alg.kl_penalty,
        policy_loss=a.policy_loss,
        clip_c=a.clip_ratio_c,
        loss_agg_mode=a.loss_agg_mode,
        max_length=a.max_response_length,
        mask_truncated=a.mask_truncated_completions,
    )


def value_update(c: PPOConfig) -> ValueUpdate:
    cr = c.critic
    return ValueUpdate(cr.critic_mini_batch_size, cr.cliprange_value, cr.value_loss_coef)


def chunked_by(c: PPOConfig, role):
    """``role`` computing its log-probs ``training.readout_chunk`` readouts at a time (roles.py)."""
    role.readout_chunk = c.training.readout_chunk
    return role


def build_actor(c: PPOConfig, place: Place, run: PPOContext) -> ActorRole:
    a, tok = c.actor_rollout, run.tokenizer
    model = load(c, AutoModelForCausalLM, a.model_name_or_path, a.init_from_config, tok, place, True)
    model = with_lora(c, "actor_rollout", model)
    micro = c.micro("actor_rollout")
    optim = optimizer_for(c, model, "actor_rollout", place)
    actor = chunked_by(
        c, ActorRole(model, tok, a.temperature, micro, optim, policy_update(c), a.gather_weights_for_generation)
    )
    attach_engine(c, actor)
    return actor


def attach_engine(c: PPOConfig, actor: ActorRole) -> None:
    """``rollout_engine: vllm`` without a rollout copy: the engine in the actor's process, with its weights."""
    if c.actor_rollout.rollout_engine == "vllm" and c.resource_pool.rollout == 0:
        from llm.alignment.ppo.vllm_rollout import engine_for

        actor.engine = engine_for(c, actor.model, actor.tokenizer, "vLLM engine in the actor's process")
        actor.sync_engine()


def build_ref(c: PPOConfig, place: Place, run: PPOContext, roles: dict | None = None) -> PolicyModel:
    """The frozen SFT model: the actor's own checkpoint (or seeded config) unless ``ref`` names another. A LoRA
    actor's own base is the actor's model with the adapter disabled (lora.py), found in ``roles`` (this
    process's roles by name, the actor's among them by the time a call comes)."""
    a, tok = c.actor_rollout, run.tokenizer
    if shares_actor_base(c):
        logger.info("ref: the LoRA actor's own model with the adapter disabled (no second copy)")
        return chunked_by(c, ActorBase({} if roles is None else roles, tok, a.temperature, c.micro("ref")))
    path = c.ref.model_name_or_path or a.model_name_or_path
    from_config = a.init_from_config if path == a.model_name_or_path else c.ref.init_from_config
    model = load(c, AutoModelForCausalLM, path, from_config, tok, place, False, c.ref.dtype)
    if path != a.model_name_or_path and model.config.vocab_size != load_config(a.model_name_or_path).vocab_size:
        raise UserError("ref and actor_rollout models have different vocabularies: the reference must be the SFT model")
    ref = chunked_by(c, PolicyModel(model, tok, a.temperature, c.micro("ref")))
    return offload_idle(c, ref, model, "ref", place, ("log_probs",))


def build_rollout(c: PPOConfig, place: Place, run: PPOContext) -> PolicyModel:
    """A generation copy of the actor: the actor's initial weights, then whatever ``sync_from`` sends."""
    a, tok = c.actor_rollout, run.tokenizer
    model = load(c, AutoModelForCausalLM, a.model_name_or_path, a.init_from_config, tok, place, False)
    if a.rollout_engine == "vllm":  # the rollout copy is a vLLM engine on its own devices
        from llm.alignment.ppo.vllm_rollout import engine_for

        engine = engine_for(c, model, tok, "vLLM engine of the rollout copy")
        engine.load_weights(model.state_dict())
        return engine
    return PolicyModel(model, tok, a.temperature, c.micro("rollout"), a.gather_weights_for_generation)


def build_critic(c: PPOConfig, place: Place, run: PPOContext) -> CriticRole:
    """Initialised from the reward model when its type has a value head (an ORM: its backbone and head),
    else from the actor."""
    tok = run.tokenizer
    r = c.reward
    from_reward = reward_type(r.type).value_head
    if c.critic.model_name_or_path:
        path, from_config = c.critic.model_name_or_path, c.critic.init_from_config
    elif from_reward and same_vocabulary(run.reward_tokenizer, tok):
        path, from_config = r.model_name_or_path, r.init_from_config
    else:
        if from_reward:  # the critic reads the actor's token ids: a reward model of another vocabulary cannot
            logger.warning(
                "critic: the %s reward model %s has another tokenizer than the actor's, so the critic starts from "
                "the actor's model (%s) instead (the reward re-tokenises the text); set critic.model_name_or_path "
                "to choose another",
                r.type.upper(),
                r.model_name_or_path,
                c.actor_rollout.model_name_or_path,
            )
        path, from_config = c.actor_rollout.model_name_or_path, c.actor_rollout.init_from_config
    model = load(c, AutoModelForSequenceClassification, path, from_config, tok, place, True, num_labels=1)
    model = with_lora(c, "critic", model)
    return CriticRole(model, tok, c.micro("critic"), optimizer_for(c, model, "critic", place), value_update(c))


def build_prime(c: PPOConfig, place: Place, run: PPOContext):
    """PRIME's implicit PRM (``prime``: prime.py): trained from ``prime.model_name_or_path``, else the actor's model;
    its frozen reference ``prime.ref_model_name_or_path``, else the same initial weights."""
    from llm.alignment.ppo.prime import PrimePRM

    p, a, tok = c.prime, c.actor_rollout, run.tokenizer
    if p.model_name_or_path:
        path, from_config = p.model_name_or_path, p.init_from_config
    else:
        path, from_config = a.model_name_or_path, a.init_from_config
    ref_path = p.ref_model_name_or_path or path
    ref_from_config = from_config and ref_path == path
    for name, other in (("prime.model_name_or_path", path), ("prime.ref_model_name_or_path", ref_path)):
        if (
            other != a.model_name_or_path
            and load_config(other).vocab_size != load_config(a.model_name_or_path).vocab_size
        ):
            raise UserError(
                f"{name} {other}: another vocabulary than the actor's; the implicit PRM reads its token ids"
            )
    model = load(c, AutoModelForCausalLM, path, from_config, tok, place, True)
    ref = PolicyModel(
        load(c, AutoModelForCausalLM, ref_path, ref_from_config, tok, place, False), tok, 1.0, c.micro("prime")
    )
    optim = optimizer_for(c, model, "prime", place)
    prm = PrimePRM(model, tok, c.micro("prime"), optim, chunked_by(c, ref), p, ref_path, ref_from_config)
    return chunked_by(c, prm)


BUILDERS = {
    "prime": build_prime,
    "actor_rollout": build_actor,
    "ref": build_ref,
    "critic": build_critic,
    "reward": build_reward,
    "rollout": build_rollout,
}


def role_names(c: PPOConfig) -> list[str]:
    """The roles this run needs, in build order."""
    names = ["actor_rollout", "ref", "reward"] if c.algorithm.uses_reference else ["actor_rollout", "reward"]
    if c.uses_critic:
        names.append("critic")
    if c.resource_pool.rollout > 0:
        names.append("rollout")
    if c.prime is not None:
        names.append("prime")
    return names


IN_PROCESS = Place()  # the default place: this process, on the CPU


def build_role(c: PPOConfig, name: str, place: Place = IN_PROCESS, built: dict | None = None, *, run: PPOContext):
    """Role ``name`` on ``place``; ``built``: the roles of this process by name (a LoRA actor's reference
    reads the actor's model from there); ``run``: the run's context (its tokenizers)."""
    role = BUILDERS[name](c, place, run, built) if name == "ref" else BUILDERS[name](c, place, run)
    logger.info("built role %s (%s) on %s", name, type(role).__name__, place)
    return role


@contextlib.contextmanager
def placed_roles(c: PPOConfig, run: PPOContext) -> Iterator[dict]:
    """The roles by name: built here by default, or Ray proxies (ended, with their actors, on exit)."""
    if not c.resource_pool.use_ray:
        roles: dict = {}
        for name in role_names(c):
            roles[name] = build_role(c, name, IN_PROCESS, roles, run=run)
        yield roles
        return
    from llm.alignment.ppo.ray_roles import ray_roles  # Ray only when the config asks for it

    # each worker builds its roles with a copy of the context: the tokenizers travel, nothing is loaded twice
    with ray_roles(c, role_names(c), functools.partial(build_role, run=run)) as roles:
        yield roles


@contextlib.contextmanager
def ppo_trainer(c: PPOConfig) -> Iterator[PPOTrainer]:
    """The trainer of ``c`` over its placed roles (ended on exit): ``run_ppo.py``'s sequence without the resume,
    for tests, benchmarks and notebooks."""
    run = PPOContext.load(c)
    prompts = load_prompts(c, run)
    with placed_roles(c, run) as roles:
        yield build_ppo(c, prompts, roles, run)


def load_prompts(c: PPOConfig, run: PPOContext, map_keys: dict[str, str] | None = None) -> list[Prompt]:
    """The prompt file tokenised with the actor's tokenizer; a bad record stops the run before any model loads.
    ``map_keys`` (default ``data.map_keys``) renames the records' columns as they are read (``llm.data.readers``).
    A missing prompt file stops here, naming the directories it was looked for in."""
    t, d = c.training, c.data
    paths = resolve_paths(d.train_dataset_path, "data.train_dataset_path", c.source or "config")
    keys = d.map_keys if map_keys is None else map_keys
    records = list(load_dataset_records(paths, "prompt", probs=d.dataset_probs, seed=t.seed, map_keys=keys))
    return prompts_from_records(records, run.tokenizer, c.actor_rollout.max_prompt_length, run.use_chat_template)


def build_from_models(
    c: PPOConfig, prompts: list[Prompt], tok, policy, ref, critic, reward, reward_tokenizer=None
) -> PPOTrainer:
    """A trainer in this process over models already in memory: the programmatic API for models you built or
    loaded yourself (tests, benchmarks, notebooks), with the same roles, optimizers and update settings that
    ``build_role`` makes from checkpoints.

    ``policy`` (trained) and ``ref`` are causal LMs of tokenizer ``tok`` (the prompts' ids are its ids),
    ``critic`` (trained) a sequence-classification model with one label, ``reward`` an ORM (a
    sequence-classification model read at the last response token) of ``reward_tokenizer`` (default
    ``tok``); the config gives every setting (micro-batch sizes, optimizer, algorithm), not the models.
    ``ref`` and ``reward`` are put in eval mode. ``training.bf16`` puts policy and critic in bf16 (fp32 AdamW
    masters), and ref and reward unless their own ``dtype`` says otherwise, as ``build_role`` loads them; a frozen
    role's ``dtype`` applies either way. Responses end at the tokenizer's EOS or
    one of ``policy.generation_config``'s EOS ids (``PPOContext.stop_ids``' rule). ``ref`` None with a peft ``policy``: the policy's own base
    with the adapter disabled (lora.py's ``ActorBase``); not used without a KL term (``algorithm.uses_reference``)."""
    a, micro, place = c.actor_rollout, c.micro, Place()
    # the dtypes build_role loads with: training.bf16 puts the trained models in bf16 (AdamW keeps fp32 masters),
    # the frozen ones as their own dtype says, else as the trained ones; without either the models stay as given
    if c.training.bf16:
        policy, critic = policy.to(model_dtype(c)), critic.to(model_dtype(c))
    frozen = {"ref": ref, "reward": reward}
    for name, model in frozen.items():
        section = getattr(c, name, None)
        dtype = getattr(section, "dtype", None)
        if model is not None and (c.training.bf16 or dtype):
            frozen[name] = model.to(model_dtype(c, dtype))
    ref, reward = frozen["ref"], frozen["reward"]
    actor = ActorRole(
        policy,
        tok,
        a.temperature,
        micro("actor_rollout"),
        optimizer_for(c, policy, "actor_rollout", place),
        policy_update(c),
    )
    chunked_by(c, actor)
    attach_engine(c, actor)
    if not c.algorithm.uses_reference:
        ref_role = None  # no KL term reads it (role_names)
    elif ref is None:
        ref_role = chunked_by(c, ActorBase({"actor_rollout": actor}, tok, a.temperature, micro("ref")))
    else:
        ref_role = chunked_by(c, PolicyModel(ref.eval(), tok, a.temperature, micro("ref")))
    return PPOTrainer(
        c,
        prompts,
        tok,
        actor,
        ORMReward(reward.eval(), reward_tokenizer or tok, tok, micro("reward")),
        ref_role,
        CriticRole(critic, tok, micro("critic"), optimizer_for(c, critic, "critic", place), value_update(c)),
        stop_ids=model_stop_ids(policy, tok),
    )


def build_ppo(c: PPOConfig, prompts: list[Prompt], roles: dict, run: PPOContext) -> PPOTrainer:
    """The trainer over ``roles`` (from ``placed_roles``), its checkpoints fingerprinted by ``run``."""
    logger.info(
        "PPO: %d prompts; roles %s (%s); reward %s; advantages %s",
        len(prompts),
        ", ".join(roles),
        "Ray actors" if c.resource_pool.use_ray else "in this process",
        " + ".join(f"{r.weight:g} x {r.type}" if c.extra_rewards else r.type for r in c.rewards),
        c.algorithm.adv_estimator,
    )
    if not c.algorithm.uses_reference:
        logger.info(
            "no KL term (algorithm.use_kl_in_reward false or kl_ctrl fixed at kl_coef 0, and kl_loss_coef 0): the "
            "reference model is not built or run (its memory and a forward per step saved); the logged kl is 0"
        )
    trainer = PPOTrainer(
        c,
        prompts,
        run.tokenizer,
        roles["actor_rollout"],
        roles["reward"],
        roles.get("ref"),
        roles.get("critic"),
        roles.get("rollout"),
        fingerprint=run.fingerprint,
        stop_ids=run.stop_ids,
        prime=roles.get("prime"),
    )
    if trainer.rollout_copy is not None and c.actor_rollout.lora_path:
        trainer.rollout_copy.sync_from(trainer.actor)  # the copy loaded the base: send it base + the loaded adapter
    return trainer
