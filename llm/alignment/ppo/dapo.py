"""DAPO's overlong reward shaping and dynamic sampling (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement
Learning System at Scale", arXiv 2503.14476, section 3.2 and 3.4), and the prompt stream they draw from.

Overlong reward shaping (``reward.overlong_buffer_len`` > 0), the paper's eq. (13), with ``L_max`` =
``actor_rollout.max_response_length`` and ``L_cache`` = ``reward.overlong_buffer_len``::

    R_length(y) = 0                                  if |y| <= L_max - L_cache
                = ((L_max - L_cache) - |y|) / L_cache if L_max - L_cache < |y| <= L_max
                = -1                                 if |y| > L_max

scaled by ``reward.overlong_penalty_factor`` and added to the outcome score the reward returned, before the EOS
penalty, normalisation and clipping (``shape_scores``) and before the KL enters. ``|y|`` counts the response's
tokens with its EOS (an empty response is scored on one stand-in EOS: length 1). Same as verl's ``dapo`` reward
manager (``min(-(|y| - (L_max - L_cache)) / L_cache * factor, 0)``, EOS counted, added to the score) and
OpenRLHF's ``--overlong_buffer_len`` / ``--overlong_penalty_factor`` (``-min(excess, L_cache) / L_cache *
factor``): generation stops at ``L_max``, so the three agree on every length that occurs; the ``-1`` branch is
kept for lengths given by hand. The ``score`` metric and ``samples.jsonl``'s ``score`` stay the reward's own
value; ``score_shaped`` includes the punishment.

Dynamic sampling (``algorithm.filter_groups``, section 3.2, the constraint ``0 < |{o_i | is_equivalent(a,
o_i)}| < G`` of eq. (11)): a group (the ``num_samples_per_step`` consecutive samples of one prompt) whose
outcomes are all equal has advantage 0 under GRPO / RLOO and gives no policy gradient; such groups are dropped,
and while fewer than ``data.rollout_batch_size`` groups remain the next ``rollout_batch_size`` prompts of the
stream are generated and scored, up to ``algorithm.max_num_gen_batches`` rounds per step (the first included).
A full batch keeps its first ``rollout_batch_size`` groups (the surplus is discarded, as verl does); at the cap
the step trains on the groups it has (a warning line), cut to the most whole groups that
``ppo_mini_batch_size`` divides; with none left the update of that step is skipped (a warning line). Extra
prompts come from the same seeded stream (``prompt_stream``) and their count is saved in the checkpoint
(``extra_prompts``), so a resumed run draws exactly the prompts of an uninterrupted one; round ``r`` of a step
samples with the step's seed plus ``r * ROUND_SEED_STRIDE``.

Where verl (``recipe/dapo/dapo_ray_trainer.py``) differs: it compares the groups on a chosen metric
(``filter_groups.metric``: ``acc``, the reward before the overlong punishment, in its DAPO recipe; or
``score`` / ``seq_reward`` / ``seq_final_reward``), keeps groups of one sample, draws ``data.gen_batch_size``
prompts per round and stops the run with an error at ``max_num_gen_batches`` (0: no cap); here the outcome is
the shaped score the advantages see (after the overlong punishment, normalisation and clipping, plus PRM step
rewards), each round draws ``rollout_batch_size`` prompts, and the cap trains on fewer groups instead of
stopping. OpenRLHF's ``--dynamic_filtering`` drops a group unless its mean score lies strictly inside
``--dynamic_filtering_reward_range`` (the same rule for 0/1 rewards with the range ``0 1``) and sends a new
prompt for each dropped one, with no cap. Neither skips a step: verl cannot end one without a full batch.

Metrics: ``dapo/overlong_penalty`` (mean punishment over the step's samples, <= 0) and ``dapo/overlong_frac``
(share of them longer than ``L_max - L_cache``) with the shaping on; ``dapo/gen_rounds``, ``dapo/groups_kept``,
``dapo/groups_dropped`` (all-equal groups over all rounds), ``dapo/groups_surplus`` (groups with unequal rewards
not trained on: beyond the batch, or cut for ``ppo_mini_batch_size``) and ``dapo/update_skipped`` (1: no group
left) with dynamic sampling.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Any

import torch

from llm.alignment.ppo.interfaces import Scored
from llm.settings.ppo import PPOConfig
from llm.utils.errors import UserError

logger = logging.getLogger(__name__)

ROUND_SEED_STRIDE = 1_000_000_007  # round r of a step samples with the step's seed + r * this (no step reaches it)


def overlong_punishment(
    lengths: torch.Tensor | list[int], max_length: int, buffer_len: int, factor: float = 1.0
) -> torch.Tensor:
    """``factor x R_length(|y|)`` per response (DAPO eq. 13, module docstring): 0 up to ``max_length -
    buffer_len`` tokens, then falling linearly to ``-factor`` at ``max_length``, ``-factor`` beyond;
    ``(B,)`` float32. ``buffer_len`` 0: no punishment."""
    lengths = torch.as_tensor(lengths, dtype=torch.float32)
    if buffer_len <= 0:
        return torch.zeros_like(lengths)
    expected = max_length - buffer_len
    return factor * ((expected - lengths) / buffer_len).clamp(-1.0, 0.0)


def informative_groups(outcomes: torch.Tensor, group_size: int) -> list[int]:
    """Indices of the groups of ``group_size`` consecutive outcomes that are not all equal (exactly: a group
    of equal scores has advantage 0 under GRPO and RLOO), in order."""
    grouped = outcomes.view(-1, group_size)
    return (grouped.amax(1) != grouped.amin(1)).nonzero().flatten().tolist()


def prompt_stream(n_prompts: int, position: int, count: int, seed: int, shuffle: bool) -> list[int]:
    """Prompts ``position .. position + count - 1`` of the run's stream: pass ``e`` over the ``n_prompts``
    prompts is a permutation seeded with ``seed + e`` (file order without ``shuffle``, MindSpeed's no_shuffle),
    so any stretch of it depends only on its position."""
    out: list[int] = []
    while len(out) < count:
        epoch, offset = divmod(position, n_prompts)
        order = list(range(n_prompts))
        if shuffle:
            random.Random(seed + epoch).shuffle(order)
        take = min(count - len(out), n_prompts - offset)
        out += order[offset : offset + take]
        position += take
    return out


def _pad(t: torch.Tensor | None, width: int) -> torch.Tensor | None:
    if t is None or t.dim() < 2:
        return t
    t = t[:, :width]
    return torch.nn.functional.pad(t, (0, width - t.shape[1]))


def _cat(parts: list, width: int) -> torch.Tensor | None:
    if any(p is None for p in parts):
        return None
    return torch.cat([_pad(p, width) for p in parts])


def select_scored(parts: list[tuple[Scored, list[int]]]) -> Scored:
    """One ``Scored`` of the samples ``idx`` of each ``(scored, idx)``, in order, its token tensors cut or
    padded with zeros to the longest kept response (a field None in any part is None)."""
    samples = [s.samples.select(idx) for s, idx in parts]
    width = max((len(r) for x in samples for r in x.response_ids), default=0)
    merged = samples[0]
    for x in samples[1:]:
        merged = type(merged)(
            merged.prompt_ids + x.prompt_ids,
            merged.response_ids + x.response_ids,
            merged.prompts + x.prompts,
            merged.responses + x.responses,
            merged.references + x.references,
            torch.cat([merged.ended, x.ended]),
        )

    def field(name: str):
        return _cat([None if getattr(s, name) is None else getattr(s, name)[idx] for s, idx in parts], width)

    return Scored(
        merged,
        *(field(name) for name in ("mask", "logprobs", "ref_logprobs", "values", "kl", "scores", "raw_scores")),
        field("dense"),
        field("is_weights"),
    )


class DAPO:
    """The trainer's DAPO hooks (``PPOTrainer.dapo``) and what they keep between steps: ``extra_prompts``, the
    prompts the extra rounds of dynamic sampling drew so far (saved in the checkpoint), and the round of the
    step in progress (its sampling seed)."""

    def __init__(self, config: PPOConfig) -> None:
        self.c = config
        self.extra_prompts = 0
        self.round = 0
        self.last: dict[str, float] = {}  # the sampling metrics of the latest step

    @property
    def filter_groups(self) -> bool:
        return self.c.algorithm.filter_groups

    @property
    def seed_shift(self) -> int:
        return self.round * ROUND_SEED_STRIDE

    def prompt_indices(self, n_prompts: int, step: int) -> list[int]:
        """The prompts of ``step``'s first round (or, during refill, of its current round)."""
        size = self.c.data.rollout_batch_size
        return prompt_stream(
            n_prompts, step * size + self.extra_prompts, size, self.c.training.seed, self.c.data.shuffle
        )

    def punish(self, scores: torch.Tensor, samples) -> torch.Tensor:
        """``scores`` plus the overlong punishment of each sample (unchanged with ``overlong_buffer_len`` 0)."""
        rw = self.c.reward
        if not rw.overlong_buffer_len:
            return scores
        lengths = [len(r) for r in samples.response_ids]
        penalty = overlong_punishment(
            lengths, self.c.actor_rollout.max_response_length, rw.overlong_buffer_len, rw.overlong_penalty_factor
        )
        return scores + penalty.to(scores.dtype)

    def metrics(self, scored: Scored) -> dict[str, float]:
        """The step's DAPO metrics (module docstring); empty with both parts off."""
        out = dict(self.last) if self.filter_groups else {}
        rw = self.c.reward
        if rw.overlong_buffer_len:
            lengths = torch.tensor([len(r) for r in scored.samples.response_ids], dtype=torch.float32)
            max_length = self.c.actor_rollout.max_response_length
            penalty = overlong_punishment(lengths, max_length, rw.overlong_buffer_len, rw.overlong_penalty_factor)
            out["dapo/overlong_penalty"] = penalty.mean().item()
            out["dapo/overlong_frac"] = (lengths > max_length - rw.overlong_buffer_len).float().mean().item()
        return out

    def state(self) -> dict:
        return {"extra_prompts": self.extra_prompts}

    def load_state(self, state: dict) -> None:
        """From ``trainer_state.json``; a checkpoint written before dynamic sampling drew none."""
        try:
            self.extra_prompts = int(state.get("dapo", {}).get("extra_prompts", 0))
        except (AttributeError, TypeError, ValueError) as err:
            raise UserError(
                f"trainer_state.json: dapo.extra_prompts is not a count ({err}); the checkpoint is damaged"
            ) from None

    @staticmethod
    def outcomes(s: Scored) -> torch.Tensor:
        """What the groups are compared on: the shaped score, plus the PRM step rewards when there are some."""
        return s.scores if s.dense is None else s.scores + (s.dense * s.mask).sum(1)

    def refill(
        self, trainer: Any, scored: Scored, rollout_logprobs: torch.Tensor | None, t0: float
    ) -> tuple[Scored, torch.Tensor | None, dict | None]:
        """Dynamic sampling after the step's first rollout was scored (``trainer``: the ``PPOTrainer``): ``(scored, rollout_logprobs, None)`` of the
        groups to train on, or ``(..., metrics)`` of a step whose update is skipped (no group left; the trainer
        returns those metrics)."""
        size, cap = self.c.data.rollout_batch_size, self.c.algorithm.max_num_gen_batches
        n = self.c.actor_rollout.num_samples_per_step
        parts: list[tuple[Scored, list[int], torch.Tensor | None]] = []  # each round's kept samples
        everything = []
        kept = dropped = 0
        rounds = 1
        while True:
            groups = informative_groups(self.outcomes(scored), n)
            dropped += len(scored.samples) // n - len(groups)
            kept += len(groups)
            parts.append((scored, [g * n + k for g in groups for k in range(n)], rollout_logprobs))
            everything.append((scored, list(range(len(scored.samples)))))
            if kept >= size or rounds >= cap:
                break
            rounds += 1
            self.extra_prompts += size  # the next prompts of the stream, counted in the checkpoint
            self.round = rounds - 1
            try:
                samples, rollout_logprobs = trainer.rollout(trainer.prompt_indices(trainer.step))
            finally:
                self.round = 0
            scored = trainer.score(samples, rollout_logprobs if trainer.reuses_rollout_log_probs else None)
        use = self.trainable_groups(min(kept, size), trainer.step)
        self.last = {
            "dapo/gen_rounds": float(rounds),
            "dapo/groups_kept": float(use),
            "dapo/groups_dropped": float(dropped),
            "dapo/groups_surplus": float(kept - use),
            "dapo/update_skipped": float(use == 0),
        }
        if kept < size:
            logger.warning(
                "DAPO dynamic sampling, step %d: %d of data.rollout_batch_size=%d groups have unequal rewards after "
                "algorithm.max_num_gen_batches=%d generation rounds (%d all-equal groups dropped): %s",
                trainer.step + 1,
                kept,
                size,
                cap,
                dropped,
                f"training on {use} groups" if use else "no update this step",
            )
        if use == 0:
            return scored, None, self.skip(trainer, select_scored(everything), t0)
        chosen, left = [], use * n  # the first ``use`` groups, in the order they were generated
        for s, idx, logprobs in parts:
            chosen.append((s, idx[:left], logprobs))
            left -= len(chosen[-1][1])
        out = select_scored([(s, idx) for s, idx, _ in chosen])
        width = out.mask.shape[1]
        logprobs = _cat([None if lp is None else lp[idx] for _, idx, lp in chosen], width)
        return out, logprobs, None

    def trainable_groups(self, groups: int, step: int) -> int:
        """``groups``, or when ``ppo_mini_batch_size`` does not divide their samples the most whole groups whose
        samples it divides (all of them when there is no such count, or the samples fit one mini-batch)."""
        n, mb = self.c.actor_rollout.num_samples_per_step, self.c.actor_rollout.ppo_mini_batch_size
        if not groups or (groups * n) % mb == 0 or groups * n < mb:
            return groups
        best = next((g for g in range(groups, 0, -1) if (g * n) % mb == 0), 0)
        if best:
            logger.warning(
                "DAPO dynamic sampling, step %d: actor_rollout.ppo_mini_batch_size=%d does not divide the %d samples "
                "of %d groups: training on the first %d groups (%d samples)",
                step + 1,
                mb,
                groups * n,
                groups,
                best,
                best * n,
            )
            return best
        logger.warning(
            "DAPO dynamic sampling, step %d: actor_rollout.ppo_mini_batch_size=%d does not divide the %d samples of "
            "%d groups, nor those of fewer whole groups: the last mini-batch is smaller",
            step + 1,
            mb,
            groups * n,
            groups,
        )
        return groups

    def skip(self, trainer: Any, scored: Scored, t0: float) -> dict:
        """A step without an update: every group's rewards were equal. Its samples are logged (with their zero
        advantages) and the step counts; the models, optimizers and KL controller stay as they are."""
        trainer.last_experience = trainer.advantages(scored)
        mask = scored.mask
        trainer.step += 1
        return {
            "score": scored.raw_scores.mean().item(),
            "score_shaped": scored.scores.mean().item(),
            "kl": (scored.kl * mask).sum(1).mean().item(),
            "kl_coef": trainer.kl_ctl.value,
            "response_length": mask.sum(1).mean().item(),
            "eos_rate": scored.samples.ended.float().mean().item(),
            **self.metrics(scored),
            "time/step": time.perf_counter() - t0,
        }
