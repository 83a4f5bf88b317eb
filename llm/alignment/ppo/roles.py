"""The model roles of PPO behind small interfaces (interfaces.py's protocols):

- ``PolicyModel`` (reference, rollout copy): ``generate`` and per-token ``log_probs`` of responses.
- ``ActorRole`` (the trained policy): a ``PolicyModel`` that also owns its optimizer and runs the
  PPO update (clipped policy loss, entropy bonus, KL loss) over mini-batches: ``update``.
- ``ValueModel`` / ``CriticRole`` (critic): per-token ``values``; ``CriticRole.update`` fits them.

The rewards (ORM, PRM, rule, HTTP, ...) are the rewards/ package. Every forward goes through the forward
engine (engine.py), every update through the update loop (update.py) with the role's loss function;
generation is generation.py, checkpoints checkpoint.py, everything FSDP2 fsdp.py.

A role may also be one rank of an FSDP2 group (ray_roles.py starts the group), data parallel: a
forward call gets this rank's slice of the samples (the proxy splits and joins them), an update runs
this rank's share of every mini-batch with gradients and stats summed over the ranks, and ranks with
less work run spare forwards, since every forward and backward is a collective; the results equal one
process. Checkpoints and weights for the rollout copy go through full (gathered) state dicts, written
by the first rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from llm.alignment.lm import READOUT_CHUNK, chunked, full_weight
from llm.alignment.ppo import generation
from llm.alignment.ppo.algorithm import kl_estimate, token_stats, value_loss
from llm.alignment.ppo.engine import per_token, readout_tokens
from llm.alignment.ppo.fsdp import FULL, GATHER, head_linear
from llm.alignment.ppo.interfaces import PolicyBatch, Samples, UpdateStats, ValueBatch
from llm.alignment.ppo.objectives import Counts, aggregate, policy_loss
from llm.alignment.ppo.optim import TrainableRole
from llm.alignment.ppo.update import PolicyUpdate, ValueUpdate, run_update
from llm.utils.lora import is_peft_model, merged_state_dict


class PolicyModel:
    """A causal LM as reference or rollout copy: sampling and per-token log-probs at ``temperature``."""

    samples_seen = 0  # samples this process ran forwards over (a rank of a group: its slices only)
    engine = None  # a vLLM engine that generates instead of ``generate`` on the model (vllm_rollout.py)
    readout_chunk = READOUT_CHUNK  # readouts per LM-head block (log-probs, entropies, exact KL)
    ref_head = None  # the reference's (weight, bias, temperature), for the exact KL (take_reference_head)

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        temperature: float,
        micro_batch_size: int,
        gather_for_generation: bool = True,
    ) -> None:
        """``gather_for_generation``: in an FSDP2 group, full weights once per ``generate`` call
        (``fsdp.gathered_for_decoding``) instead of at every decoding step."""
        self.model, self.tokenizer = model, tokenizer
        self.temperature, self.micro_batch_size = temperature, micro_batch_size
        self.gather_for_generation = gather_for_generation

    def generate(
        self,
        prompt_ids: list[list[int]],
        *,
        num_samples: int,
        max_new_tokens: int,
        do_sample: bool,
        top_p: float,
        top_k: int,
        ignore_eos: bool = False,
        seed: int | None = None,
        with_log_probs: bool = False,
        stop_ids: tuple[int, ...] | None = None,
    ):
        """Responses, ``num_samples`` per prompt (and with ``with_log_probs`` their tokens' log-probs from
        the generation's own logits): ``generation.generate`` with this role's model and temperature, or
        the role's vLLM ``engine`` when it has one (``rollout_engine: vllm``, vllm_rollout.py). ``stop_ids``:
        the ids that end a response (the run's ``PPOContext.stop_ids``; None: the tokenizer's EOS)."""
        sampling = {
            "num_samples": num_samples,
            "max_new_tokens": max_new_tokens,
            "do_sample": do_sample,
            "top_p": top_p,
            "top_k": top_k,
            "ignore_eos": ignore_eos,
            "seed": seed,
            "with_log_probs": with_log_probs,
            "stop_ids": stop_ids,
        }
        if self.engine is not None:
            return self.engine.generate(prompt_ids, **sampling)
        return generation.generate(
            self.model,
            self.tokenizer,
            self.temperature,
            prompt_ids,
            **sampling,
            gather_for_generation=self.gather_for_generation,
        )

    def log_probs(self, samples: Samples, with_hidden: bool = False, ref_hidden: torch.Tensor | None = None):
        """Per-token log-probs ``(B, T)`` of the responses (no gradient, CPU). With ``with_hidden`` also the
        final hidden states ``(B, T, H)`` they were read from (a reference's, for the actor's exact KL); with
        ``ref_hidden`` (those of the same samples) also the exact KL(pi || pi_ref) ``(B, T)``, computed chunk
        by chunk with the reference's LM head (``take_reference_head``)."""
        self.samples_seen += len(samples)
        with torch.no_grad():
            out = self._log_probs(samples, list(range(len(samples))), with_hidden=with_hidden, ref_hidden=ref_hidden)
        return tuple(x.cpu() for x in out) if isinstance(out, tuple) else out.cpu()

    def lm_head(self, on_cpu: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, float]:
        """This model's LM head as ``(weight, bias, temperature)``, whole (FSDP2: gathered on every rank), for
        the actor's exact KL: in one process the model's own (frozen) tensors, no copy; ``on_cpu`` (a Ray
        worker answering another process) a CPU copy."""
        head = self.model.get_output_embeddings()
        with torch.no_grad():
            weight, bias = (None if t is None else full_weight(t).detach() for t in (head.weight, head.bias))
        if on_cpu:
            weight, bias = (None if t is None else t.cpu() for t in (weight, bias))
        return weight, bias, self.temperature

    def take_reference_head(self, head: tuple[torch.Tensor, torch.Tensor | None, float]) -> None:
        """Hold the reference's ``lm_head()`` (on this model's device) for ``log_probs(ref_hidden=...)``."""
        weight, bias, temperature = head
        device = self.model.device
        self.ref_head = (weight.to(device), None if bias is None else bias.to(device), temperature)

    def _log_probs(
        self,
        samples: Samples,
        idx: list[int],
        with_entropy: bool = False,
        entropy_grad: bool = False,
        with_hidden: bool = False,
        ref_hidden: torch.Tensor | None = None,
    ):
        """Per-token log-probs ``(b, T)`` of the responses of samples ``idx`` on the model's device, then as
        asked the entropies ``(b, T)``, the hidden states ``(b, T, H)`` and, with the reference's hidden
        states ``ref_hidden`` of samples ``idx``, the exact KL ``(b, T)`` (no gradient); differentiable
        unless the caller disables gradients. The entropies are differentiable only with ``entropy_grad``
        (an entropy bonus); otherwise they are a statistic and keep nothing for backward.

        The LM head runs on ``readout_chunk`` readouts at a time (``lm.chunked``; checkpointed under
        autograd): no ``(tokens, vocab)`` block larger than one chunk exists, forward or backward."""
        lm_head = self.model.get_output_embeddings()
        ref_w, ref_b, ref_t = self.ref_head if ref_hidden is not None else (None, None, 1.0)

        def head(hidden):  # runs on spare rows too: the gather of a sharded head is a collective
            return hidden, full_weight(lm_head.weight), full_weight(lm_head.bias)

        def chunk(h, targets, ref_h, weight, bias):
            logits = F.linear(h.to(weight.dtype), weight, bias).float() / self.temperature  # as fsdp.head_linear
            ref_logits = None if ref_h is None else F.linear(ref_h.to(ref_w.dtype), ref_w, ref_b).float() / ref_t
            return token_stats(logits, targets, with_entropy, entropy_grad, ref_logits)

        def read(out, batch):
            hidden, weight, bias = out
            ref_h = None
            if ref_hidden is not None:  # this row's readouts of the reference's (B, T, H) (on the CPU)
                ref_h = ref_hidden[tuple(i.cpu() for i in readout_tokens(batch))].to(hidden.device)
            per_readout = (hidden, batch.readout_target, ref_h)
            logp, entropy, kl = chunked(chunk, per_readout, (weight, bias), self.readout_chunk)
            asked = ((logp, True), (entropy, with_entropy), (hidden, with_hidden), (kl, ref_h is not None))
            return [x for x, wanted in asked if wanted]

        out = per_token(self.model, samples, idx, self.micro_batch_size, self.tokenizer.pad_token_id, True, head, read)
        return tuple(out) if len(out) > 1 else out[0]

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """A full state dict (``ActorRole.weights``); each FSDP2 rank keeps its shard."""
        set_model_state_dict(self.model, state, options=FULL)

    def sync_from(self, source: ActorRole) -> None:
        """Weight sync: take the trained actor's current weights (a rollout copy does this after each update)."""
        self.load_weights(source.weights())


class ActorRole(PolicyModel):
    """The trained policy: generation and log-probs, plus its optimizer and the PPO policy update."""

    NAMES = ("policy_loss", "abs_policy_loss", "clipfrac", "approx_kl", "entropy", "kl_loss")

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        temperature: float,
        micro_batch_size: int,
        optim: TrainableRole,
        settings: PolicyUpdate,
        gather_for_generation: bool = True,
    ) -> None:
        super().__init__(model, tokenizer, temperature, micro_batch_size, gather_for_generation)
        self.optim, self.settings = optim, settings

    def update(self, batch: PolicyBatch, orders: list[list[int]]) -> UpdateStats:
        """``update.run_update`` over ``orders`` (one per epoch) on the clipped policy loss, minus
        ``entropy_coeff`` x the entropy, plus ``kl_loss_coef`` x the KL to the reference."""
        u = self.settings
        # on-policy (no old log-probs given): the ratio's denominator is each token's own log-prob, detached, and
        # those log-probs (taken before the one optimizer step) are handed back as the rollout's
        seen = torch.zeros(batch.mask.shape) if batch.old_logprobs is None else None

        # the loss mask: with mask_truncated, a response cut at max_response_length (no EOS) adds nothing
        loss_mask = batch.mask * batch.samples.ended[:, None].to(batch.mask.dtype) if u.mask_truncated else batch.mask

        def loss_fn(part: list[int], counts: Counts):
            logp, entropy = self._log_probs(batch.samples, part, with_entropy=True, entropy_grad=bool(u.entropy_coeff))
            T = logp.shape[1]
            dev = logp.device
            m = loss_mask[part, :T].to(dev)
            if seen is not None:
                seen[part, :T] = logp.detach().float().cpu()
            out = policy_loss(
                logp,
                batch.old_logprobs[part, :T].to(dev) if seen is None else logp.detach(),
                batch.advantages[part, :T].to(dev),
                m,
                u.clip_low,
                u.clip_high,
                normaliser=counts.tokens,
                weights=None if batch.is_weights is None else batch.is_weights[part, :T].to(dev),
                objective=u.policy_loss,
                agg_mode=u.loss_agg_mode,
                sequences=counts.sequences,
                max_length=u.max_length,
                clip_c=u.clip_c,
            )
            loss = out.loss
            ent = aggregate(u.loss_agg_mode, entropy, m, counts, u.max_length)
            if u.entropy_coeff:
                loss = loss - u.entropy_coeff * ent
            kl_loss = torch.zeros(())
            if u.kl_loss_coef and batch.ref_logprobs is not None:
                kl = kl_estimate(logp, batch.ref_logprobs[part, :T].to(dev), u.kl_penalty)
                kl_loss = aggregate(u.loss_agg_mode, kl, m, counts, u.max_length)
                loss = loss + u.kl_loss_coef * kl_loss

            def stats() -> dict[str, float]:
                share = m.sum() / counts.tokens
                return {
                    "policy_loss": out.loss.item(),
                    "abs_policy_loss": out.abs_loss.item(),  # normalised by the mini-batch's tokens, as the loss
                    "clipfrac": out.clipfrac.item() * share.item(),
                    "approx_kl": out.approx_kl.item() * share.item(),
                    "entropy": ent.item(),
                    "kl_loss": float(kl_loss.detach()),
                }

            return loss, stats

        steps, epochs = run_update(self, loss_mask, orders, u.mini_batch_size, self.NAMES, loss_fn)
        metrics = {k: sum(t[k] for t in steps) / len(steps) for k in self.NAMES} if steps else {}
        return UpdateStats(metrics, [(e, t["policy_loss"]) for e, t in zip(epochs, steps)], seen)

    def weights(self) -> dict[str, torch.Tensor]:
        """The current full weights on the CPU, for the rollout copy (FSDP2: gathered; {} on other ranks). A LoRA
        actor's are merged (base + adapter) under the plain model's names: the copy is a plain model."""
        if is_peft_model(self.model):
            return merged_state_dict(self.model)
        return get_model_state_dict(self.model, options=GATHER)

    def sync_engine(self) -> float:
        """The model's current weights into its vLLM ``engine`` (after an update or a resume); the seconds
        it took (0 without an engine)."""
        if self.engine is None:
            return 0.0
        self.engine.load_weights(self.weights())
        return self.engine.sync_seconds

    def save(self, directory: str, with_optimizer: bool) -> None:
        self.optim.save(directory, self.tokenizer, with_optimizer)

    def load(self, directory: str) -> None:
        self.optim.load(directory)


