"""DAPO's overlong reward shaping and dynamic sampling (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement
Learning System at Scale", arXiv 2503.14476, section 3.2 and 3.4), the latter a rollout source (``DynamicSampling``).

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
(``extra_prompts``, kept by ``prompts.PromptStream``), so a resumed run draws exactly the prompts of an
uninterrupted one; round ``r`` of a step samples with the step's seed plus ``r * ROUND_SEED_STRIDE``. Dynamic
sampling is a rollout source around another (``DynamicSampling``, rollout.py): it asks the inner source for more
rounds and returns the groups to train on, or a batch marked ``update=False`` when none is left.
``algorithm.filter_groups_range`` ``[low, high]`` also drops a group unless the mean of its rewards (the reward's
own values, ``Scored.raw_scores``) lies in the band, both ends included: the PRIME paper's online prompt filtering
(Cui et al. 2025, section 3.4; verl's ``data.filter_accuracy`` with ``accuracy_lower_bound`` 0.2 and
``accuracy_upper_bound`` 0.8 in ``recipe/prime``), which keeps the prompts of middling difficulty.

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
``dapo/groups_dropped`` (all-equal groups, or outside the range, over all rounds), ``dapo/groups_surplus`` (groups with unequal rewards
not trained on: beyond the batch, or cut for ``ppo_mini_batch_size``) and ``dapo/update_skipped`` (1: no group
left) with dynamic sampling.
"""

from __future__ import annotations

import logging

import torch

from llm.alignment.ppo.agent.episode import merge_episode_metrics
from llm.alignment.ppo.interfaces import Samples, Scored
from llm.alignment.ppo.prompts import PromptStream
from llm.alignment.ppo.rollout import ROUND_SEED_STRIDE, RolloutBatch, RolloutSource
from llm.settings.ppo import PPOConfig

logger = logging.getLogger(__name__)

__all__ = ["DAPO", "ROUND_SEED_STRIDE", "DynamicSampling", "informative_groups", "overlong_punishment", "select_scored"]


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


def informative_groups(
    outcomes: torch.Tensor, group_size: int, rewards: torch.Tensor | None = None, band: list[float] | None = None
) -> list[int]:
    """Indices of the groups of ``group_size`` consecutive outcomes that are not all equal (exactly: a group
    of equal scores has advantage 0 under GRPO and RLOO), in order; with ``band`` ``[low, high]`` also only those
    whose mean of ``rewards`` lies in it (``algorithm.filter_groups_range``)."""
    grouped = outcomes.view(-1, group_size)
    keep = grouped.amax(1) != grouped.amin(1)
    if band is not None:
        mean = rewards.view(-1, group_size).double().mean(1)
        keep &= (mean >= band[0]) & (mean <= band[1])
    return keep.nonzero().flatten().tolist()


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
    merged = Samples.concat(samples)

    def field(name: str):
        return _cat([None if getattr(s, name) is None else getattr(s, name)[idx] for s, idx in parts], width)

    components = None  # several rewards: each one's (B,), of the kept samples
    if all(s.components is not None for s, _ in parts):
        components = {name: torch.cat([s.components[name][idx] for s, idx in parts]) for name in parts[0][0].components}
    return Scored(
        merged,
        *(field(name) for name in ("mask", "logprobs", "ref_logprobs", "values", "kl", "scores", "raw_scores")),
        field("dense"),
        field("is_weights"),
        field("env_rewards"),
        components,
    )


class DAPO:
    """DAPO's overlong reward shaping (``punish``, ``metrics``) and the batch cut of dynamic sampling
    (``trainable_groups``), as the config sets them."""

    def __init__(self, config: PPOConfig) -> None:
        self.c = config

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
        """The step's overlong-shaping metrics (module docstring); empty with the shaping off."""
        out = {}
        rw = self.c.reward
        if rw.overlong_buffer_len:
            lengths = torch.tensor([len(r) for r in scored.samples.response_ids], dtype=torch.float32)
            max_length = self.c.actor_rollout.max_response_length
            penalty = overlong_punishment(lengths, max_length, rw.overlong_buffer_len, rw.overlong_penalty_factor)
            out["dapo/overlong_penalty"] = penalty.mean().item()
            out["dapo/overlong_frac"] = (lengths > max_length - rw.overlong_buffer_len).float().mean().item()
        return out

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


