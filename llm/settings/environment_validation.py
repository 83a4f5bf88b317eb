"""Checking a PPO config's ``environment`` section (``llm.settings.environment``) against the other sections and the
tool-call format registry: what multi-turn episodes need of the rollout."""

from __future__ import annotations

from llm.settings.environment import AUTO_FORMAT
from llm.settings.ppo import PPOConfig
from llm.settings.registry import TOOL_CALL_FORMATS
from llm.utils.errors import UserError


def validate_environment(c: PPOConfig, path: str) -> None:
    e, a = c.environment, c.actor_rollout
    if e is None:
        return
    e.check(path)
    if e.tool_call_format != AUTO_FORMAT:
        TOOL_CALL_FORMATS.lookup(e.tool_call_format, f"{path}: ")
    if e.max_episode_tokens <= a.max_prompt_length:
        raise UserError(
            f"{path}: environment.max_episode_tokens={e.max_episode_tokens} leaves no room after a prompt of "
            f"actor_rollout.max_prompt_length={a.max_prompt_length} tokens: raise it (prompt + every turn)"
        )
    if a.ignore_eos:
        raise UserError(
            f"{path}: actor_rollout.ignore_eos with an environment: a model turn ends at EOS, where the environment "
            "or the tools answer; remove ignore_eos"
        )
    if c.data.use_chat_template is False:
        raise UserError(
            f"{path}: data.use_chat_template is false, but an environment's and tools' messages are rendered with "
            "the actor tokenizer's chat template: remove it (or set it true)"
        )
    if a.rollout_engine == "vllm" and a.vllm_max_model_len is not None and a.vllm_max_model_len < e.max_episode_tokens:
        raise UserError(
            f"{path}: actor_rollout.vllm_max_model_len={a.vllm_max_model_len} is shorter than an episode "
            f"(environment.max_episode_tokens={e.max_episode_tokens}): raise it, or leave it null"
        )