class ValueModel:
    """Critic: a sequence-classification model whose score head is read at every response token."""

    samples_seen = 0  # as PolicyModel.samples_seen

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, micro_batch_size: int) -> None:
        self.model, self.tokenizer, self.micro_batch_size = model, tokenizer, micro_batch_size

    def values(self, samples: Samples) -> torch.Tensor:
        """Per-token values ``(B, T)`` of the states before each response token (no gradient, CPU)."""
        self.samples_seen += len(samples)
        with torch.no_grad():
            return self._values(samples, list(range(len(samples)))).cpu()

    def _values(self, samples: Samples, idx: list[int]) -> torch.Tensor:
        def head(hidden):
            return head_linear(self.model.score, hidden).squeeze(-1).float()

        pad = self.tokenizer.pad_token_id
        return per_token(self.model, samples, idx, self.micro_batch_size, pad, False, head, lambda v, _: (v,))[0]


class CriticRole(ValueModel):
    """The trained critic: values, plus its optimizer and the clipped value-loss update."""

    NAMES = ("value_loss", "value_clipfrac")

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        micro_batch_size: int,
        optim: TrainableRole,
        settings: ValueUpdate,
    ) -> None:
        super().__init__(model, tokenizer, micro_batch_size)
        self.optim, self.settings = optim, settings

    def update(self, batch: ValueBatch, orders: list[list[int]]) -> UpdateStats:
        """``update.run_update`` as ``ActorRole.update``, on ``value_loss_coef`` x the clipped value loss."""
        u = self.settings

        def loss_fn(part: list[int], counts: Counts):
            tokens = counts.tokens
            v = self._values(batch.samples, part)
            T = v.shape[1]
            dev = v.device
            m = batch.mask[part, :T].to(dev)
            loss, clipfrac = value_loss(
                v,
                batch.old_values[part, :T].to(dev),
                batch.returns[part, :T].to(dev),
                m,
                u.cliprange_value,
                normaliser=tokens,
            )
            stats = lambda: {"value_loss": loss.item(), "value_clipfrac": clipfrac.item() * (m.sum() / tokens).item()}
            return u.value_loss_coef * loss, stats

        steps, epochs = run_update(self, batch.mask, orders, u.mini_batch_size, self.NAMES, loss_fn)
        metrics = {k: sum(t[k] for t in steps) / len(steps) for k in self.NAMES}
        return UpdateStats(metrics, [(e, t["value_loss"]) for e, t in zip(epochs, steps)])

    def save(self, directory: str, with_optimizer: bool) -> None:
        self.optim.save(directory, self.tokenizer, with_optimizer)

    def load(self, directory: str) -> None:
        self.optim.load(directory)
