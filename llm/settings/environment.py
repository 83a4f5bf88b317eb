"""The ``environment`` section of a PPO config: multi-turn episodes with an environment and / or tools (the schema;
the episodes themselves: ``llm.alignment.ppo.agent``).

An environment is a class of the user's, ``name_or_path: "package.module:Class"``, built as ``Class(**kwargs)``
once per episode, with ``reset(task) -> str`` (the first user message) and ``step(reply) -> (str | None, float,
bool)`` (the next user message, the reward, done). Tools are plain functions, ``tools: ["package.module:function",
...]``, described to the model through the tokenizer's chat template. The section is absent (None) for single-turn
runs; given, ``PPOConfig.environment`` holds it and every step's rollout is a batch of episodes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from llm.settings.fields import help_field as _f
from llm.utils.errors import UserError

ON_ERROR = ("zero", "drop", "stop")
AUTO_FORMAT = "auto"  # tool_call_format: the format the chat template renders tool calls in

_SPEC = re.compile(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*")


def check_spec(spec: str, field_name: str, what: str, path: str) -> None:
    """``spec`` must read ``package.module:Name`` (imported when the run builds its episodes, not here)."""
    if not _SPEC.fullmatch(spec):
        raise UserError(
            f"{path}: environment.{field_name} {spec!r}: must be 'package.module:{what}' (a module importable from the "
            f"working directory or an installed package, a colon, then the {what.lower()}'s name)"
        )


@dataclass
class EnvironmentConfig:
    """Episodes of several model turns. Each model turn is sampled with ``actor_rollout``'s settings, at most
    ``actor_rollout.max_response_length`` tokens; the environment's and tools' messages are rendered with the actor
    tokenizer's chat template and appended as tokens the policy did not sample (not trained)."""

    name_or_path: str = _f(
        "",
        "the environment class, 'package.module:Class', built as Class(**kwargs) once per episode, with reset(task) "
        "-> str (the first user message; task: the prompt record) and step(reply) -> (next user message or None, "
        "reward, done); empty: tools only, the episode ends when the model answers without a tool call",
    )
    kwargs: dict[str, Any] = field(
        default_factory=dict, metadata={"help": "keyword arguments of the environment class (JSON values)"}
    )
    max_turns: int = _f(4, "model turns per episode (a reply with tool calls is a turn); then the episode is cut", 1)
    max_episode_tokens: int = _f(
        2048,
        "tokens of an episode, prompt and every turn (the model's, the environment's and the tools' messages) "
        "together; an episode that would grow past it ends at its last model turn, flagged cut",
        2,
    )
    step_timeout: float = _f(
        30.0,
        "seconds one environment call (construction and reset, or step) or one tool call may take; a late "
        "environment is an error of its episode (on_error), a late tool an error message to the model",
        0,
    )
    gamma: float = _f(
        1.0,
        "discount of the per-turn rewards: an outcome-only estimator (grpo, rloo, reinforce++) scores an episode "
        "sum_k gamma^k x reward_k plus the configured reward on the whole conversation",
        0,
    )
    on_error: str = _f(
        "zero",
        "what an environment fault (it raised, ran past step_timeout, returned a non-string message, a NaN or "
        "out-of-range reward, a message over max_observation_chars) does to its episode: zero (it ends there with "
        "reward 0), drop (it leaves the batch, with its whole group for a grouped estimator), stop (the run stops "
        "naming it); each is one log line naming the episode, the turn and the cause",
    )
    max_error_fraction: float = _f(
        0.25,
        "with on_error zero or drop: when more than this fraction of a step's episodes failed, the run stops "
        "naming the last failure (a broken environment is not trained on)",
        0,
    )
    max_observation_chars: int = _f(
        65536,
        "the longest message an environment step or a tool call may return, in characters; a longer one is an "
        "environment fault (on_error) or a tool error told to the model",
        1,
    )
    tools: list[str] = field(
        default_factory=list,
        metadata={
            "help": "tool functions, ['package.module:function', ...]: type hints and a docstring (Google style "
            "Args:) describe each to the model through the chat template (transformers.utils.get_json_schema); a "
            "reply's tool calls run (step_timeout each) and their results come back as tool messages"
        },
    )
    tool_call_format: str = _f(
        AUTO_FORMAT,
        "how tool calls are written (llm.settings.registry TOOL_CALL_FORMATS): auto (the format the chat template "
        "renders a tool call in; hermes when it renders none, with the tools described in a system message), "
        "hermes (<tool_call>{json}</tool_call>: Qwen2.5, Hermes), llama3 (a bare JSON object), mistral "
        "([TOOL_CALLS][...]), pythonic ([f(x=1)]), qwen3_xml (<function=f><parameter=x>), glm4 (<arg_key>)",
    )
    sandbox: bool = _f(
        False,
        "run each tool call in a child process with CPU-time (step_timeout), memory (sandbox_memory_mb) limits and "
        "no network (a new network namespace where the kernel allows it, else sockets refused; said in the log); "
        "false: tools run in this process, as trusted code",
    )
    sandbox_memory_mb: int = _f(1024, "sandbox: the address space of a tool's child process, in MiB", 64)

    def check(self, path: str) -> None:
        """What the types and lower bounds cannot say, for this section's own fields (``path``: the config file);
        the checks against other sections and the registries: ``llm.settings.ppo_validation``."""
        if not self.name_or_path and not self.tools:
            raise UserError(
                f"{path}: environment: give name_or_path (an environment class, 'package.module:Class') or tools "
                "(['package.module:function', ...]), or both; or remove the section for single-turn episodes"
            )
        if self.name_or_path:
            check_spec(self.name_or_path, "name_or_path", "Class", path)
        for i, spec in enumerate(self.tools):
            check_spec(spec, f"tools[{i}]", "function", path)
        if len(set(self.tools)) != len(self.tools):
            raise UserError(f"{path}: environment.tools names a function twice: {self.tools}")
        if self.on_error not in ON_ERROR:
            raise UserError(f"{path}: environment.on_error must be one of {', '.join(ON_ERROR)}, got {self.on_error!r}")
        for name in ("gamma", "max_error_fraction"):
            if getattr(self, name) > 1:
                raise UserError(f"{path}: environment.{name} must be in [0, 1], got {getattr(self, name):g}")
        if not 0 < self.step_timeout <= 3600:
            raise UserError(f"{path}: environment.step_timeout must be in (0, 3600] seconds, got {self.step_timeout:g}")
        if self.kwargs and not self.name_or_path:
            raise UserError(
                f"{path}: environment.kwargs is set but name_or_path is empty: kwargs are the environment's"
            )
