"""PPO as an explicit loop over named phases with typed records between them:

    rollout (actor generates) -> Samples
    score (actor/ref log-probs, critic values, rewards) -> Scored
    advantages (KL-shaped rewards, GAE / GRPO / RLOO / REINFORCE++) -> Experience
    update (actor and critic mini-batch epochs) -> step statistics

Not a copy of ``Trainer.train``: each phase is a method that only talks to the role interfaces
(interfaces.py's protocols) with records and tensors in and statistics out; a role object is the role
itself (roles.py, rewards/) or its Ray proxy (ray_roles.py), and nothing here depends on which.
"""

from __future__ import annotations

import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from llm.alignment.ppo.algorithm import (
    ADV_ESTIMATORS,
    KL_CONTROLLERS,
    RunningMoments,
    kl_estimate,
    masked_mean,
    masked_whiten,
    shape_scores,
    token_rewards,
    truncated_is_weights,
)
from llm.alignment.ppo.async_rollout import AsyncRollouts
from llm.alignment.ppo.dapo import DAPO
from llm.alignment.ppo.interfaces import (
    Actor,
    Critic,
    Experience,
    Policy,
    PolicyBatch,
    Reward,
    Samples,
    Scored,
    UpdateStats,
    ValueBatch,
)
from llm.alignment.ppo.loop import train_loop
from llm.alignment.ppo.prompts import Prompt, make_samples
from llm.alignment.ppo.samples_log import SAMPLES_FILE, append_samples, sample_rows, samples_markdown
from llm.settings.fingerprint import Fingerprint, run_fingerprint
from llm.settings.ppo import PPOConfig
from llm.utils.errors import UserError

logger = logging.getLogger(__name__)


