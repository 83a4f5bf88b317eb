"""PPO as an explicit loop over named phases with typed records between them:

    rollout (actor generates) -> Samples
    score (actor/ref log-probs, critic values, rewards) -> Scored
    advantages (KL-shaped rewards, GAE / GRPO / RLOO / REINFORCE++) -> Experience
    update (actor and critic mini-batch epochs) -> step statistics

Not a copy of ``Trainer.train``: each phase is a method that only talks to the role interfaces.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
from dataclasses import dataclass

import torch

from llm.alignment.ppo.algorithm import (
    AdaptiveKLController,
    FixedKLController,
    RunningMoments,
    discounted_returns,
    full_kl,
    gae,
    group_advantages,
    kl_estimate,
    masked_mean,
    masked_whiten,
    policy_loss,
    token_rewards,
    value_loss,
)
from llm.alignment.ppo.config import PPOConfig
from llm.alignment.ppo.roles import PolicyModel, RewardFunction, Samples, TrainableRole, ValueModel, scatter_tokens
from llm.data.readers import PromptRecord
from llm.data.tokenize import render_prompt
from llm.utils.errors import UserError

logger = logging.getLogger(__name__)


@dataclass
class Prompt:
    ids: list[int]
    text: str
    reference: str | None


@dataclass
class Scored:
    samples: Samples
    mask: torch.Tensor  # (B, T)
    logprobs: torch.Tensor  # (B, T) actor, at rollout time
    ref_logprobs: torch.Tensor | None
    values: torch.Tensor | None  # (B, T) critic
    kl: torch.Tensor  # (B, T) per-token KL estimate (0 without a reference)
    scores: torch.Tensor  # (B,) after penalty / normalisation / clipping
    raw_scores: torch.Tensor  # (B,) as the reward function returned them
    dense: torch.Tensor | None  # (B, T) PRM step rewards


@dataclass
class Experience:
    scored: Scored
    rewards: torch.Tensor  # (B, T)
    advantages: torch.Tensor  # (B, T)
    returns: torch.Tensor | None  # (B, T), GAE only


def make_samples(prompts: list[Prompt], responses: list[list[int]], tok) -> Samples:
    """Samples from given responses (``len(responses) // len(prompts)`` consecutive per prompt)."""
    k = len(responses) // len(prompts)
    expanded = [p for p in prompts for _ in range(k)]
    ended = torch.tensor([bool(r) and r[-1] == tok.eos_token_id for r in responses])
    responses = [r if r else [tok.eos_token_id] for r in responses]  # an empty response still gets a token
    return Samples(
        prompt_ids=[p.ids for p in expanded],
        response_ids=responses,
        prompts=[p.text for p in expanded],
        responses=[tok.decode(r, skip_special_tokens=True) for r in responses],
        references=[p.reference for p in expanded],
        ended=ended,
    )


def _chunks(items: list[int], size: int) -> list[list[int]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


class PPOTrainer:
    def __init__(
        self,
        config: PPOConfig,
        prompts: list[Prompt],
        actor: PolicyModel,
        actor_optim: TrainableRole,
        reward: RewardFunction,
        ref: PolicyModel | None = None,
        critic: ValueModel | None = None,
        critic_optim: TrainableRole | None = None,
    ) -> None:
        self.c, self.prompts = config, prompts
        self.actor, self.actor_optim, self.ref = actor, actor_optim, ref
        self.critic, self.critic_optim, self.reward = critic, critic_optim, reward
        ctl = config.algorithm.kl_ctrl
        self.kl_ctl = (
            FixedKLController(ctl.kl_coef)
            if ctl.type == "fixed"
            else AdaptiveKLController(ctl.kl_coef, ctl.target_kl, ctl.horizon)
        )
        self.moments = RunningMoments()
        self.step = 0
        self.history: list[dict] = []  # per mini-batch losses, for tests and debugging
        self.log_history: list[dict] = []
        self.writer = None

    # --- phase 0: which prompts --------------------------------------------------------------
    def prompt_indices(self, step: int) -> list[int]:
        """Prompts of ``step``: a fresh seeded permutation per pass over the data, so the order only
        depends on the step number (a resumed run sees exactly the prompts it would have seen)."""
        n, size = len(self.prompts), self.c.data.rollout_batch_size
        out = []
        position = step * size
        while len(out) < size:
            epoch, offset = divmod(position, n)
            order = list(range(n))
            random.Random(self.c.training.seed + epoch).shuffle(order)
            take = min(size - len(out), n - offset)
            out += order[offset : offset + take]
            position += take
        return out

    # --- phase 1: rollout --------------------------------------------------------------------
    def rollout(self, indices: list[int]) -> Samples:
        a = self.c.actor_rollout
        torch.manual_seed(self.c.training.seed * 1_000_003 + self.step)  # sampling depends on the step only
        prompts = [self.prompts[i] for i in indices]
        responses = self.actor.generate(
            [p.ids for p in prompts],
            num_samples=a.num_samples_per_step,
            max_new_tokens=a.max_response_length,
            do_sample=a.do_sample,
            top_p=a.top_p,
            top_k=a.top_k,
            ignore_eos=a.ignore_eos,
        )
        return self.make_samples(prompts, responses)

    def make_samples(self, prompts: list[Prompt], responses: list[list[int]]) -> Samples:
        return make_samples(prompts, responses, self.actor.tokenizer)

    # --- phase 2: score ----------------------------------------------------------------------
    @torch.no_grad()
    def score(self, samples: Samples) -> Scored:
        alg, rw = self.c.algorithm, self.c.reward
        mask = samples.response_mask()
        full = alg.kl_penalty == "full" and self.ref is not None
        if full:
            logprobs, actor_logits = self.actor.log_probs(samples, with_logits=True)
            ref_logprobs, ref_logits = self.ref.log_probs(samples, with_logits=True)
            kl = torch.zeros_like(mask)
            for (batch, lp), (_, lq) in zip(actor_logits, ref_logits):
                lengths = [len(r) for r in samples.response_ids]
                kl = kl + scatter_tokens(full_kl(lp, lq), batch, lengths, mask.shape[1]).cpu()
        else:
            logprobs = self.actor.log_probs(samples)
            ref_logprobs = self.ref.log_probs(samples) if self.ref is not None else None
            kl = kl_estimate(logprobs, ref_logprobs, alg.kl_penalty) if ref_logprobs is not None else 0 * logprobs
        values = self.critic.values(samples) if self.critic is not None else None
        out = self.reward.score(samples)
        raw = out.scores.clone()
        scores = out.scores.clone()
        if alg.missing_eos_penalty is not None:
            scores = scores - alg.missing_eos_penalty * (~samples.ended).float()
        if rw.normalize_reward:
            self.moments.update(scores)
            scores = (scores - self.moments.mean) / self.moments.std
        if rw.reward_clip is not None:
            scores = scores.clamp(-rw.reward_clip, rw.reward_clip)
        return Scored(
            samples,
            mask,
            logprobs.cpu(),
            None if ref_logprobs is None else ref_logprobs.cpu(),
            None if values is None else values.cpu(),
            (kl * mask).cpu(),
            scores,
            raw,
            out.dense,
        )

    # --- phase 3: advantages -----------------------------------------------------------------
    def advantages(self, s: Scored) -> Experience:
        alg = self.c.algorithm
        mask = s.mask
        kl_coef = self.kl_ctl.value if alg.use_kl_in_reward else 0.0
        rewards = token_rewards(s.kl, s.scores, mask, kl_coef, s.dense)
        returns = None
        if alg.adv_estimator == "gae":
            adv, returns = gae(rewards, s.values, mask, alg.gamma, alg.lam)
        elif alg.adv_estimator == "reinforce_plus_plus":
            adv = discounted_returns(rewards, mask, alg.gamma)
        else:  # grpo / rloo: one outcome per sample (score minus its summed KL), broadcast over tokens
            outcome = rewards.sum(1)
            adv = group_advantages(outcome, self.c.actor_rollout.num_samples_per_step, alg.adv_estimator)
            adv = adv[:, None] * mask
        if alg.whiten_advantages:
            adv = masked_whiten(adv, mask)
        return Experience(s, rewards, adv * mask, returns)

    # --- phase 4: update ---------------------------------------------------------------------
    def _orders(self, n: int, epochs: int, shuffle: bool, salt: int) -> list[list[int]]:
        gen = torch.Generator().manual_seed(self.c.training.seed * 7919 + self.step * 31 + salt)
        return [torch.randperm(n, generator=gen).tolist() if shuffle else list(range(n)) for _ in range(epochs)]

    def update_actor(self, exp: Experience) -> dict:
        a, alg, s = self.c.actor_rollout, self.c.algorithm, exp.scored
        micro = self.c.training.micro_batch_size
        stats = {
            "policy_loss": [],
            "abs_policy_loss": [],
            "clipfrac": [],
            "approx_kl": [],
            "entropy": [],
            "kl_loss": [],
        }
        self.actor.model.train()
        for epoch, order in enumerate(self._orders(len(s.samples), a.ppo_epochs, a.shuffle_minibatch, 0)):
            for mb in _chunks(order, a.ppo_mini_batch_size):
                tokens = s.mask[mb].sum()
                totals = {k: 0.0 for k in stats}
                for part in _chunks(mb, micro):
                    logp, entropy = self.actor.log_probs(s.samples, part, grad=True, with_entropy=True)
                    T = logp.shape[1]
                    dev = logp.device
                    m = s.mask[part, :T].to(dev)
                    out = policy_loss(
                        logp,
                        s.logprobs[part, :T].to(dev),
                        exp.advantages[part, :T].to(dev),
                        m,
                        self.c.clip_low,
                        self.c.clip_high,
                        normaliser=tokens,
                    )
                    loss = out.loss
                    ent = (entropy * m).sum() / tokens
                    if a.entropy_coeff:
                        loss = loss - a.entropy_coeff * ent
                    kl_loss = torch.zeros(())
                    if alg.kl_loss_coef and s.ref_logprobs is not None:
                        kl_loss = (kl_estimate(logp, s.ref_logprobs[part, :T].to(dev), alg.kl_penalty) * m).sum()
                        kl_loss = kl_loss / tokens
                        loss = loss + alg.kl_loss_coef * kl_loss
                    loss.backward()
                    share = m.sum() / tokens
                    totals["policy_loss"] += out.loss.item()
                    totals["clipfrac"] += out.clipfrac.item() * share.item()
                    totals["approx_kl"] += out.approx_kl.item() * share.item()
                    totals["entropy"] += ent.item()
                    totals["kl_loss"] += float(kl_loss.detach())
                totals["abs_policy_loss"] = abs(totals["policy_loss"])
                self.actor_optim.step()
                for k, values in stats.items():
                    values.append(totals[k])
                self.history.append({"step": self.step, "role": "actor", "epoch": epoch, "loss": totals["policy_loss"]})
        return {k: sum(v) / len(v) for k, v in stats.items() if v}

    def update_critic(self, exp: Experience) -> dict:
        cr, s = self.c.critic, exp.scored
        micro = self.c.training.micro_batch_size
        losses, clipfracs = [], []
        self.critic.model.train()
        for epoch, order in enumerate(
            self._orders(len(s.samples), cr.critic_update_epochs, self.c.actor_rollout.shuffle_minibatch, 1)
        ):
            for mb in _chunks(order, cr.critic_mini_batch_size):
                tokens = s.mask[mb].sum()
                total, frac = 0.0, 0.0
                for part in _chunks(mb, micro):
                    v = self.critic.values(s.samples, part, grad=True)
                    T = v.shape[1]
                    dev = v.device
                    m = s.mask[part, :T].to(dev)
                    loss, clipfrac = value_loss(
                        v,
                        s.values[part, :T].to(dev),
                        exp.returns[part, :T].to(dev),
                        m,
                        cr.cliprange_value,
                        normaliser=tokens,
                    )
                    (cr.value_loss_coef * loss).backward()
                    total += loss.item()
                    frac += clipfrac.item() * (m.sum() / tokens).item()
                self.critic_optim.step()
                losses.append(total)
                clipfracs.append(frac)
                self.history.append({"step": self.step, "role": "critic", "epoch": epoch, "loss": total})
        return {"value_loss": sum(losses) / len(losses), "value_clipfrac": sum(clipfracs) / len(clipfracs)}

    # --- the loop ----------------------------------------------------------------------------
    def train_step(self, responses: list[list[int]] | None = None) -> dict:
        """One PPO step. ``responses`` (fixed, pre-generated) replaces generation, for parity checks."""
        timings = {}
        t0 = time.perf_counter()
        indices = self.prompt_indices(self.step)
        if responses is None:
            samples = self.rollout(indices)
        else:
            samples = self.make_samples([self.prompts[i] for i in indices], responses)
        t1 = time.perf_counter()
        scored = self.score(samples)
        t2 = time.perf_counter()
        exp = self.advantages(scored)
        t3 = time.perf_counter()
        stats = self.update_actor(exp)
        if self.critic is not None:
            stats.update(self.update_critic(exp))
        t4 = time.perf_counter()
        timings = {
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
            **timings,
        }
        if scored.dense is not None:
            metrics["step_reward"] = scored.dense.sum(1).mean().item()
        self.step += 1
        self.last_experience = exp
        return metrics

    def train(self) -> list[dict]:
        t = self.c.training
        self._open_writer()
        from tqdm.auto import tqdm

        bar = tqdm(total=t.max_steps, initial=self.step, disable=t.disable_tqdm, desc="ppo")
        while self.step < t.max_steps:
            metrics = self.train_step()
            bar.update(1)
            bar.set_postfix(score=f"{metrics['score']:.3f}", kl=f"{metrics['kl']:.3f}")
            if self.step % t.logging_steps == 0 or self.step == t.max_steps:
                self.log(metrics)
            if t.save_steps and self.step % t.save_steps == 0:
                self.save_checkpoint()
        bar.close()
        self.save_final()
        if self.writer is not None:
            self.writer.close()
        return self.log_history

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

    def _save_models(self, directory: str) -> None:
        tok = self.actor.tokenizer
        self.actor.model.save_pretrained(os.path.join(directory, "actor"))
        tok.save_pretrained(os.path.join(directory, "actor"))
        if self.critic is not None:
            self.critic.model.save_pretrained(os.path.join(directory, "critic"))
            tok.save_pretrained(os.path.join(directory, "critic"))

    def save_checkpoint(self) -> str:
        directory = os.path.join(self.c.training.output_dir, f"checkpoint-{self.step}")
        self._save_models(directory)
        state = {
            "step": self.step,
            "kl_coef": self.kl_ctl.value,
            "moments": (self.moments.mean, self.moments.var, self.moments.count),
            "actor_optim": self.actor_optim.state_dict(),
            "critic_optim": self.critic_optim.state_dict() if self.critic_optim else None,
            "log_history": self.log_history,
        }
        torch.save(state, os.path.join(directory, "trainer_state.pt"))
        self._prune()
        return directory

    def _prune(self) -> None:
        limit = self.c.training.save_total_limit
        if not limit:
            return
        out = self.c.training.output_dir
        ckpts = sorted((d for d in os.listdir(out) if d.startswith("checkpoint-")), key=lambda d: int(d.split("-")[1]))
        for d in ckpts[:-limit]:
            shutil.rmtree(os.path.join(out, d))

    def save_final(self) -> None:
        self._save_models(self.c.training.output_dir)
        with open(os.path.join(self.c.training.output_dir, "log_history.json"), "w", encoding="utf-8") as f:
            json.dump(self.log_history, f, indent=1)

    def load_checkpoint(self, directory: str) -> None:
        from safetensors.torch import load_file

        self.actor.model.load_state_dict(load_file(os.path.join(directory, "actor", "model.safetensors")))
        if self.critic is not None:
            self.critic.model.load_state_dict(load_file(os.path.join(directory, "critic", "model.safetensors")))
        state = torch.load(os.path.join(directory, "trainer_state.pt"), weights_only=False)
        self.step = state["step"]
        self.kl_ctl.value = state["kl_coef"]
        self.moments.mean, self.moments.var, self.moments.count = state["moments"]
        self.actor_optim.load_state_dict(state["actor_optim"])
        if self.critic_optim is not None and state["critic_optim"] is not None:
            self.critic_optim.load_state_dict(state["critic_optim"])
        self.log_history = state["log_history"]
        logger.info("resumed from %s at step %d", directory, self.step)


def prompts_from_records(
    records: list[PromptRecord], tokenizer, max_prompt_length: int, use_chat_template: bool
) -> list[Prompt]:
    """Tokenise prompts; a prompt over ``max_prompt_length`` stops the run naming it (never cut silently)."""
    out, too_long = [], []
    for rec in records:
        ids = render_prompt(rec.prompt, tokenizer, use_chat_template)
        if len(ids) > max_prompt_length:
            too_long.append((rec, len(ids)))
            continue
        text = tokenizer.decode(ids, skip_special_tokens=True)
        out.append(Prompt(ids, text, rec.reference))
    if too_long:
        rec, n = too_long[0]
        raise UserError(
            f"{rec.source}: record {rec.index}: the prompt has {n} tokens, more than actor_rollout.max_prompt_length="
            f"{max_prompt_length} ({len(too_long)} prompt(s) too long in all): raise max_prompt_length or shorten them"
        )
    return out
