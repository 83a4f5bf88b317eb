"""Phase 2 of a PPO step: the samples' old and reference log-probs, the critic's values, the KL and the shaped
scores (``Scored``). The trainer holds one ``Scoring`` (its ``score``); a rollout source calls it through
``RolloutContext.score`` on the samples it made. Multi-turn samples: the log-probs and values come from one forward
over the whole episode, the KL counts on the model's tokens only (``Samples.response_mask``), and the environment's
rewards become ``Scored.env_rewards`` (``algorithm.environment_rewards``)."""

from __future__ import annotations

import torch

from llm.alignment.ppo.algorithm import ADV_ESTIMATORS, RunningMoments, environment_rewards, kl_estimate, shape_scores
from llm.alignment.ppo.dapo import DAPO
from llm.alignment.ppo.interfaces import Actor, Critic, Policy, Reward, Samples, Scored
from llm.alignment.ppo.lanes import together
from llm.settings.ppo import PPOConfig


class Scoring:
    """The roles' phase-2 calls and the running reward moments (``reward.normalize_reward``) they update."""

    def __init__(
        self,
        config: PPOConfig,
        actor: Actor,
        reward: Reward,
        ref: Policy | None,
        critic: Critic | None,
        moments: RunningMoments,
        dapo: DAPO,
    ) -> None:
        self.c, self.actor, self.reward, self.ref, self.critic = config, actor, reward, ref, critic
        self.moments, self.dapo = moments, dapo
        self.ref_head_given = False  # the actor holds the reference's LM head (kl_penalty "full")

    def together(self, *calls):
        """Independent role calls, at the same time where the roles allow it (lanes.py)."""
        pool = self.c.resource_pool
        return together(calls, pool.use_ray and pool.concurrent_roles)

    @torch.no_grad()
    def score(self, samples: Samples, rollout_logprobs: torch.Tensor | None = None) -> Scored:
        """``rollout_logprobs``: the old log-probs the rollout source has (the generation's with
        ``rollout_log_probs``, or the generating copy's forward), used instead of the actor's forward."""
        alg, rw = self.c.algorithm, self.c.reward
        mask = samples.response_mask()
        full = alg.kl_penalty == "full" and self.ref is not None

        def actor():
            if self.c.on_policy_update:
                return None  # the update's own forward gives them (on_policy_update)
            return self.actor.log_probs(samples) if rollout_logprobs is None else rollout_logprobs

        def ref():
            return self.ref.log_probs(samples) if self.ref is not None else None

        def critic():
            return self.critic.values(samples) if self.critic is not None else None

        def actor_after_ref():
            # The exact KL, never a (B, T, V) tensor: the reference returns its final hidden states (B, T, H)
            # and the actor reads them chunk by chunk with the reference's LM head, which it holds (frozen;
            # sent once: in one process the reference's own tensors, from Ray workers a copy).
            if not self.ref_head_given:
                self.actor.take_reference_head(self.ref.lm_head(on_cpu=self.c.resource_pool.use_ray))
                self.ref_head_given = True
            ref_logprobs, ref_hidden = self.ref.log_probs(samples, with_hidden=True)
            return (*self.actor.log_probs(samples, ref_hidden=ref_hidden), ref_logprobs)

        rest = ((self.critic, critic), (self.reward, lambda: self.reward.score(samples)))
        if full:  # the actor's call waits for the reference's: one lane
            (logprobs, kl, ref_logprobs), values, out = self.together((self.ref, actor_after_ref), *rest)
        else:
            logprobs, ref_logprobs, values, out = self.together((self.actor, actor), (self.ref, ref), *rest)
            kl = self.kl(logprobs, ref_logprobs, mask)
        raw = out.scores.clone()
        punished = self.dapo.punish(out.scores, samples)  # DAPO's overlong punishment, before the rest (dapo.py)
        scores = shape_scores(
            punished, samples.ended, self.moments, alg.missing_eos_penalty, rw.normalize_reward, rw.reward_clip
        )
        env = None
        if samples.turn_rewards is not None:  # multi-turn: per turn (GAE) or one discounted outcome
            per_turn, gamma = ADV_ESTIMATORS[alg.adv_estimator].per_turn, self.environment_gamma
            env = environment_rewards(samples.turn_ends, samples.turn_rewards, mask, per_turn, gamma)
        return Scored(
            samples, mask, logprobs, ref_logprobs, values, kl * mask, scores, raw, out.dense, env_rewards=env,
            components=out.components,
        )  # fmt: skip

    @property
    def environment_gamma(self) -> float:
        """``environment.gamma``: the discount of a multi-turn episode's per-turn rewards into its outcome."""
        return 1.0 if self.c.environment is None else float(self.c.environment.gamma)

    def kl(self, logprobs: torch.Tensor | None, ref_logprobs: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor:
        """Per-token KL estimate; 0 without a reference, or before an on-policy update has given the log-probs."""
        if logprobs is None or ref_logprobs is None:
            return torch.zeros(mask.shape)
        return kl_estimate(logprobs, ref_logprobs, self.c.algorithm.kl_penalty)
