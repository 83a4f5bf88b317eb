"""The episode loop: a batch of episodes, turn by turn, all live episodes generating together.

Each round: (1) one batched ``policy.generate`` over every live episode's tokens so far (one sample each, at most
``max_response_length`` new tokens and no more than the longest room left, the turn's seed derived from the step's);
(2) each episode's reply is answered concurrently in a thread pool, so one slow environment does not serialise the
batch: its tool calls run (tools.py; in child processes with ``sandbox``), or the environment steps; (3) the
answers are rendered with the chat template and appended as tokens the policy did not sample (chat.py). An episode
ends when the environment says done, when the model answers without a tool call and there is no environment, or
when it is cut: ``max_turns`` model turns, ``max_episode_tokens`` (the turn or the next message would not fit: the
episode ends at its last model token), or a turn that reached ``max_response_length`` without a stop id (the
tokenizer's EOS, or another of the run's ``stop_ids``).

An environment fault ends its episode (environments.py) with one log line naming the episode, the turn and the
cause; ``on_error: stop`` stops the run there, and when more than ``max_error_fraction`` of a batch's episodes
failed the run stops naming the last fault. What ``zero`` and ``drop`` do to the samples is the rollout source's
(source.py).
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from llm.alignment.ppo.agent.chat import ChatFormat
from llm.alignment.ppo.agent.environments import EnvironmentFault, Environments
from llm.alignment.ppo.agent.episode import Episode, Task
from llm.alignment.ppo.agent.sandbox import SandboxPool
from llm.alignment.ppo.agent.tools import ToolBox, ToolResult, load_tools
from llm.settings.environment import EnvironmentConfig
from llm.utils.errors import UserError

logger = logging.getLogger(__name__)

MAX_THREADS = 64  # environment / tool steps of one round at once


@dataclass
class Answer:
    """What an episode's reply led to: new messages to append (``messages``; tool results after a call of ``tool``),
    or the end (``cut``, None: done), or an environment fault (``fault``)."""

    messages: list[dict[str, Any]] | None = None
    tool: str | None = None  # the tool the turn called (tool results follow)
    cut: str | None = None
    fault: str | None = None


@dataclass
class Rollout:
    episodes: list[Episode]
    generation_seconds: float
    environment_seconds: float  # wall time of the rounds' environment / tool phases (concurrent)


class EpisodeRunner:
    """``run(policy, tasks, samples_per_task, sampling)`` -> ``Rollout``. Built once per run: imports the
    environment and tools and checks the chat template (``ChatFormat``)."""

    def __init__(
        self, e: EnvironmentConfig, tokenizer, max_response_length: int, stop_ids: tuple[int, ...] | None = None
    ) -> None:
        """``stop_ids``: the ids that end a model turn (the run's ``RolloutContext.stop_ids``; None: the
        tokenizer's EOS)."""
        self.e, self.tokenizer, self.max_response_length = e, tokenizer, max_response_length
        self.stop_ids = (tokenizer.eos_token_id,) if stop_ids is None else stop_ids
        self.envs = (
            Environments(e.name_or_path, e.kwargs, e.step_timeout, e.max_observation_chars) if e.name_or_path else None
        )
        tools = load_tools(e.tools)
        self.sandbox = (
            SandboxPool([t.spec for t in tools.values()], e.sandbox_memory_mb, os.cpu_count() or 1)
            if e.sandbox and tools
            else None
        )
        self.toolbox = ToolBox(tools, e.step_timeout, e.max_observation_chars, self.sandbox)
        self.chat = ChatFormat(tokenizer, self.toolbox.schemas, e.tool_call_format)

    def close(self) -> None:
        if self.sandbox is not None:
            self.sandbox.close()

    # --- one batch --------------------------------------------------------------------------------------
    def run(
        self, policy, tasks: list[Task], samples_per_task: int, sampling: dict[str, Any], with_log_probs: bool = False
    ) -> Rollout:
        k = samples_per_task
        episodes = [Episode(i * k + j, i, t) for i, t in enumerate(tasks) for j in range(k)]
        generation = environment = 0.0
        with ThreadPoolExecutor(min(MAX_THREADS, len(episodes)), thread_name_prefix="agent-step") as pool:
            t0 = time.perf_counter()
            for ep, first in zip(episodes, pool.map(self._reset, episodes)):
                self._start(ep, first)
            self._close_finished(pool, episodes)
            environment += time.perf_counter() - t0
            round_ = 0
            while live := [ep for ep in episodes if not ep.finished]:
                t0 = time.perf_counter()
                texts = self._generate(policy, live, sampling, round_, with_log_probs)
                t1 = time.perf_counter()
                answering = [(ep, text) for ep, text in zip(live, texts) if not ep.finished]
                answers = list(pool.map(lambda pair: self._answer(*pair), answering))
                for (ep, _), answer in zip(answering, answers):
                    self._apply(ep, answer)
                self._close_finished(pool, episodes)
                generation, environment = generation + t1 - t0, environment + time.perf_counter() - t1
                round_ += 1
        self._check_error_fraction(episodes)
        return Rollout(episodes, generation, environment)

    def _close_finished(self, pool: ThreadPoolExecutor, episodes: list[Episode]) -> None:
        """``close()`` the environments of the episodes that ended (concurrently); a failure is logged."""
        ending = [ep for ep in episodes if ep.finished and ep.env is not None]
        for ep, problem in zip(ending, pool.map(lambda ep: self.envs.close(ep.env), ending)):
            ep.env = None
            if problem is not None:
                logger.warning("environment %s: episode %d: %s", self.e.name_or_path, ep.index, problem)

    def _reset(self, ep: Episode) -> list[dict[str, Any]] | EnvironmentFault:
        """In a pool thread: the episode's environment and first conversation, or the environment's fault."""
        if self.envs is None:
            return ep.task.messages
        start = time.perf_counter()
        try:
            ep.env, first = self.envs.start(ep.task.record)
        except EnvironmentFault as err:
            return err
        finally:
            ep.env_seconds += time.perf_counter() - start
        # the record's system messages and history stay; the environment's message is the user's turn
        return [*ep.task.messages[:-1], {"role": "user", "content": first}]

    def _start(self, ep: Episode, first: list[dict[str, Any]] | EnvironmentFault) -> None:
        if isinstance(first, EnvironmentFault):
            self._fail(ep, str(first))
            return
        for m in first:
            ep.note(m["role"], m["content"])
        ep.prompt_ids = self.chat.prompt_ids(first)
        if len(ep.prompt_ids) >= self.e.max_episode_tokens:  # (the tools' descriptions count too)
            n, ep.prompt_ids = len(ep.prompt_ids), []  # the sample keeps the data's prompt
            self._fail(ep, f"the first prompt renders to {n} tokens, no room left in environment.max_episode_tokens")

    def _generate(self, policy, live: list[Episode], sampling: dict[str, Any], round_: int, with_log_probs: bool):
        """One model turn for every live episode; the turns' texts (for the answers), after the bookkeeping."""
        rooms = [self.e.max_episode_tokens - ep.length for ep in live]
        seed = sampling.get("seed")
        settings = {
            **sampling,
            "stop_ids": self.stop_ids,
            "num_samples": 1,
            "max_new_tokens": min(self.max_response_length, max(rooms)),
            "seed": None if seed is None else seed + 7919 * round_,
            "with_log_probs": with_log_probs,
        }
        out = policy.generate([ep.prompt_ids + ep.response_ids for ep in live], **settings)
        turns, logprobs = out if with_log_probs else (out, None)
        texts = []
        for i, (ep, ids, room) in enumerate(zip(live, turns, rooms)):
            kept = list(ids[:room])
            ep.add_model_turn(kept, None if logprobs is None else logprobs[i, : len(kept)].tolist())
            ended = bool(kept) and kept[-1] in self.stop_ids
            body = kept[:-1] if ended else kept
            texts.append(self.tokenizer.decode(body, skip_special_tokens=False))  # for the tool-call parser
            ep.note("assistant", self.tokenizer.decode(body, skip_special_tokens=True))
            if len(ids) > room or (not ended and len(kept) == room):
                ep.end("max_episode_tokens")
            elif not ended:
                ep.end("max_response_length")
        return texts

    def _answer(self, ep: Episode, text: str) -> Answer:
        """In a pool thread: the tools' or the environment's answer to the episode's last turn."""
        start = time.perf_counter()
        try:
            parsed = self.chat.parse(text)
            turn = ep.turns[-1]
            if parsed.has_calls:
                turn["tool_calls"] = [{"name": c.name, "arguments": c.arguments} for c in parsed.calls]
                if ep.model_turns >= self.e.max_turns:
                    return Answer(cut="max_turns")
                results = [self.toolbox.run(c) for c in parsed.calls]
                results += [ToolResult("", f"Error: {error}", True) for error in parsed.errors]
                ep.tool_calls += len(results)
                ep.tool_errors += sum(r.error for r in results)
                turn["tool_results"] = [{"name": r.name, "text": r.text, "error": r.error} for r in results]
                return Answer(self.chat.tool_messages(results), results[0].name or "tool")
            if self.envs is None:
                return Answer()  # tools only: an answer without a call ends the episode
            message, reward, done = self.envs.step(ep.env, turn["text"])
            ep.turn_rewards[-1] = reward
            turn["reward"] = reward
            if message is not None:
                ep.note("user", message)
            if done:
                return Answer()
            if ep.model_turns >= self.e.max_turns:
                return Answer(cut="max_turns")
            return Answer([{"role": "user", "content": message}])
        except EnvironmentFault as err:
            return Answer(fault=str(err))
        finally:
            ep.env_seconds += time.perf_counter() - start

    def _apply(self, ep: Episode, answer: Answer) -> None:
        if answer.fault is not None:
            self._fail(ep, answer.fault)
        elif answer.messages is None:
            ep.end(answer.cut)
        else:
            ids = self.chat.message_ids(answer.messages, answer.tool)
            if len(ids) >= self.e.max_episode_tokens - ep.length:  # no room left for a model token after them
                ep.end("max_episode_tokens")
            else:
                ep.add_context(ids)

    # --- faults -----------------------------------------------------------------------------------------
    def _fail(self, ep: Episode, cause: str) -> None:
        ep.fail(cause, self.tokenizer.eos_token_id)
        what = {
            "zero": "it ends with reward 0",
            "drop": "it leaves the batch",
            "stop": "the run stops",
        }[self.e.on_error]
        line = (
            f"environment {self.e.name_or_path or '(tools)'}: episode {ep.index} (prompt {ep.group} of the batch), "
            f"turn {ep.model_turns}: {cause}; on_error={self.e.on_error}: {what}"
        )
        logger.warning(line)
        if self.e.on_error == "stop":
            raise UserError(line)

    def _check_error_fraction(self, episodes: list[Episode]) -> None:
        failed = [ep for ep in episodes if ep.failed]
        if failed and len(failed) / len(episodes) > self.e.max_error_fraction:
            last = failed[-1]
            raise UserError(
                f"environment {self.e.name_or_path}: {len(failed)} of {len(episodes)} episodes of this step failed, "
                f"more than environment.max_error_fraction={self.e.max_error_fraction:g}; the last: episode "
                f"{last.index}, {last.errors[-1]}. Fix the environment (or raise max_error_fraction)"
            )