def outcomes(s: Scored) -> torch.Tensor:
    """What the groups are compared on: the shaped score, plus the PRM step rewards and a multi-turn episode's
    environment rewards when there are some."""
    out = s.scores if s.dense is None else s.scores + (s.dense * s.mask).sum(1)
    return out if s.env_rewards is None else out + (s.env_rewards * s.mask).sum(1)


class DynamicSampling:
    """DAPO's dynamic sampling as a rollout source around ``inner`` (module docstring): all-equal groups out,
    more rounds of prompts in, up to ``algorithm.max_num_gen_batches`` rounds."""

    def __init__(self, inner: RolloutSource, config: PPOConfig, stream: PromptStream) -> None:
        self.inner, self.c, self.stream = inner, config, stream
        self.dapo = DAPO(config)

    def collect(self, step: int, round: int = 0) -> RolloutBatch:
        """Step ``step``'s groups to train on, with ``dapo/...`` metrics; ``update=False`` when none is left."""
        size, cap = self.c.data.rollout_batch_size, self.c.algorithm.max_num_gen_batches
        n, band = self.c.actor_rollout.num_samples_per_step, self.c.algorithm.filter_groups_range
        parts: list[tuple[Scored, list[int], torch.Tensor | None]] = []  # each round's kept samples
        everything = []
        kept = dropped = 0
        rounds = 1
        seconds = {"time/rollout": 0.0, "time/score": 0.0}
        rounds_metrics = []  # each round's own metrics (a multi-turn source's episode/...), merged below
        while True:
            batch = self.inner.collect(step, rounds - 1)
            rounds_metrics.append(batch.metrics)
            for key, value in batch.metrics.items():  # every round's seconds (the inner source's phases too)
                if key.startswith("time/"):
                    seconds[key] = seconds.get(key, 0.0) + value
            scored = batch.scored
            groups = informative_groups(outcomes(scored), n, scored.raw_scores, band)
            dropped += len(scored.samples) // n - len(groups)
            kept += len(groups)
            parts.append((scored, [g * n + k for g in groups for k in range(n)], batch.behaviour_logprobs))
            everything.append((scored, list(range(len(scored.samples)))))
            if kept >= size or rounds >= cap:
                break
            rounds += 1
            self.stream.draw_more()  # the next prompts of the stream, counted in the checkpoint
        use = self.dapo.trainable_groups(min(kept, size), step)
        metrics = {
            "dapo/gen_rounds": float(rounds),
            "dapo/groups_kept": float(use),
            "dapo/groups_dropped": float(dropped),
            "dapo/groups_surplus": float(kept - use),
            "dapo/update_skipped": float(use == 0),
            **seconds,
            **merge_episode_metrics(rounds_metrics),
        }
        if kept < size:
            logger.warning(
                "DAPO dynamic sampling, step %d: %d of data.rollout_batch_size=%d groups have unequal rewards after "
                "algorithm.max_num_gen_batches=%d generation rounds (%d all-equal groups dropped): %s",
                step + 1,
                kept,
                size,
                cap,
                dropped,
                f"training on {use} groups" if use else "no update this step",
            )
        if use == 0:  # logged with its zero advantages; the step counts, nothing is updated
            return RolloutBatch(select_scored(everything), None, metrics, update=False)
        chosen, left = [], use * n  # the first ``use`` groups, in the order they were generated
        for s, idx, logprobs in parts:
            chosen.append((s, idx[:left], logprobs))
            left -= len(chosen[-1][1])
        out = select_scored([(s, idx) for s, idx, _ in chosen])
        width = out.mask.shape[1]
        logprobs = _cat([None if lp is None else lp[idx] for _, idx, lp in chosen], width)
        return RolloutBatch(out, logprobs, metrics)

    def after_update(self, step: int) -> None:
        self.inner.after_update(step)

    def close(self, finished: bool) -> None:
        self.inner.close(finished)
