"""The multi-turn rollout source (rollout.py's interface): each step's prompts become episodes (runner.py), the
episodes become ``Samples`` with their multi-turn fields, and the trainer's ``score`` scores them.

``num_samples_per_step`` episodes per prompt, each with its own environment. An episode whose environment failed
follows ``environment.on_error``: ``zero`` keeps it with reward 0 (its turn rewards and its configured reward's
score set to 0; the tokens it sampled before the fault are trained towards that), ``drop`` leaves it out of the
batch before scoring: for a grouped estimator (grpo, rloo, ...) with its whole group, since a group's advantages
are relative to its members (the batch is smaller that step; ``episode/dropped`` counts the episodes left out).
"""

from __future__ import annotations

import time

import torch

from llm.alignment.ppo.agent.episode import Episode, Task, episode_metrics
from llm.alignment.ppo.agent.runner import EpisodeRunner
from llm.alignment.ppo.interfaces import Samples
from llm.alignment.ppo.prompts import Prompt
from llm.alignment.ppo.rollout import RolloutBatch, RolloutContext, sampling, scored_batch, wants_generation_log_probs
from llm.settings.registry import ADV_ESTIMATORS
from llm.utils.errors import UserError


def task_of(prompt: Prompt) -> Task:
    """An episode's task: the prompt record's fields as read, with its conversation (``messages``) and reference
    answer (``reference``), as the environment's ``reset`` gets it."""
    messages = prompt.messages or [{"role": "user", "content": prompt.text}]
    record = {**(prompt.record or {}), "messages": messages, "reference": prompt.reference}
    return Task(record, messages, prompt.ids)


def episode_samples(episodes: list[Episode], tokenizer, stop_ids: tuple[int, ...]) -> Samples:
    """The episodes as samples; one ``ended`` when its last token is a model token and one of the run's
    ``stop_ids`` (``RolloutContext.stop_ids``)."""
    return Samples(
        prompt_ids=[ep.prompt_ids for ep in episodes],
        response_ids=[ep.response_ids for ep in episodes],
        prompts=[tokenizer.decode(ep.prompt_ids, skip_special_tokens=True) for ep in episodes],
        responses=[tokenizer.decode(ep.response_ids, skip_special_tokens=True) for ep in episodes],
        references=[ep.task.record.get("reference") for ep in episodes],
        ended=torch.tensor([ep.action_mask[-1] == 1 and ep.response_ids[-1] in stop_ids for ep in episodes]),
        action_mask=[ep.action_mask for ep in episodes],
        turn_ends=[ep.turn_ends for ep in episodes],
        turn_rewards=[ep.turn_rewards for ep in episodes],
        episodes=[ep.record() for ep in episodes],
    )


def kept_episodes(episodes: list[Episode], on_error: str, group_size: int, grouped: bool) -> list[Episode]:
    """The episodes that stay in the batch: all but, with ``on_error`` drop, the failed ones (and with a grouped
    estimator every episode of a group that has a failed one)."""
    if on_error != "drop":
        return episodes
    if not grouped:
        return [ep for ep in episodes if not ep.failed]
    failed_groups = {ep.group for ep in episodes if ep.failed}
    return [ep for ep in episodes if ep.group not in failed_groups]


class MultiTurn:
    """Episodes with an environment and / or tools (``config.environment``)."""

    def __init__(self, context: RolloutContext) -> None:
        c = context.config
        self.context, self.e = context, c.environment
        self.runner = EpisodeRunner(
            c.environment, context.tokenizer, c.actor_rollout.max_response_length, context.stop_ids
        )
        self.grouped = ADV_ESTIMATORS[c.algorithm.adv_estimator].grouped

    def collect(self, step: int, round: int = 0) -> RolloutBatch:
        ctx, c = self.context, self.context.config
        start = time.perf_counter()
        tasks = [task_of(ctx.prompts[i]) for i in ctx.stream.indices(step)]
        k, want = c.actor_rollout.num_samples_per_step, wants_generation_log_probs(c)
        rollout = self.runner.run(ctx.generator, tasks, k, sampling(c, step, round, ctx.stop_ids), with_log_probs=want)
        kept = kept_episodes(rollout.episodes, self.e.on_error, k, self.grouped)
        if not kept:
            raise UserError(
                f"environment {self.e.name_or_path}: every episode of step {step} failed and on_error is drop: nothing "
                "to train on; the log names each failure"
            )
        zeroed = [i for i, ep in enumerate(kept) if ep.failed]
        for i in zeroed:  # on_error zero: the episode's reward is 0
            kept[i].turn_rewards = [0.0] * len(kept[i].turn_rewards)
        samples = episode_samples(kept, ctx.tokenizer, ctx.stop_ids)
        logprobs = None
        if want:
            T = max(len(ep.logprobs) for ep in kept)
            logprobs = torch.zeros(len(kept), T)
            for i, ep in enumerate(kept):
                logprobs[i, : len(ep.logprobs)] = torch.tensor(ep.logprobs)
        metrics = {
            "time/rollout": time.perf_counter() - start,
            "time/rollout_generation": rollout.generation_seconds,
            "time/rollout_environment": rollout.environment_seconds,
            **episode_metrics(rollout.episodes, len(rollout.episodes) - len(kept)),
        }
        batch = scored_batch(ctx, samples, logprobs, metrics=metrics)
        if zeroed:
            batch.scored.scores[zeroed] = 0.0
        return batch

    def after_update(self, step: int) -> None:
        self.context.generator.sync()

    def close(self, finished: bool) -> None:
        self.runner.close()
