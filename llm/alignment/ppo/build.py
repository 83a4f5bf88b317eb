"""Build the four roles and the PPO trainer from a ``PPOConfig``."""

from __future__ import annotations

import copy
import logging

import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from llm.alignment.ppo.config import PPOConfig
from llm.alignment.ppo.roles import (
    HttpReward,
    ORMReward,
    PolicyModel,
    PRMReward,
    RewardFunction,
    RuleReward,
    TrainableRole,
    ValueModel,
)
from llm.alignment.ppo.trainer import PPOTrainer, prompts_from_records
from llm.data.readers import load_dataset_records
from llm.data.tokenize import single_token_id
from llm.utils.errors import UserError
from llm.utils.modeling import count_parameters, load_model, load_tokenizer

logger = logging.getLogger(__name__)


def _optim(c: PPOConfig, model, role: str) -> TrainableRole:
    t = c.training
    return TrainableRole(
        model,
        c.lr(role),
        t.weight_decay,
        (t.adam_beta1, t.adam_beta2),
        t.adam_epsilon,
        t.max_grad_norm,
        t.lr_warmup_steps,
    )


def build_reward(c: PPOConfig, actor_tokenizer, dtype: torch.dtype) -> RewardFunction:
    r, micro = c.reward, c.training.micro_batch_size
    if r.type == "rule":
        return RuleReward(r.rule)
    if r.type == "http":
        return HttpReward(r.url, r.timeout)
    tok = load_tokenizer(r.tokenizer_name_or_path or r.model_name_or_path)
    if r.type == "orm":
        model = load_model(
            AutoModelForSequenceClassification,
            r.model_name_or_path,
            init_from_config=r.init_from_config,
            seed=c.training.seed,
            dtype=dtype,
            pad_token_id=tok.pad_token_id,
            num_labels=1,
        )
        return ORMReward(model.eval().requires_grad_(False), tok, actor_tokenizer, micro)
    tokens = [t.strip() for t in r.reward_tokens.split(",")]
    if len(tokens) != 2:
        raise UserError(f"reward.reward_tokens must be 'positive,negative', got {r.reward_tokens!r}")
    ids = (
        single_token_id(tok, tokens[0], "reward.reward_tokens"),
        single_token_id(tok, tokens[1], "reward.reward_tokens"),
    )
    placeholder_id = single_token_id(tok, r.placeholder_token, "reward.placeholder_token")
    model = load_model(
        AutoModelForCausalLM,
        r.model_name_or_path,
        init_from_config=r.init_from_config,
        seed=c.training.seed,
        dtype=dtype,
        pad_token_id=tok.pad_token_id,
    )
    return PRMReward(
        model.eval().requires_grad_(False),
        tok,
        actor_tokenizer,
        r.step_separator,
        r.placeholder_token,
        ids,
        placeholder_id,
        r.prm_aggregation,
        micro,
    )


def build_ppo(c: PPOConfig) -> PPOTrainer:
    a, t = c.actor_rollout, c.training
    dtype = torch.bfloat16 if t.bf16 else torch.float32
    tok = load_tokenizer(a.tokenizer_name_or_path or a.model_name_or_path)
    records = list(load_dataset_records(c.data.train_dataset_path, "prompt", probs=c.data.dataset_probs, seed=t.seed))
    prompts = prompts_from_records(records, tok, a.max_prompt_length, c.data.use_chat_template)
    actor_model = load_model(
        AutoModelForCausalLM,
        a.model_name_or_path,
        init_from_config=a.init_from_config,
        seed=t.seed,
        dtype=dtype,
        pad_token_id=tok.pad_token_id,
    )
    if t.gradient_checkpointing:
        actor_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ref_path = c.ref.model_name_or_path or a.model_name_or_path
    if ref_path == a.model_name_or_path:
        ref_model = copy.deepcopy(actor_model)  # the frozen SFT model: same weights as the actor at start
    else:
        ref_model = load_model(
            AutoModelForCausalLM,
            ref_path,
            init_from_config=c.ref.init_from_config,
            seed=t.seed,
            dtype=dtype,
            pad_token_id=tok.pad_token_id,
        )
    ref_model.eval().requires_grad_(False)
    if len(ref_model.get_input_embeddings().weight) != len(actor_model.get_input_embeddings().weight):
        raise UserError("ref and actor_rollout models have different vocabularies: the reference must be the SFT model")
    micro = t.micro_batch_size
    actor = PolicyModel(actor_model, tok, a.temperature, micro)
    ref = PolicyModel(ref_model, tok, a.temperature, micro)
    reward = build_reward(c, tok, dtype)
    critic = critic_optim = None
    if c.uses_critic:
        # Initialised from the reward model when it is an ORM (its backbone and head), else from the actor.
        if c.critic.model_name_or_path:
            path, from_config = c.critic.model_name_or_path, c.critic.init_from_config
        elif c.reward.type == "orm":
            path, from_config = c.reward.model_name_or_path, c.reward.init_from_config
        else:
            path, from_config = a.model_name_or_path, a.init_from_config
        critic_model = load_model(
            AutoModelForSequenceClassification,
            path,
            init_from_config=from_config,
            seed=t.seed,
            dtype=dtype,
            pad_token_id=tok.pad_token_id,
            num_labels=1,
        )
        if t.gradient_checkpointing:
            critic_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        critic = ValueModel(critic_model, tok, micro)
        critic_optim = _optim(c, critic_model, "critic")
    logger.info(
        "PPO: %d prompts; actor %.2fM params; reward %s; advantages %s; critic %s",
        len(prompts),
        count_parameters(actor_model) / 1e6,
        c.reward.type,
        c.algorithm.adv_estimator,
        "none" if critic is None else f"{count_parameters(critic.model) / 1e6:.2f}M params",
    )
    return PPOTrainer(c, prompts, actor, _optim(c, actor_model, "actor_rollout"), reward, ref, critic, critic_optim)
