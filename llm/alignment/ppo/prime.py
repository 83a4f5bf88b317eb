"""PRIME's online implicit PRM (Cui et al. 2025, "Process Reinforcement through Implicit Rewards"; verl's
``recipe/prime``): a causal LM ``pi_phi`` trained on each step's rollouts against the verifier's outcomes, with a
frozen reference ``pi_ref``, both initialised from the SFT model by default (the ``prime`` section:
``llm.settings.prime``).

Per response token ``q_t = log pi_phi(y_t) - log pi_ref(y_t)``; the implicit reward of a response is
``r(y) = beta * sum_t q_t``, trained with the cross-entropy loss ``BCE(sigmoid(r(y)), o)`` against its outcome ``o``
in [0, 1] (verl's ``compute_ce_dpo_loss_rm``; the mean over a mini-batch's responses, one AdamW step per
mini-batch). Its process rewards are ``beta * q_t`` at every token (``granularity: token``) or their sum at the last
token (``whole``), divided by the batch's largest ``|sum_{s >= t} r_s|`` with ``norm: batch_norm`` (verl's
``prime_norm``). ``update`` orders the two (verl's ``reward_model.model.update``): ``before`` updates, then scores
with the updated PRM; ``after`` scores with the PRM as it was, then updates; ``none`` never updates.

``step`` returns the process rewards and the metrics (the trainer logs them): ``prime/accuracy`` (the share of
responses whose implicit reward's sign, before this step's update, is the sign of ``2 o - 1``: > 0 for a correct
one, < 0 for a wrong one, so a PRM still equal to its reference, r = 0, scores 0; verl's ``dpo_acc_abs``), ``prime/implicit_reward`` (its mean, before the update), ``prime/loss`` (the update's
mean loss), ``prime/process_reward`` (the process rewards' mean sum per response). The advantages:
``algorithm.prime_advantages``. Checkpoints: the PRM's weights with its optimizer and LR schedule
(``checkpoint-N/prime``, as the actor's); the final save adds ``implicit_prm.json``, so the trained PRM is a
``reward.type: implicit_prm`` model.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from llm.alignment.ppo.algorithm import last_tokens
from llm.alignment.ppo.fsdp import first_rank
from llm.alignment.ppo.interfaces import Samples
from llm.alignment.ppo.objectives import Counts
from llm.alignment.ppo.optim import TrainableRole
from llm.alignment.ppo.roles import PolicyModel
from llm.alignment.ppo.update import run_update
from llm.alignment.rm.scorers import implicit  # every step scorer, in the registry's order (docs_tables)
from llm.settings.prime import PrimeSection
from llm.utils.errors import UserError


class PrimePRM(PolicyModel):
    """The trained implicit PRM (its log-probs at temperature 1), its frozen ``reference``, its optimizer."""

    NAMES = ("loss",)

    def __init__(
        self,
        model,
        tokenizer,
        micro_batch_size: int,
        optim: TrainableRole,
        reference: PolicyModel,
        settings: PrimeSection,
        reference_path: str,
        reference_from_config: bool = False,
    ) -> None:
        super().__init__(model, tokenizer, 1.0, micro_batch_size)
        self.optim, self.reference, self.settings = optim, reference, settings
        self.reference_path, self.reference_from_config = reference_path, reference_from_config

    def log_ratios(self, samples: Samples, ref_logprobs: torch.Tensor) -> torch.Tensor:
        """``(B, T)`` ``log pi_phi - log pi_ref`` of every response token (no gradient), 0 off the mask."""
        return (self.log_probs(samples) - ref_logprobs) * samples.response_mask()

    def update(self, samples: Samples, ref_logprobs: torch.Tensor, outcomes: torch.Tensor, orders) -> float:
        """The cross-entropy update over ``orders`` (one per epoch) in mini-batches; its mean loss."""
        mask, beta = samples.response_mask(), self.settings.beta
        size = self.settings.mini_batch_size or len(samples)

        def loss_fn(part: list[int], counts: Counts):
            logp = self._log_probs(samples, part)
            T, dev = logp.shape[1], logp.device
            q = (logp.float() - ref_logprobs[part, :T].to(dev)) * mask[part, :T].to(dev)
            per = F.binary_cross_entropy_with_logits(beta * q.sum(1), outcomes[part].to(dev), reduction="none")
            loss = per.sum() / counts.sequences
            return loss, lambda: {"loss": loss.item()}

        steps, _ = run_update(self, mask, orders, size, self.NAMES, loss_fn)
        return sum(t["loss"] for t in steps) / len(steps) if steps else 0.0

    def step(self, samples: Samples, outcomes: torch.Tensor, orders) -> tuple[torch.Tensor, dict[str, float]]:
        """The step's process rewards ``(B, T)`` and the PRM's metrics, updating it as ``update`` says (the module
        docstring). ``outcomes``: the verifier's ``(B,)`` scores, each in [0, 1]."""
        outcomes = outcomes.float()
        if not bool(torch.isfinite(outcomes).all()) or outcomes.min() < 0 or outcomes.max() > 1:
            raise UserError(
                f"prime: the verifier (the run's reward) answered {outcomes.min().item():g}..{outcomes.max().item():g}; "
                "the implicit PRM trains on outcomes in [0, 1] (1 correct, 0 wrong): give reward a rule or server "
                "answering so (reward weights summing to at most 1 in a list)"
            )
        s, mask = self.settings, samples.response_mask()
        ref = self.reference.log_probs(samples)
        q = self.log_ratios(samples, ref)
        implicit = s.beta * q.sum(1)
        metrics = {
            "prime/accuracy": (torch.sign(implicit) == torch.sign(2 * outcomes - 1)).float().mean().item(),
            "prime/implicit_reward": implicit.mean().item(),
        }
        if s.update != "none":
            metrics["prime/loss"] = self.update(samples, ref, outcomes, orders)
            if s.update == "before":
                q = self.log_ratios(samples, ref)
        process = s.beta * q
        if s.granularity == "whole":
            whole = torch.zeros_like(process)
            last = last_tokens(mask)
            whole[torch.arange(len(process)), last] = process.sum(1)
            process = whole
        if s.norm == "batch_norm":
            process = process / (process.flip(-1).cumsum(-1).flip(-1).abs().max() + 1e-6)
        metrics["prime/process_reward"] = process.sum(1).mean().item()
        return process * mask, metrics

    def save(self, directory: str, with_optimizer: bool) -> None:
        """The PRM (+ its optimizer state for a checkpoint); a final save also ``implicit_prm.json`` (and the
        reference's weights when they were made from a config, as ``run_reward.py``'s implicit PRM)."""
        self.optim.save(directory, self.tokenizer, with_optimizer)
        if not with_optimizer and first_rank():
            path = None if self.reference_from_config else os.path.abspath(self.reference_path)
            args = SimpleNamespace(implicit_beta=self.settings.beta, implicit_loss="ce")
            implicit.save_implicit_prm(directory, self.reference.model, path, args)

    def load(self, directory: str) -> None:
        self.optim.load(directory)
