"""PPO as an explicit loop over named phases with typed records between them:

    rollout (a rollout source generates, phase 2 scores) -> RolloutBatch (rollout.py)
    score (actor/ref log-probs, critic values, rewards) -> Scored
    advantages (KL-shaped rewards, GAE / GRPO / RLOO / REINFORCE++) -> Experience
    update (actor and critic mini-batch epochs) -> step statistics

Not a copy of ``Trainer.train``: each phase is a method that only talks to the role interfaces
(interfaces.py's protocols) with records and tensors in and statistics out; a role object is the role
itself (roles.py, rewards/) or its Ray proxy (ray_roles.py), and nothing here depends on which. The trainer
alone owns the loop (``train``), the step counter, the metrics, the writer and the checkpoints; its components
(the rollout source, DAPO's shaping, the KL controller) return values and never set its attributes.
"""

from __future__ import annotations

import json
import logging
import os
import time

import torch

from llm.alignment.ppo.agent.source import MultiTurn
from llm.alignment.ppo.algorithm import (
    ADV_ESTIMATORS,
    KL_CONTROLLERS,
    RunningMoments,
    masked_mean,
    masked_whiten,
    prime_advantages,
    token_rewards,
    truncated_is_weights,
)
from llm.alignment.ppo.async_rollout import AsyncRollouts
from llm.alignment.ppo.dapo import DAPO, DynamicSampling
from llm.alignment.ppo.interfaces import (
    Actor,
    Critic,
    Experience,
    Policy,
    PolicyBatch,
    Reward,
    RoleFailure,
    Samples,
    Scored,
    UpdateStats,
    ValueBatch,
)
from llm.alignment.ppo.lanes import together
from llm.alignment.ppo.prompts import Prompt, PromptStream, make_samples
from llm.alignment.ppo.rollout import Generator, RolloutBatch, RolloutContext, RolloutSource, SingleTurn, scored_batch
from llm.alignment.ppo.samples_log import SAMPLES_FILE, append_samples, sample_rows, samples_markdown, trim_samples
from llm.alignment.ppo.scoring import Scoring
from llm.settings.fingerprint import Fingerprint, run_fingerprint
from llm.settings.ppo import PPOConfig
from llm.utils import preemption
from llm.utils.errors import UserError
from llm.utils.modeling import stop_token_ids

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
        stop_ids: tuple[int, ...] | None = None,
        prime=None,
    ) -> None:
        self.c, self.prompts, self.tokenizer = config, prompts, tokenizer
        # the ids that end a response (PPOContext.stop_ids); None: the tokenizer's EOS only
        self.stop_ids = stop_token_ids(tokenizer) if stop_ids is None else stop_ids
        self._run_fingerprint = fingerprint  # the build's (PPOContext); None: the config's, as written, when asked
        self.actor, self.ref, self.critic, self.reward = actor, ref, critic, reward
        self.rollout_copy = rollout_copy
        self.prime = prime  # PRIME's online implicit PRM (prime.py), with a ``prime`` section
        self.last_checkpoint: str | None = None
        self.kl_ctl = KL_CONTROLLERS[config.algorithm.kl_ctrl.type](config.algorithm.kl_ctrl)
        self.moments = RunningMoments()
        self.dapo = DAPO(config)  # DAPO's overlong shaping (dapo.py)
        self.step = 0
        self.history: list[dict] = []  # per mini-batch losses, for tests and debugging
        self.log_history: list[dict] = []
        self.writer = None
        a, d = config.actor_rollout, config.data
        self.prompt_stream = PromptStream(len(prompts), d.rollout_batch_size, config.training.seed, d.shuffle)
        self.generator = Generator(actor, rollout_copy, a.rollout_engine == "vllm")
        # phase 2 as a component of its own: the rollout sources call it, and hold no reference to the trainer (a
        # cycle would keep the trainer and its vLLM engine alive after the run until a garbage collection)
        self.scoring = Scoring(config, actor, reward, ref, critic, self.moments, self.dapo)
        self.context = RolloutContext(
            config, prompts, tokenizer, self.prompt_stream, self.generator, self.scoring.score, self.stop_ids
        )
        self.source = self.rollout_source(asynchronous=False)  # train() swaps in the async one for its loop

    def together(self, *calls):
        """The results of independent role calls, each ``(role, zero-argument callable)``, in order (lanes.py)."""
        pool = self.c.resource_pool
        return together(calls, pool.use_ray and pool.concurrent_roles)

    # --- phase 1: rollout (a rollout source: rollout.py) --------------------------------------------
    def rollout_source(self, asynchronous: bool) -> RolloutSource:
        """One-step-off async (``train`` with ``async_rollout``), multi-turn episodes (``environment``: agent/) or
        single-turn; DAPO's dynamic sampling around it with ``filter_groups`` (validation refuses it with async)."""
        episodes = None if self.c.environment is None else MultiTurn(self.context)
        if asynchronous:
            return AsyncRollouts(self.context, episodes)
        source = SingleTurn(self.context) if episodes is None else episodes
        return DynamicSampling(source, self.c, self.prompt_stream) if self.c.algorithm.filter_groups else source

    def prompt_indices(self, step: int) -> list[int]:
        """Prompts of ``step``: a fresh seeded permutation per pass over the data, so the order only depends on the
        step number and the prompts DAPO's extra rounds drew, which are saved (``prompts.PromptStream``)."""
        return self.prompt_stream.indices(step)

    def fixed_batch(self, responses: list[list[int]]) -> RolloutBatch:
        """The step's prompts with given (pre-generated) ``responses``, scored: parity checks."""
        start = time.perf_counter()
        prompts = [self.prompts[i] for i in self.prompt_indices(self.step)]
        samples = make_samples(prompts, responses, self.tokenizer, self.stop_ids)
        return scored_batch(self.context, samples, None, metrics={"time/rollout": time.perf_counter() - start})

    # --- phase 2: score (scoring.py) ------------------------------------------------------------
    def score(self, samples: Samples, rollout_logprobs: torch.Tensor | None = None) -> Scored:
        """The samples scored (``Scoring.score``): log-probs, values, KL, shaped scores."""
        return self.scoring.score(samples, rollout_logprobs)

    def kl(self, logprobs: torch.Tensor | None, ref_logprobs: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor:
        return self.scoring.kl(logprobs, ref_logprobs, mask)

    def correct(self, scored: Scored, behaviour: torch.Tensor | None) -> dict:
        """``rollout_is_cap``: the truncated IS weights of the engine / trainer mismatch, and their metrics."""
        if behaviour is None:
            return {}
        m = scored.mask
        scored.is_weights = truncated_is_weights(scored.logprobs, behaviour, m, self.c.actor_rollout.rollout_is_cap)
        return {
            "rollout_is_weight": masked_mean(scored.is_weights, m).item(),
            "rollout_logprob_gap": masked_mean((scored.logprobs - behaviour).abs(), m).item(),
        }

    # --- phase 3: advantages -----------------------------------------------------------------
    def advantages(self, s: Scored, process: torch.Tensor | None = None) -> Experience:
        """``process``: PRIME's process rewards (``prime`` section), turned into advantages apart from the outcome."""
        alg = self.c.algorithm
        mask = s.mask
        kl_coef = self.kl_ctl.value if alg.use_kl_in_reward else 0.0
        rewards = token_rewards(s.kl, s.scores, mask, kl_coef, s.dense, s.env_rewards)
        estimator = ADV_ESTIMATORS[alg.adv_estimator]
        group, std = self.c.actor_rollout.num_samples_per_step, alg.norm_adv_by_std_in_grpo
        if process is not None:
            p = self.c.prime
            adv = returns = prime_advantages(s.scores, process, mask, group, p.outcome_coef, p.process_coef)
            rewards = rewards + process * mask
        else:
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

    def update(self, exp: Experience) -> dict:
        """The actor's and critic's updates on ``exp``; their metrics."""
        scored = exp.scored
        updates = [("actor", self.actor, lambda: self.update_actor(exp))]
        if self.critic is not None:
            updates.append(("critic", self.critic, lambda: self.update_critic(exp)))
        stats = {}
        for (name, _, _), part in zip(updates, self.together(*((role, fn) for _, role, fn in updates))):
            for epoch, loss in part.losses:
                self.history.append({"step": self.step, "role": name, "epoch": epoch, "loss": loss})
            stats.update(part.metrics)  # in role order, however the calls overlapped
            if name == "actor" and part.logprobs is not None:  # on_policy_update: the rollout's log-probs
                scored.logprobs = part.logprobs
                scored.kl = self.kl(part.logprobs, scored.ref_logprobs, scored.mask) * scored.mask
        return stats

    # --- the loop ----------------------------------------------------------------------------
    def train_step(self, responses: list[list[int]] | None = None) -> dict:
        """One PPO step. ``responses`` (fixed, pre-generated) replaces the rollout source, for parity checks."""
        t0 = time.perf_counter()
        batch = self.source.collect(self.step) if responses is None else self.fixed_batch(responses)
        scored = batch.scored
        correction = self.correct(scored, batch.behaviour_logprobs)
        process, prime_metrics = None, {}
        if self.prime is not None:  # PRIME: the implicit PRM's update and process rewards (prime.py)
            orders = self._orders(len(scored.samples), self.c.prime.update_epochs, True, 2)
            process, prime_metrics = self.prime.step(scored.samples, scored.raw_scores, orders)
        t2 = time.perf_counter()
        exp = self.advantages(scored, process)
        t3 = time.perf_counter()
        stats = self.update(exp) if batch.update else {}
        t_sync = time.perf_counter()
        if batch.update:
            self.source.after_update(self.step)
        t4 = time.perf_counter()
        mask = scored.mask
        kl_per_sample = (scored.kl * mask).sum(1)
        if batch.update:  # a step without an update (DAPO: no group left) leaves the controller as it is
            a = self.c.actor_rollout
            generated = (
                len(responses) if responses is not None else self.c.data.rollout_batch_size * a.num_samples_per_step
            )
            self.kl_ctl.update(kl_per_sample.mean().item(), generated)
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
            **prime_metrics,
            **self.dapo.metrics(scored),
            **batch.metrics,
            "time/weight_sync": t4 - t_sync,
            "time/advantages": t3 - t2,
            "time/update": t4 - t3,
            "time/step": t4 - t0,
        }
        if "timing/wait_s" in batch.metrics:  # one-step-off async: the step's time after its rollout
            metrics["timing/update_s"] = metrics["time/step"] - metrics["time/rollout"]
        if scored.dense is not None:
            metrics["step_reward"] = scored.dense.sum(1).mean().item()
        if scored.env_rewards is not None:
            metrics["env_reward"] = (scored.env_rewards * mask).sum(1).mean().item()
        for name, values in (scored.components or {}).items():  # several rewards: each one's, unweighted
            metrics[f"reward/{name}/mean"] = values.mean().item()
        self.step += 1
        self.last_experience = exp
        return metrics

    def train(self) -> list[dict]:
        """Steps up to ``training.max_steps`` (progress bar, logging, samples, checkpoints, preemption by SIGTERM,
        role failures), then the final save; the log history. With ``actor_rollout.async_rollout`` the rollouts
        come from the one-step-off source for the length of the loop."""
        t = self.c.training
        self.open_writer()
        trim_samples(self.samples_path, self.step)
        from tqdm.auto import tqdm

        # SIGTERM (llm.utils.preemption): before this run's first step has completed it stops the run at once;
        # after that the step in progress finishes, a checkpoint is saved and train() returns (exit 0).
        preemption.reassert()  # ray.init installs its own SIGTERM handler (it kills the workers and exits 1)
        bar = tqdm(total=t.max_steps, initial=self.step, disable=t.disable_tqdm, desc="ppo")
        synchronous, finished = self.source, False
        if self.c.actor_rollout.async_rollout and self.step < t.max_steps:
            self.source = self.rollout_source(asynchronous=True)
        try:
            while self.step < t.max_steps:
                metrics = self.train_step()
                preemption.step_completed()
                bar.update(1)
                bar.set_postfix(score=f"{metrics['score']:.3f}", kl=f"{metrics['kl']:.3f}")
                if self.step % t.logging_steps == 0 or self.step == t.max_steps:
                    self.log(metrics)
                    self.log_samples(self.last_experience)
                saved = bool(t.save_steps and self.step % t.save_steps == 0)
                if saved:
                    self.save_checkpoint()
                signum = preemption.stop_requested()
                if signum is not None and self.step < t.max_steps:
                    if not saved:
                        self.save_checkpoint()
                    finished = True
                    self.source.close(True)  # the async rollout in flight is discarded (regenerated on resume)
                    preemption.stopped_after_step(
                        signum, self.step, self.last_checkpoint, "--training.resume_from_checkpoint"
                    )
                    return self.log_history
            finished = True
            self.source.close(True)
            preemption.training_finished()
            self.save_final()
        except RoleFailure as err:
            # The surviving roles may be mid-update: the last checkpoint is the consistent state to resume.
            where = (
                f"the last checkpoint is {self.last_checkpoint}: resume with --resume_from_checkpoint auto"
                if self.last_checkpoint
                else "no checkpoint was saved yet (training.save_steps)"
            )
            raise RoleFailure(f"{err}\nThe run stopped in step {self.step + 1}; {where}") from None
        finally:
            if not finished:
                self.source.close(False)
            self.source = synchronous
            bar.close()
            if self.writer is not None:
                self.writer.close()
                self.writer = None
        return self.log_history

    # --- logging and checkpoints -------------------------------------------------------------
    def open_writer(self) -> None:
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
        if self.prime is not None:
            self.prime.save(os.path.join(directory, "prime"), with_optimizer)

    def save_checkpoint(self) -> str:
        """``checkpoint-N/``: actor and critic in Hugging Face format with their optimizer state (JSON +
        safetensors), and ``trainer_state.json``. Written into ``checkpoint-N.partial`` (roles in other
        processes write their own parts there: a shared filesystem), then the ``checkpoint.json`` marker, then
        renamed into place (``llm.utils.checkpoints``): a cut save leaves no ``checkpoint-N``."""
        from llm.utils.checkpoints import begin_checkpoint, finish_checkpoint, partial_dir, save_tree
        from llm.utils.disk_full import saving

        out = self.c.training.output_dir
        final = os.path.join(out, f"checkpoint-{self.step}")
        with saving(out, partial_dir(final), os.path.basename(final), field="training.output_dir"):  # a full disk
            partial = begin_checkpoint(final, is_main=True)
            self._save_models(partial, with_optimizer=True)
            missing = [part for part in self._checkpoint_parts() if not os.path.isdir(os.path.join(partial, part))]
            if missing:
                raise UserError(
                    f"{partial}: the save of {', '.join(missing)} wrote nothing there (with Ray every role's process "
                    "must see output_dir: a shared filesystem); the checkpoint is left incomplete"
                )
            state = {
                "step": self.step,
                "kl_coef": self.kl_ctl.value,
                "moments": (self.moments.mean, self.moments.var, self.moments.count),
                "log_history": self.log_history,
                "dapo": self.prompt_stream.state(),
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
        return (
            ["actor"] + (["critic"] if self.critic is not None else []) + (["prime"] if self.prime is not None else [])
        )

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
        from llm.utils.checkpoints import FINAL_STAGING, begin_final, finish_final
        from llm.utils.disk_full import saving

        out = self.c.training.output_dir
        with saving(out, os.path.join(out, FINAL_STAGING), "the final model", field="training.output_dir"):
            staging = begin_final(out, is_main=True)
            self._save_models(staging, with_optimizer=False)
            with open(os.path.join(staging, "log_history.json"), "w", encoding="utf-8") as f:
                json.dump(self.log_history, f, indent=1)
            finish_final(out, self.step)

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
        if self.prime is not None:
            self.prime.load(os.path.join(directory, "prime"))
        self.generator.sync()
        self.step = step
        self.kl_ctl.value = kl_coef
        self.moments.mean, self.moments.var, self.moments.count = mean, var, count
        self.log_history = log_history
        self.prompt_stream.load_state(state.get("dapo", {}))
        self.last_checkpoint = directory
        logger.info("resumed from %s at step %d", directory, self.step)