class PPOTrainer:
    """The PPO loop over the roles. ``tokenizer`` is the actor's (prompts and responses are its ids);
    ``rollout_copy`` is a separate generation copy of the actor (Ray, own devices), synced after each
    update; without one the actor generates with its trained weights."""

    def __init__(
        self,
        config: PPOConfig,
        prompts: list[Prompt],
        tokenizer,
        actor: Actor,
        reward: Reward,
        ref: Policy | None = None,
        critic: Critic | None = None,
        rollout_copy: Policy | None = None,
        fingerprint: Fingerprint | None = None,
    ) -> None:
        self.c, self.prompts, self.tokenizer = config, prompts, tokenizer
        self._run_fingerprint = fingerprint  # the build's (PPOContext); None: the config's, as written, when asked
        self.actor, self.ref, self.critic, self.reward = actor, ref, critic, reward
        self.rollout_copy = rollout_copy
        self.ref_head_given = False  # the actor holds the reference's LM head (kl_penalty "full")
        self.last_checkpoint: str | None = None
        self.kl_ctl = KL_CONTROLLERS[config.algorithm.kl_ctrl.type](config.algorithm.kl_ctrl)
        self.moments = RunningMoments()
        self.dapo = DAPO(config)  # DAPO's overlong shaping and dynamic sampling (dapo.py)
        self.step = 0
        self.history: list[dict] = []  # per mini-batch losses, for tests and debugging
        self.log_history: list[dict] = []
        self.writer = None
        self.async_rollouts: AsyncRollouts | None = None  # while train() runs with async_rollout

    def together(self, *calls):
        """The results of independent role calls, each ``(role, zero-argument callable)``, in order. With
        Ray roles and ``resource_pool.concurrent_roles`` the calls to roles in different processes run
        at the same time, each waiting on its own actors; calls to colocated roles (one process) run one
        after another in call order, as they would there anyway, so a failure is reported by the call
        that met it. In one process (or without the setting): one after another. The first failure is
        raised once every call has ended (each is bounded by ``call_timeout``)."""
        pool = self.c.resource_pool
        if not (pool.use_ray and pool.concurrent_roles) or len(calls) < 2:
            return [fn() for _, fn in calls]
        lanes: dict = {}  # process group -> indices of its calls
        for i, (role, _) in enumerate(calls):
            lanes.setdefault(tuple(getattr(role, "pids", ())) or id(role), []).append(i)
        results: list = [None] * len(calls)

        def run(indices):
            for i in indices:
                results[i] = calls[i][1]()

        with ThreadPoolExecutor(len(lanes), thread_name_prefix="ppo-role") as executor:
            futures = [executor.submit(run, indices) for indices in lanes.values()]
            for f in futures:
                f.result()
        return results

    # --- phase 0: which prompts --------------------------------------------------------------
    def prompt_indices(self, step: int) -> list[int]:
        """Prompts of ``step``: a fresh seeded permutation per pass over the data, so the order only depends on the
        step number and the prompts DAPO's extra rounds drew, which are saved (``dapo.prompt_stream``)."""
        return self.dapo.prompt_indices(len(self.prompts), step)

    # --- phase 1: rollout --------------------------------------------------------------------
    def sampling(self, step: int) -> dict:
        """``generate``'s settings for the rollout of ``step``; its seed depends on the step and DAPO's round only."""
        a = self.c.actor_rollout
        return {
            "num_samples": a.num_samples_per_step,
            "max_new_tokens": a.max_response_length,
            "do_sample": a.do_sample,
            "top_p": a.top_p,
            "top_k": a.top_k,
            "ignore_eos": a.ignore_eos,
            "seed": self.c.training.seed * 1_000_003 + step + self.dapo.seed_shift,
        }

    def rollout(self, indices: list[int]) -> tuple[Samples, torch.Tensor | None]:
        """The samples, and with ``rollout_log_probs`` or ``rollout_is_cap`` the log-probs of their tokens that
        the generating engine computed (None: not asked, or an empty response)."""
        if self.async_rollouts is not None:  # generated by the copy, meanwhile (async_rollout.py)
            return self.async_rollouts.take(indices)
        a = self.c.actor_rollout
        prompts = [self.prompts[i] for i in indices]
        generator = self.actor if self.rollout_copy is None else self.rollout_copy
        reuse = self.reuses_rollout_log_probs or a.rollout_is_cap is not None
        out = generator.generate([p.ids for p in prompts], **self.sampling(self.step), with_log_probs=reuse)
        responses, logprobs = out if reuse else (out, None)
        if logprobs is not None and not all(responses):
            logprobs = None  # an empty response is scored on a stand-in EOS: no generated log-prob for it
        return self.make_samples(prompts, responses), logprobs

    @property
    def reuses_rollout_log_probs(self) -> bool:
        """The old log-probs are the generation's (``rollout_log_probs``), not a forward's."""
        return self.c.actor_rollout.rollout_log_probs and self.c.algorithm.kl_penalty != "full"

    def make_samples(self, prompts: list[Prompt], responses: list[list[int]]) -> Samples:
        return make_samples(prompts, responses, self.tokenizer)

    # --- phase 2: score ----------------------------------------------------------------------
    @torch.no_grad()
    def score(self, samples: Samples, rollout_logprobs: torch.Tensor | None = None) -> Scored:
        """``rollout_logprobs``: the actor's log-probs from generation (``rollout_log_probs``), used
        instead of the actor's forward."""
        alg, rw = self.c.algorithm, self.c.reward
        mask = samples.response_mask()
        full = alg.kl_penalty == "full" and self.ref is not None

        def actor():
            if self.c.on_policy_update:
                return None  # the update's own forward gives them (on_policy_update)
            policy = self.async_rollouts or self.actor  # async_rollout: the generating policy's (async_rollout.py)
            return policy.log_probs(samples) if rollout_logprobs is None else rollout_logprobs

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
        return Scored(samples, mask, logprobs, ref_logprobs, values, kl * mask, scores, raw, out.dense)

    def kl(self, logprobs: torch.Tensor | None, ref_logprobs: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor:
        """Per-token KL estimate; 0 without a reference, or before an on-policy update has given the log-probs."""
        if logprobs is None or ref_logprobs is None:
            return torch.zeros(mask.shape)
        return kl_estimate(logprobs, ref_logprobs, self.c.algorithm.kl_penalty)

    # --- phase 3: advantages -----------------------------------------------------------------
    def advantages(self, s: Scored) -> Experience:
        alg = self.c.algorithm
        mask = s.mask
        kl_coef = self.kl_ctl.value if alg.use_kl_in_reward else 0.0
        rewards = token_rewards(s.kl, s.scores, mask, kl_coef, s.dense)
        estimator = ADV_ESTIMATORS[alg.adv_estimator]
        group, std = self.c.actor_rollout.num_samples_per_step, alg.norm_adv_by_std_in_grpo
        adv, returns = estimator.estimate(rewards, s.values, mask, alg.gamma, alg.lam, group, norm_by_std=std)
        if alg.whiten_advantages:
            adv = masked_whiten(adv, mask)
        return Experience(s, rewards, adv * mask, returns)

    # --- phase 4: update ---------------------------------------------------------------------
    def _orders(self, n: int, epochs: int, shuffle: bool, salt: int) -> list[list[int]]:
        gen = torch.Generator().manual_seed(self.c.training.seed * 7919 + self.step * 31 + salt)
        return [torch.randperm(n, generator=gen).tolist() if shuffle else list(range(n)) for _ in range(epochs)]

    def update_actor(self, exp: Experience) -> UpdateStats:
        a, s = self.c.actor_rollout, exp.scored
        old = None if self.c.on_policy_update else s.logprobs
        batch = PolicyBatch(s.samples, s.mask, old, exp.advantages, s.ref_logprobs, s.is_weights)
        orders = self._orders(len(s.samples), a.ppo_epochs, a.shuffle_minibatch, 0)
        return self.actor.update(batch, orders)

    def update_critic(self, exp: Experience) -> UpdateStats:
        s = exp.scored
        batch = ValueBatch(s.samples, s.mask, s.values, exp.returns)
        orders = self._orders(
            len(s.samples), self.c.critic.critic_update_epochs, self.c.actor_rollout.shuffle_minibatch, 1
        )
        return self.critic.update(batch, orders)

    def _record(self, role: str, stats: UpdateStats) -> dict:
        for epoch, loss in stats.losses:
            self.history.append({"step": self.step, "role": role, "epoch": epoch, "loss": loss})
        return stats.metrics

    # --- the loop ----------------------------------------------------------------------------
    def train_step(self, responses: list[list[int]] | None = None) -> dict:
        """One PPO step. ``responses`` (fixed, pre-generated) replaces generation, for parity checks."""
        t0 = time.perf_counter()
        indices = self.prompt_indices(self.step)
        if responses is None:
            samples, rollout_logprobs = self.rollout(indices)
        else:
            samples, rollout_logprobs = self.make_samples([self.prompts[i] for i in indices], responses), None
        t1 = time.perf_counter()
        scored = self.score(samples, rollout_logprobs if self.reuses_rollout_log_probs else None)
        if self.dapo.filter_groups:  # DAPO's dynamic sampling (dapo.py): all-equal groups out, more prompts in
            scored, rollout_logprobs, skipped = self.dapo.refill(self, scored, rollout_logprobs, t0)
            if skipped is not None:
                return skipped
        correction = {}
        if rollout_logprobs is not None and not self.reuses_rollout_log_probs:  # rollout_is_cap
            m = scored.mask
            scored.is_weights = truncated_is_weights(
                scored.logprobs, rollout_logprobs, m, self.c.actor_rollout.rollout_is_cap
            )
            correction = {
                "rollout_is_weight": masked_mean(scored.is_weights, m).item(),
                "rollout_logprob_gap": masked_mean((scored.logprobs - rollout_logprobs).abs(), m).item(),
            }
        t2 = time.perf_counter()
        exp = self.advantages(scored)
        t3 = time.perf_counter()
        updates = [("actor", self.actor, lambda: self.update_actor(exp))]
        if self.critic is not None:
            updates.append(("critic", self.critic, lambda: self.update_critic(exp)))
        stats = {}
        for (name, _, _), part in zip(updates, self.together(*((role, fn) for _, role, fn in updates))):
            stats.update(self._record(name, part))  # in role order, however the calls overlapped
            if name == "actor" and part.logprobs is not None:  # on_policy_update: the rollout's log-probs
                scored.logprobs = part.logprobs
                scored.kl = self.kl(part.logprobs, scored.ref_logprobs, scored.mask) * scored.mask
        t_sync = time.perf_counter()
        if self.rollout_copy is not None:
            self.rollout_copy.sync_from(self.actor)
        elif self.c.actor_rollout.rollout_engine == "vllm":
            self.actor.sync_engine()  # the colocated engine takes the updated weights
        t4 = time.perf_counter()
        timings = {
            "time/weight_sync": t4 - t_sync,
            "time/rollout": t1 - t0,
            "time/score": t2 - t1,
            "time/advantages": t3 - t2,
            "time/update": t4 - t3,
            "time/step": t4 - t0,
        }
        mask = scored.mask
        kl_per_sample = (scored.kl * mask).sum(1)
        self.kl_ctl.update(kl_per_sample.mean().item(), len(samples))
        metrics = {
            "score": scored.raw_scores.mean().item(),
            "score_shaped": scored.scores.mean().item(),
            "reward": exp.rewards.sum(1).mean().item(),
            "kl": kl_per_sample.mean().item(),
            "kl_coef": self.kl_ctl.value,
            "response_length": mask.sum(1).mean().item(),
            "eos_rate": scored.samples.ended.float().mean().item(),
            "advantage_mean": masked_mean(exp.advantages, mask).item(),
            **stats,
            **correction,
            **self.dapo.metrics(scored),
            **timings,
        }
        if scored.dense is not None:
            metrics["step_reward"] = scored.dense.sum(1).mean().item()
        self.step += 1
        self.last_experience = exp
        return metrics

    def train(self) -> list[dict]:
        """Steps up to ``training.max_steps``, then the final save (loop.py); the log history."""
        return train_loop(self)

    # --- logging and checkpoints -------------------------------------------------------------
    def _open_writer(self) -> None:
        if "tensorboard" in self.c.training.report_to and self.writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(os.path.join(self.c.training.output_dir, "runs"))

    def log(self, metrics: dict) -> None:
        entry = {"step": self.step, **{k: round(v, 6) if isinstance(v, float) else v for k, v in metrics.items()}}
        self.log_history.append(entry)
        logger.info(json.dumps(entry))
        if self.writer is not None:
            for k, v in metrics.items():
                self.writer.add_scalar(f"ppo/{k}", v, self.step)

    @property
    def samples_path(self) -> str:
        return os.path.join(self.c.training.output_dir, SAMPLES_FILE)

    def log_samples(self, exp: Experience) -> None:
        """``training.log_samples`` of this step's samples to ``samples.jsonl`` and, with TensorBoard, as text
        (``samples_log``). The trainer loop holds every sample here (with Ray too: the roles return them to the
        driver), so only this process writes; under a process group only its first rank would."""
        from llm.alignment.ppo.fsdp import first_rank

        limit = self.c.training.log_samples
        if not limit or not first_rank():
            return
        rows = sample_rows(exp, self.step, limit)
        append_samples(self.samples_path, rows)
        if self.writer is not None:
            self.writer.add_text("ppo/samples", samples_markdown(rows), self.step)

    def _save_models(self, directory: str, with_optimizer: bool) -> None:
        self.actor.save(os.path.join(directory, "actor"), with_optimizer)
        if self.critic is not None:
            self.critic.save(os.path.join(directory, "critic"), with_optimizer)

    def save_checkpoint(self) -> str:
        """``checkpoint-N/``: actor and critic in Hugging Face format with their optimizer state (JSON +
        safetensors), and ``trainer_state.json``. Written into ``checkpoint-N.partial`` (roles in other
        processes write their own parts there: a shared filesystem), then the ``checkpoint.json`` marker, then
        renamed into place (``llm.utils.checkpoints``): a cut save leaves no ``checkpoint-N``."""
        from llm.utils.checkpoints import begin_checkpoint, finish_checkpoint, save_tree

        final = os.path.join(self.c.training.output_dir, f"checkpoint-{self.step}")
        partial = begin_checkpoint(final, is_main=True)
        self._save_models(partial, with_optimizer=True)
        missing = [part for part in self._checkpoint_parts() if not os.path.isdir(os.path.join(partial, part))]
        if missing:
            raise UserError(
                f"{partial}: the save of {', '.join(missing)} wrote nothing there (with Ray every role's process must "
                "see output_dir: a shared filesystem); the checkpoint is left incomplete"
            )
        state = {
            "step": self.step,
            "kl_coef": self.kl_ctl.value,
            "moments": (self.moments.mean, self.moments.var, self.moments.count),
            "log_history": self.log_history,
            "dapo": self.dapo.state(),
        }
        save_tree(partial, "trainer_state", state)
        finish_checkpoint(partial, final, self.step, self.run_fingerprint)
        self.last_checkpoint = final
        self._prune()
        return final

    @property
    def run_fingerprint(self) -> Fingerprint:
        """The run's fingerprint, as given (``PPOContext.fingerprint``); a trainer given none: the config's as
        written, computed once."""
        if self._run_fingerprint is None:
            self._run_fingerprint = run_fingerprint(self.c)
        return self._run_fingerprint

    def _checkpoint_parts(self) -> list[str]:
        return ["actor"] + (["critic"] if self.critic is not None else [])

    def _prune(self) -> None:
        """``save_total_limit``: the newest complete checkpoints of this run are kept; incomplete ones and
        other runs' are neither counted nor deleted."""
        from llm.utils.checkpoints import rotate_checkpoints

        rotate_checkpoints(
            self.c.training.output_dir,
            self.c.training.save_total_limit,
            self.run_fingerprint,
            keep=(self.last_checkpoint,),
        )

    def save_final(self) -> None:
        """Into output_dir/final.partial, then renamed in (``begin_final``): never a half-written final model."""
        from llm.utils.checkpoints import begin_final, finish_final

        staging = begin_final(self.c.training.output_dir, is_main=True)
        self._save_models(staging, with_optimizer=False)
        with open(os.path.join(staging, "log_history.json"), "w", encoding="utf-8") as f:
            json.dump(self.log_history, f, indent=1)
        finish_final(self.c.training.output_dir, self.step)

    @property
    def finished(self) -> bool:
        """The run is at its last step (resumed from its final checkpoint): nothing to train."""
        return self.step >= self.c.training.max_steps

    def load_checkpoint(self, directory: str) -> None:
        from llm.utils.checkpoints import load_tree

        for part in self._checkpoint_parts():
            if not os.path.isdir(os.path.join(directory, part)):
                raise UserError(f"{directory}: no {part}/ in it; the checkpoint is incomplete: resume from another one")
        if not os.path.isfile(os.path.join(directory, "trainer_state.json")):
            old = os.path.join(directory, "trainer_state.pt")
            why = (
                f"{old} was pickled by an older version and is not read (a pickle can run code when loaded)"
                if os.path.isfile(old)
                else "it has no trainer_state.json"
            )
            raise UserError(f"{directory}: {why}: resume from a checkpoint saved by this version")
        state = load_tree(directory, "trainer_state")
        try:
            step, kl_coef = int(state["step"]), float(state["kl_coef"])
            mean, var, count = state["moments"]
            log_history = list(state["log_history"])
        except (KeyError, TypeError, ValueError) as err:
            raise UserError(
                f"{directory}/trainer_state.json: not a PPO trainer state ({err}); the checkpoint is damaged"
            ) from None
        self.actor.load(os.path.join(directory, "actor"))
        if self.critic is not None:
            self.critic.load(os.path.join(directory, "critic"))
        if self.rollout_copy is not None:
            self.rollout_copy.sync_from(self.actor)
        elif self.c.actor_rollout.rollout_engine == "vllm":
            self.actor.sync_engine()
        self.step = step
        self.kl_ctl.value = kl_coef
        self.moments.mean, self.moments.var, self.moments.count = mean, var, count
        self.log_history = log_history
        self.dapo.load_state(state)
        self.last_checkpoint = directory
        logger.info("resumed from %s at step %d", directory, self.step)
