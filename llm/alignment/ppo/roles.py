"""The four PPO roles behind small interfaces.

- ``PolicyModel`` (reference, rollout copy): ``generate`` and per-token ``log_probs`` of responses.
- ``ActorRole`` (the trained policy): a ``PolicyModel`` that also owns its optimizer and runs the
  PPO update (clipped policy loss, entropy bonus, KL loss) over mini-batches: ``update``.
- ``ValueModel`` / ``CriticRole`` (critic): per-token ``values``; ``CriticRole.update`` fits them.
- ``RewardFunction`` (ORM, PRM, rule, HTTP): ``score(samples) -> RewardOutput``.

Every forward over prompt+response runs on packed rows (no padding waste) with the exact
block-wise attention; token tensors come back as ``(B, T)`` right-padded over response tokens, on
the CPU. Arguments and results are plain records and tensors (``Samples``, ``PolicyBatch``,
``ValueBatch``, ``UpdateStats``, ``RewardOutput``), so a role lives in this process or in a Ray actor
(ray_roles.py wraps these same classes) without the trainer knowing which.

A role may also be one rank of an FSDP2 group (ray_roles.py starts the group), data parallel: a
forward call gets this rank's slice of the samples (the proxy splits and joins them), an update runs
this rank's share of every mini-batch (``_update_shares``) with gradients and stats summed over the
ranks, and ranks with less work run spare forwards (``_micro_batches``), since every forward and
backward is a collective; the results equal one process. Heads
applied outside the model's forward are gathered with ``full_weight``; checkpoints and weights for
the rollout copy go through full (gathered) state dicts, written by the first rank.
"""

from __future__ import annotations

import contextlib
import http.client
import importlib
import json
import math
import os
import socket
import threading
import time
import urllib.parse
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from llm.alignment.lm import full_weight, readout_hidden
from llm.alignment.ppo.algorithm import kl_estimate, policy_loss, value_loss
from llm.alignment.ppo.config import check_reward_url
from llm.alignment.rm.loss import step_scores
from llm.data.packing import causal_example, collate, pack
from llm.data.tokenize import prm_response_ids
from llm.utils.attention import PACKED_SDPA
from llm.utils.distributed import most_over_ranks, share, sum_over_ranks, with_spares
from llm.utils.errors import UserError
from llm.utils.precision import MasterWeightAdamW


class RoleFailure(UserError):
    """A role stopped answering: its process died, or a call ran past its timeout. Names the role."""


@dataclass
class Samples:
    """One rollout: token ids and texts per sample (``num_samples_per_step`` consecutive per prompt)."""

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]  # up to and including EOS when one was generated
    prompts: list[str]
    responses: list[str]
    references: list[str | None]
    ended: torch.Tensor  # (B,) bool: the response ended with EOS

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def select(self, idx: list[int]) -> Samples:
        return Samples(
            [self.prompt_ids[i] for i in idx],
            [self.response_ids[i] for i in idx],
            [self.prompts[i] for i in idx],
            [self.responses[i] for i in idx],
            [self.references[i] for i in idx],
            self.ended[idx],
        )

    def response_mask(self) -> torch.Tensor:
        T = max((len(r) for r in self.response_ids), default=0)
        lengths = torch.tensor([len(r) for r in self.response_ids])
        return (torch.arange(T)[None, :] < lengths[:, None]).float()


def _token_readouts(samples: Samples, idx: list[int]) -> list:
    """Prompt+response of samples ``idx`` as examples; a readout at the token before each response token."""
    examples = []
    for k, i in enumerate(idx):
        p, r = samples.prompt_ids[i], samples.response_ids[i]
        positions = list(range(len(p) - 1, len(p) + len(r) - 1))
        examples.append(causal_example(p + r, positions, r, record=k))
    return examples


def scatter_tokens(values: torch.Tensor, batch, lengths: list[int], T: int) -> torch.Tensor:
    """Flat readout values ``(N, ...)`` (example order within rows) -> ``(B, T, ...)`` right-padded."""
    out = values.new_zeros(len(lengths), T, *values.shape[1:])
    example = batch.records[batch.readout_example]  # sample index of each readout
    # An example's readouts are contiguous and in token order: token index = rank within its run.
    _, counts = torch.unique_consecutive(batch.readout_example, return_counts=True)
    run_start = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    token = torch.arange(len(example), device=example.device) - run_start
    out[example, token] = values
    return out


def _merge(parts: list[torch.Tensor]) -> torch.Tensor:
    """Micro-batch results, each ``(B, T, ...)`` and zero outside its own samples, as one tensor."""
    return sum(parts) if len(parts) > 1 else parts[0]


def _chunks(items: list[int], size: int) -> list[list[int]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def _linear(layer: torch.nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    """``layer(hidden)`` for a head applied outside the model's forward, where an FSDP2-sharded weight is
    a DTensor: gathered (differentiably) to one tensor first. The same op as ``layer(hidden)`` otherwise:
    in the weight's dtype (bf16 with ``training.bf16``; callers upcast the output to fp32)."""
    weight = full_weight(layer.weight)
    return F.linear(hidden.to(weight.dtype), weight, full_weight(layer.bias))


def _sharded() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def _first_rank() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if _sharded() else (0, 1)


def _micro_batches(examples: list, size: int, device) -> list[tuple[list, bool]]:
    """``examples`` packed into one row per forward, each with True for a spare. A row holds up to
    ``size`` x the longest example's tokens (greedy best fit): never more positions than ``size`` padded
    examples, and no padding between examples. In an FSDP2 group every rank makes as many forwards as
    the rank with the most (spares repeat the first row; drop their output). In one process: just the
    rows, no collective."""
    rows, _ = pack(examples, size * max(len(e) for e in examples), "greedy")
    batches = [[row] for row in rows]
    return list(with_spares(batches, most_over_ranks(len(batches), device), batches[0]))


def _sum_steps(steps: list[dict[str, float]], device) -> list[dict[str, float]]:
    """Per-optimizer-step stats summed over the ranks of an FSDP2 group (each rank's are sums over its
    share of the mini-batch, normalised by the whole mini-batch's tokens); as they are in one process."""
    if not steps:
        return steps
    keys = list(steps[0])
    flat = sum_over_ranks([t[k] for t in steps for k in keys], device)
    return [dict(zip(keys, flat[i * len(keys) : (i + 1) * len(keys)])) for i in range(len(steps))]


def _update_shares(mb: list[int], micro_batch_size: int) -> list[tuple[list[int], bool]]:
    """This rank's micro-batches of mini-batch ``mb``: its contiguous share (all of ``mb`` in one process)
    in micro-batches, then spares (``mb[:1]``, True) up to the count of the largest share, so every rank
    runs the same number of forwards and backwards. Each micro-batch packs into one forward."""
    rank, world = _rank_world()
    mine = [mb[i] for i in share(len(mb), rank, world)]
    rounds = math.ceil(math.ceil(len(mb) / world) / micro_batch_size)
    return list(with_spares(_chunks(mine, micro_batch_size), rounds, mb[:1]))


# Full (unsharded) state dicts: gathered to the first rank on the CPU (other ranks get {}), and loaded
# on every rank, each keeping its shard. The same calls work on a model in one process.
GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True)
FULL = StateDictOptions(full_state_dict=True)


@contextlib.contextmanager
def standard_attention(model: PreTrainedModel):
    """``generate`` pads prompts and uses a KV cache: run it on stock SDPA, then switch back."""
    model.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        model.set_attn_implementation(PACKED_SDPA)


class _SampledLogProbs:
    """During ``generate``: the log-prob at ``temperature`` of each sampled token, from the logits the
    generation computes anyway. A hook on the LM head keeps the last position's log-softmax of each
    forward; the next forward's input (the token just sampled, KV cache on) picks its entry; the last
    token is picked after ``generate`` returns. Holds one ``(B, V)`` row at a time, never ``(B, T, V)``.
    The raw head output is used, before any logits processor or sampling warper (top-k, top-p): the
    same distribution as the packed forward's log-probs."""

    def __init__(self, model: PreTrainedModel, temperature: float) -> None:
        self.temperature, self.pending, self.steps = temperature, None, []
        head = model.get_output_embeddings()
        self.handles = [
            head.register_forward_hook(self._head),
            model.register_forward_pre_hook(self._next_input, with_kwargs=True),
        ]

    def _head(self, module, args, out) -> None:
        self.pending = torch.log_softmax(out[:, -1].float() / self.temperature, -1)

    def _next_input(self, module, args, kwargs) -> None:
        if self.pending is not None:
            self._take(kwargs["input_ids"][:, -1:])

    def _take(self, tokens: torch.Tensor) -> None:
        self.steps.append(self.pending.gather(-1, tokens.to(self.pending.device)).squeeze(-1).cpu())
        self.pending = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()

    def finish(self, generated: torch.Tensor) -> torch.Tensor:
        """``(B, N)`` log-probs of the ``N`` generated tokens ``generated`` (FSDP2 ranks stepping on after
        they finished, ``synced_gpus``, record extra steps: only the first ``N`` are theirs)."""
        if self.pending is not None and generated.shape[1]:
            self._take(generated[:, -1:])
        steps = self.steps[: generated.shape[1]]
        return torch.stack(steps, 1) if steps else torch.zeros(generated.shape[0], 0)


@contextlib.contextmanager
def gathered_for_decoding(model: PreTrainedModel, enabled: bool = True):
    """In an FSDP2 group: all-gather each sharded module once for a whole ``generate`` call (kept
    unsharded across the decoding steps, freed after) instead of at every decoding step; every rank
    then holds the full weights while it generates, as rollout engines do. Elsewhere, or when FSDP2's
    internals differ from what this expects, nothing changes (the per-step gathers stay)."""
    from torch.distributed.fsdp import FSDPModule

    modules = [m for m in model.modules() if isinstance(m, FSDPModule)] if enabled else []
    try:
        states = [m._get_fsdp_state() for m in modules]
        saved = [(st, st._auto_reshard_after_forward) for st in states]
        groups = [(g, g.post_forward_mesh_info) for st in states for g in st._fsdp_param_groups]
    except AttributeError:
        modules = []
    if not modules:
        yield
        return
    for m in modules:
        m.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for m in modules:
            m.reshard()
        for st, auto in saved:
            st._auto_reshard_after_forward = auto
        for g, info in groups:
            g.post_forward_mesh_info = info


class PolicyModel:
    """A causal LM as reference or rollout copy: sampling and per-token log-probs at ``temperature``."""

    samples_seen = 0  # samples this process ran forwards over (a rank of a group: its slices only)

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        temperature: float,
        micro_batch_size: int,
        gather_for_generation: bool = True,
    ) -> None:
        """``gather_for_generation``: in an FSDP2 group, full weights once per ``generate`` call
        (``gathered_for_decoding``) instead of at every decoding step."""
        self.model, self.tokenizer = model, tokenizer
        self.temperature, self.micro_batch_size = temperature, micro_batch_size
        self.gather_for_generation = gather_for_generation

    @torch.no_grad()
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
    ):
        """Responses (with EOS if generated, without padding), ``num_samples`` per prompt, consecutive;
        with ``with_log_probs`` also their tokens' log-probs ``(B, T)`` (right-padded with 0), taken
        from the generation's own logits (``_SampledLogProbs``).

        ``seed`` reseeds torch's generator here, in the process that samples, so the responses do not
        depend on where the role runs."""
        if seed is not None:
            torch.manual_seed(seed)
        tok = self.tokenizer
        width = max(len(p) for p in prompt_ids)
        ids = torch.full((len(prompt_ids), width), tok.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompt_ids):  # left padding: generation continues from the last column
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        if not do_sample and num_samples > 1:  # greedy: HF returns one sequence per row, so repeat the rows
            ids, mask = ids.repeat_interleave(num_samples, 0), mask.repeat_interleave(num_samples, 0)
            num_samples = 1
        device = self.model.device
        was_training = self.model.training
        self.model.eval()
        recorder = _SampledLogProbs(self.model, self.temperature) if with_log_probs else contextlib.nullcontext()
        # inference_mode: ~15% less per-op overhead than no_grad in the decoding loop on CPU. Not in an
        # FSDP2 group, whose all-gathered parameters must stay usable by the training forwards after.
        mode = contextlib.nullcontext() if _sharded() else torch.inference_mode()
        gathered = gathered_for_decoding(self.model, self.gather_for_generation and _sharded())
        with standard_attention(self.model), recorder, mode, gathered:
            out = self.model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=max_new_tokens,
                do_sample=do_sample,
                temperature=self.temperature if do_sample else None,
                top_p=top_p if do_sample else None,
                top_k=top_k if do_sample else None,
                num_return_sequences=num_samples,
                eos_token_id=None if ignore_eos else tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
                synced_gpus=_sharded(),  # FSDP2 ranks step together until every rank has finished
            )
        self.model.train(was_training)
        responses = []
        for row in out[:, width:].tolist():
            if ignore_eos:
                responses.append(row)  # exactly max_new_tokens tokens, EOS included as an ordinary token
            elif tok.eos_token_id in row:
                responses.append(row[: row.index(tok.eos_token_id) + 1])
            else:
                while row and row[-1] == tok.pad_token_id:
                    row = row[:-1]
                responses.append(row)
        if not with_log_probs:
            return responses
        logprobs = recorder.finish(out[:, width:])
        T = max((len(r) for r in responses), default=0)
        keep = torch.arange(T)[None, :] < torch.tensor([len(r) for r in responses])[:, None]
        return responses, logprobs[:, :T] * keep

    def log_probs(self, samples: Samples, with_logits: bool = False):
        """Per-token log-probs ``(B, T)`` of the responses (no gradient, CPU); with ``with_logits`` also
        the temperature-scaled logits ``(B, T, V)`` at those positions (for the exact "full" KL)."""
        self.samples_seen += len(samples)
        with torch.no_grad():
            out = self._log_probs(samples, list(range(len(samples))), with_logits=with_logits)
        return tuple(x.cpu() for x in out) if with_logits else out.cpu()

    def _log_probs(
        self,
        samples: Samples,
        idx: list[int],
        with_entropy: bool = False,
        with_logits: bool = False,
        entropy_grad: bool = False,
    ):
        """Per-token log-probs ``(b, T)`` of the responses of samples ``idx`` on the model's device (and
        entropies / logits ``(b, T, V)``); differentiable unless the caller disables gradients. The
        entropies are differentiable only with ``entropy_grad`` (an entropy bonus); otherwise they are a
        statistic and their ``(b, T, V)`` intermediates are not kept for backward."""
        lengths = [len(samples.response_ids[i]) for i in idx]
        T = max(lengths)
        examples = _token_readouts(samples, idx)
        head = self.model.get_output_embeddings()
        outs, ents, all_logits = [], [], []
        for micro, spare in _micro_batches(examples, self.micro_batch_size, self.model.device):
            batch = collate(micro, self.tokenizer.pad_token_id)
            batch = batch.to(self.model.device)
            hidden = readout_hidden(self.model, batch, causal_lm=True)
            logits = _linear(head, hidden).float() / self.temperature
            if spare:
                continue
            logp = torch.log_softmax(logits, -1)
            token_logp = logp.gather(-1, batch.readout_target[:, None]).squeeze(-1)
            outs.append(scatter_tokens(token_logp, batch, lengths, T))
            if with_entropy:
                with torch.set_grad_enabled(torch.is_grad_enabled() and entropy_grad):
                    ents.append(scatter_tokens((-(logp.exp() * logp).sum(-1)), batch, lengths, T))
            if with_logits:
                all_logits.append(scatter_tokens(logits.detach(), batch, lengths, T))
        extra = []
        if with_entropy:
            extra.append(_merge(ents))
        if with_logits:
            extra.append(_merge(all_logits))
        return (_merge(outs), *extra) if extra else _merge(outs)

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """A full state dict (``ActorRole.weights``); each FSDP2 rank keeps its shard."""
        set_model_state_dict(self.model, state, options=FULL)

    def sync_from(self, source: ActorRole) -> None:
        """Weight sync: take the trained actor's current weights (a rollout copy does this after each update)."""
        self.load_weights(source.weights())


@dataclass(frozen=True)
class PolicyUpdate:
    """How the actor turns one rollout into optimizer steps (the actor_rollout / algorithm fields)."""

    mini_batch_size: int  # samples per optimizer step
    clip_low: float
    clip_high: float
    entropy_coeff: float = 0.0
    kl_loss_coef: float = 0.0  # > 0: KL to the reference as a loss term (needs PolicyBatch.ref_logprobs)
    kl_penalty: str = "kl"  # the estimator of that loss term


@dataclass(frozen=True)
class ValueUpdate:
    """How the critic fits returns (the critic section's fields)."""

    mini_batch_size: int
    cliprange_value: float | None
    value_loss_coef: float = 1.0


@dataclass
class PolicyBatch:
    """What the actor's update needs of one scored rollout; token tensors ``(B, T)`` on the CPU."""

    samples: Samples
    mask: torch.Tensor
    old_logprobs: torch.Tensor  # the actor's log-probs at rollout time
    advantages: torch.Tensor
    ref_logprobs: torch.Tensor | None  # for the KL loss term


@dataclass
class ValueBatch:
    """What the critic's update needs of one scored rollout; token tensors ``(B, T)`` on the CPU."""

    samples: Samples
    mask: torch.Tensor
    old_values: torch.Tensor  # the critic's values at rollout time (value clipping)
    returns: torch.Tensor


@dataclass
class UpdateStats:
    """One role's update over a rollout: metric means over its optimizer steps, and each step's loss."""

    metrics: dict[str, float]
    losses: list[tuple[int, float]]  # (epoch, loss) per mini-batch, in order


class TrainableRole:
    """Owns a model's optimizer and LR schedule; ``step`` applies accumulated gradients. AdamW keeps fp32
    master weights of bf16 ones (``training.bf16``, ``llm.utils.precision``)."""

    def __init__(
        self,
        model: PreTrainedModel,
        lr: float,
        weight_decay: float,
        betas: tuple[float, float],
        eps: float,
        max_grad_norm: float,
        warmup_steps: int,
    ) -> None:
        self.model = model
        self.optimizer = MasterWeightAdamW(model.parameters(), lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda n: min(1.0, (n + 1) / warmup_steps) if warmup_steps else 1.0
        )
        self.max_grad_norm = max_grad_norm

    def step(self) -> float:
        norm = 0.0
        if self.max_grad_norm and self.max_grad_norm > 0:
            total = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
            norm = float(total.full_tensor() if isinstance(total, DTensor) else total)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def save(self, directory: str, tokenizer: PreTrainedTokenizerBase, with_optimizer: bool) -> None:
        """The model in Hugging Face format (+ tokenizer); ``optimizer.pt`` beside it for a checkpoint.

        Every rank of an FSDP2 group calls this (both gathers are collective); the first one writes.
        The optimizer state is keyed by parameter name, so it loads under any group size."""
        self.model.save_pretrained(directory)
        optimizer = get_optimizer_state_dict(self.model, self.optimizer, options=GATHER) if with_optimizer else None
        if not _first_rank():
            return
        tokenizer.save_pretrained(directory)
        if with_optimizer:
            state = {"optimizer": optimizer, "scheduler": self.scheduler.state_dict()}
            save_tree(directory, OPTIMIZER_STATE, state)

    def load(self, directory: str) -> None:
        set_model_state_dict(self.model, read_safetensors(os.path.join(directory, "model.safetensors")), options=FULL)
        state = load_optimizer_state(directory)
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"], options=FULL)
        self.scheduler.load_state_dict(state["scheduler"])


# optimizer.json (param_groups, scheduler, ...) + optimizer.safetensors (moments, fp32 masters): nothing pickled
OPTIMIZER_STATE = "optimizer"
OPTIMIZER_FILE = "optimizer.safetensors"


def save_tree(directory: str, name: str, obj) -> None:
    from llm.utils.checkpoints import save_tree as save

    save(directory, name, obj)


def read_safetensors(path: str) -> dict:
    from llm.utils.checkpoints import read_safetensors as read

    return read(path)


def load_optimizer_state(directory: str) -> dict:
    """What ``TrainableRole.save`` wrote (JSON + safetensors; an older pickled optimizer.pt is refused, not read)."""
    from llm.utils.checkpoints import load_tree

    if not os.path.isfile(os.path.join(directory, f"{OPTIMIZER_STATE}.json")):
        old = os.path.join(directory, "optimizer.pt")
        if os.path.isfile(old):
            raise UserError(
                f"{old}: an optimizer state pickled by an older version; pickles can run code when loaded, so it is "
                "not read: resume from a checkpoint saved by this version"
            )
        raise UserError(
            f"{directory}: no {OPTIMIZER_STATE}.json; the checkpoint is incomplete: resume from another one"
        )
    state = load_tree(directory, OPTIMIZER_STATE)
    if not isinstance(state, dict) or not {"optimizer", "scheduler"} <= set(state):
        raise UserError(f"{directory}/{OPTIMIZER_STATE}.json: not an optimizer state; the checkpoint is damaged")
    return state


class ActorRole(PolicyModel):
    """The trained policy: generation and log-probs, plus its optimizer and the PPO policy update."""

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
        """One pass per order (an epoch) over mini-batches of ``settings.mini_batch_size`` samples; each
        mini-batch accumulates micro-batches and takes one optimizer step. The loss of every micro-batch
        is divided by the mini-batch's token count, so the split into micro-batches changes nothing.

        A rank of an FSDP2 group runs its contiguous share of every mini-batch (``_update_shares``), the
        gradients are summed over the ranks (``build._sum_gradients``), and so are the stats."""
        u = self.settings
        names = ("policy_loss", "abs_policy_loss", "clipfrac", "approx_kl", "entropy", "kl_loss")
        steps, epochs = [], []
        self.model.train()
        for epoch, order in enumerate(orders):
            for mb in _chunks(order, u.mini_batch_size):
                tokens = batch.mask[mb].sum()
                totals = dict.fromkeys(names, 0.0)
                for part, spare in _update_shares(mb, self.micro_batch_size):
                    logp, entropy = self._log_probs(
                        batch.samples, part, with_entropy=True, entropy_grad=bool(u.entropy_coeff)
                    )
                    T = logp.shape[1]
                    dev = logp.device
                    m = batch.mask[part, :T].to(dev)
                    out = policy_loss(
                        logp,
                        batch.old_logprobs[part, :T].to(dev),
                        batch.advantages[part, :T].to(dev),
                        m,
                        u.clip_low,
                        u.clip_high,
                        normaliser=tokens,
                    )
                    loss = out.loss
                    ent = (entropy * m).sum() / tokens
                    if u.entropy_coeff:
                        loss = loss - u.entropy_coeff * ent
                    kl_loss = torch.zeros(())
                    if u.kl_loss_coef and batch.ref_logprobs is not None:
                        kl = kl_estimate(logp, batch.ref_logprobs[part, :T].to(dev), u.kl_penalty)
                        kl_loss = (kl * m).sum() / tokens
                        loss = loss + u.kl_loss_coef * kl_loss
                    if spare:  # this rank's share ran out: a zero-weighted backward keeps the group in step
                        (loss * 0).backward()
                        continue
                    self.samples_seen += len(part)
                    loss.backward()
                    share = m.sum() / tokens
                    totals["policy_loss"] += out.loss.item()
                    totals["clipfrac"] += out.clipfrac.item() * share.item()
                    totals["approx_kl"] += out.approx_kl.item() * share.item()
                    totals["entropy"] += ent.item()
                    totals["kl_loss"] += float(kl_loss.detach())
                self.optim.step()
                steps.append(totals)
                epochs.append(epoch)
        steps = _sum_steps(steps, self.model.device)
        for totals in steps:
            totals["abs_policy_loss"] = abs(totals["policy_loss"])
        metrics = {k: sum(t[k] for t in steps) / len(steps) for k in names} if steps else {}
        return UpdateStats(metrics, [(e, t["policy_loss"]) for e, t in zip(epochs, steps)])

    def weights(self) -> dict[str, torch.Tensor]:
        """The current full weights on the CPU, for the rollout copy (FSDP2: gathered; {} on other ranks)."""
        return get_model_state_dict(self.model, options=GATHER)

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
        lengths = [len(samples.response_ids[i]) for i in idx]
        T = max(lengths)
        examples = _token_readouts(samples, idx)
        outs = []
        for micro, spare in _micro_batches(examples, self.micro_batch_size, self.model.device):
            batch = collate(micro, self.tokenizer.pad_token_id)
            batch = batch.to(self.model.device)
            hidden = readout_hidden(self.model, batch, causal_lm=False)
            values = _linear(self.model.score, hidden).squeeze(-1).float()
            if not spare:
                outs.append(scatter_tokens(values, batch, lengths, T))
        return _merge(outs)


class CriticRole(ValueModel):
    """The trained critic: values, plus its optimizer and the clipped value-loss update."""

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
        """Mini-batch epochs as ``ActorRole.update``, on ``value_loss_coef`` x the clipped value loss."""
        u = self.settings
        steps, epochs = [], []
        self.model.train()
        for epoch, order in enumerate(orders):
            for mb in _chunks(order, u.mini_batch_size):
                tokens = batch.mask[mb].sum()
                total, frac = 0.0, 0.0
                for part, spare in _update_shares(mb, self.micro_batch_size):
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
                    if spare:  # as in ActorRole.update
                        (loss * 0).backward()
                        continue
                    self.samples_seen += len(part)
                    (u.value_loss_coef * loss).backward()
                    total += loss.item()
                    frac += clipfrac.item() * (m.sum() / tokens).item()
                self.optim.step()
                steps.append({"value_loss": total, "value_clipfrac": frac})
                epochs.append(epoch)
        steps = _sum_steps(steps, self.model.device)
        metrics = {k: sum(t[k] for t in steps) / len(steps) for k in ("value_loss", "value_clipfrac")}
        return UpdateStats(metrics, [(e, t["value_loss"]) for e, t in zip(epochs, steps)])

    def save(self, directory: str, with_optimizer: bool) -> None:
        self.optim.save(directory, self.tokenizer, with_optimizer)

    def load(self, directory: str) -> None:
        self.optim.load(directory)


# --- rewards ------------------------------------------------------------------------------------------
@dataclass
class RewardOutput:
    scores: torch.Tensor  # (B,) outcome score added at the last response token
    dense: torch.Tensor | None = None  # (B, T) extra per-token rewards (PRM steps), or None


class RewardFunction:
    samples_seen = 0  # model rewards: as PolicyModel.samples_seen

    def score(self, samples: Samples) -> RewardOutput:
        raise NotImplementedError


def _check_score(value, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise UserError(
            f"{where} returned {value!r}; a reward must be a finite number (a bad sample is never "
            "silently turned into a zero reward)"
        )
    return float(value)


class RuleReward(RewardFunction):
    """``module:function(prompt, response, reference) -> float``. The module is imported and the function
    run in this process: a rule is code the user trusts. Anything it raises (``SystemExit`` and
    ``KeyboardInterrupt`` included) stops the run with a message naming the function and the sample."""

    def __init__(self, spec: str) -> None:
        module_name, _, fn_name = spec.partition(":")
        if not module_name or not fn_name:
            raise UserError(f"reward.rule {spec!r}: must be 'package.module:function'")
        try:
            self.fn = getattr(importlib.import_module(module_name), fn_name)
        except (ImportError, AttributeError, ValueError) as err:
            raise UserError(f"reward.rule {spec!r}: cannot import ({err}); use 'package.module:function'") from None
        except BaseException as err:  # noqa: BLE001 - the module's own code failed while it was imported
            raise UserError(
                f"reward.rule {spec!r}: importing {module_name} raised {type(err).__name__}: {err}"
            ) from None
        if not callable(self.fn):
            raise UserError(f"reward.rule {spec!r}: {fn_name} is not a function")
        self.spec = spec

    def score(self, samples: Samples) -> RewardOutput:
        out = []
        for i in range(len(samples)):
            try:
                value = self.fn(samples.prompts[i], samples.responses[i], samples.references[i])
            except BaseException as err:  # noqa: BLE001 - any user-code failure (SystemExit too) stops the run here
                raise RoleFailure(
                    f"reward.rule {self.spec} raised {type(err).__name__}: {err} on sample {i} "
                    f"(prompt {samples.prompts[i][:80]!r}, response {samples.responses[i][:80]!r}); the run stops: "
                    "fix the function"
                ) from None
            out.append(_check_score(value, f"reward.rule {self.spec} on sample {i}"))
        return RewardOutput(torch.tensor(out))


class _Retry(Exception):
    """A reward request that failed in a way worth trying again (connection, timeout, 429, 5xx)."""


class HttpReward(RewardFunction):
    """POST ``{"prompts", "responses", "references", "ended"}`` as JSON (``ended``: the response stopped at
    EOS); expects ``{"scores": [float, ...]}`` (``llm/serve_reward.py`` serves a trained ORM / PRM so).

    http:// and https:// only; a redirect is an error (never followed: a followed 302 turns the POST into
    a body-less GET). ``timeout`` bounds each request as a whole (connect, send, every byte of the answer),
    not each socket read; a failed request (connection error, timeout, 429, 5xx) is retried up to
    ``max_retries`` times, ``retry_backoff`` seconds before the first retry and twice as long before each
    next one; an answer over ``max_response_bytes`` is an error. A failure stops the run naming the URL."""

    def __init__(
        self,
        url: str,
        timeout: float,
        max_retries: int = 2,
        retry_backoff: float = 1.0,
        max_response_bytes: int = 16 * 2**20,
    ) -> None:
        check_reward_url(url)
        self.url, self.timeout = url, timeout
        self.max_retries, self.retry_backoff, self.max_response_bytes = max_retries, retry_backoff, max_response_bytes
        self.parts = urllib.parse.urlsplit(url)

    def score(self, samples: Samples) -> RewardOutput:
        body = json.dumps(
            {
                "prompts": samples.prompts,
                "responses": samples.responses,
                "references": samples.references,
                "ended": [bool(e) for e in samples.ended],
            }
        ).encode()
        failures = []
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(self.retry_backoff * 2 ** (attempt - 1))
            try:
                raw = self._post(body)
                break
            except _Retry as err:
                failures.append(str(err))
        else:
            raise RoleFailure(
                f"reward server {self.url} failed {len(failures)} time(s) (reward.max_retries={self.max_retries}): "
                f"{failures[-1]}; check that it is up, or raise reward.timeout / reward.max_retries"
            )
        return RewardOutput(torch.tensor(self._scores(raw, len(samples))))

    def _scores(self, raw: bytes, n: int) -> list[float]:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise RoleFailure(f"reward server {self.url} answered a body that is not UTF-8 text ({err})") from None
        try:
            payload = json.loads(text)
        except json.JSONDecodeError as err:
            raise RoleFailure(
                f"reward server {self.url} did not answer JSON ({err.msg} at position {err.pos}; the body begins "
                f"{text[:80]!r})"
            ) from None
        scores = payload.get("scores") if isinstance(payload, dict) else None
        if not isinstance(scores, list) or len(scores) != n:
            got = f"{len(scores)} scores" if isinstance(scores, list) else f"{text[:80]!r}"
            raise RoleFailure(
                f'reward server {self.url} must answer {{"scores": [...]}} with {n} numbers (one per sample), got {got}'
            )
        return [_check_score(s, f"reward server {self.url} for sample {i}") for i, s in enumerate(scores)]

    def _post(self, body: bytes) -> bytes:
        """One request within ``timeout`` seconds in all: the body of a 2xx answer, ``_Retry`` for a failure
        worth retrying, RoleFailure for one that is not (a redirect, another 4xx, an over-long answer)."""
        p = self.parts
        cls = http.client.HTTPSConnection if p.scheme.lower() == "https" else http.client.HTTPConnection
        conn = cls(p.hostname, p.port, timeout=self.timeout)
        deadline = time.monotonic() + self.timeout
        expired, opened = threading.Event(), []

        def expire() -> None:  # the one deadline: a socket timeout alone bounds each read, not the request
            expired.set()
            for sock in opened:
                with contextlib.suppress(OSError):
                    socket.socket.shutdown(sock, socket.SHUT_RDWR)

        timer = threading.Timer(self.timeout, expire)
        timer.daemon = True
        timer.start()
        path = (p.path or "/") + (f"?{p.query}" if p.query else "")
        try:
            conn.connect()
            opened.append(conn.sock)  # kept: the connection lets go of it once the answer will close it
            if expired.is_set():
                raise TimeoutError
            conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            status = resp.status
            if 300 <= status < 400:
                raise RoleFailure(
                    f"reward server {self.url} answered {status} {resp.reason} redirecting to "
                    f"{resp.getheader('Location')!r}: redirects are not followed (a redirected POST loses its "
                    "body); set reward.url to the final address"
                )
            if status == 429 or status >= 500:
                raise _Retry(f"HTTP {status} {resp.reason}")
            if status >= 400 or status < 200:
                snippet = resp.read1(200).decode("utf-8", "replace") if not expired.is_set() else ""
                raise RoleFailure(f"reward server {self.url} answered HTTP {status} {resp.reason}: {snippet!r}")
            limit = self.max_response_bytes
            length = resp.getheader("Content-Length")
            if length is not None and length.isdigit() and int(length) > limit:
                raise RoleFailure(
                    f"reward server {self.url} answered {int(length)} bytes, more than reward.max_response_bytes="
                    f"{limit}"
                )
            chunks, size = [], 0
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or expired.is_set():
                    raise TimeoutError
                opened[0].settimeout(left)
                chunk = resp.read1(min(65536, limit + 1 - size))
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
                if size > limit:
                    raise RoleFailure(
                        f"reward server {self.url} answered more than reward.max_response_bytes={limit} bytes"
                    )
            if expired.is_set():
                raise TimeoutError
            return b"".join(chunks)
        except (RoleFailure, _Retry):
            raise
        except (OSError, http.client.HTTPException, ValueError) as err:
            if expired.is_set() or isinstance(err, TimeoutError):
                raise _Retry(f"no complete answer in time (timeout {self.timeout:g}s for the whole request)") from None
            raise _Retry(f"{type(err).__name__}: {err}") from None
        finally:
            timer.cancel()
            conn.close()


def same_vocabulary(a: PreTrainedTokenizerBase, b: PreTrainedTokenizerBase) -> bool:
    """Whether token ids of ``a`` mean the same in ``b`` (then a model of ``b`` can read ``a``'s ids)."""
    return a is b or a.get_vocab() == b.get_vocab()


def _retokenise(samples: Samples, actor_tok: PreTrainedTokenizerBase, tok: PreTrainedTokenizerBase):
    """Token ids for a reward model: the actor's own when vocabularies agree, else re-tokenised text."""
    if same_vocabulary(actor_tok, tok):
        return samples.prompt_ids, samples.response_ids
    prompts = [tok(p)["input_ids"] for p in samples.prompts]
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    responses = [
        tok(r, add_special_tokens=False)["input_ids"] + eos * bool(samples.ended[i])
        for i, r in enumerate(samples.responses)
    ]
    return prompts, responses


class ORMReward(RewardFunction):
    """Outcome reward model: score head at the last response token."""

    def __init__(self, model, tokenizer, actor_tokenizer, micro_batch_size: int) -> None:
        self.model, self.tokenizer, self.actor_tokenizer = model, tokenizer, actor_tokenizer
        self.micro_batch_size = micro_batch_size

    @torch.no_grad()
    def score(self, samples: Samples) -> RewardOutput:
        prompts, responses = _retokenise(samples, self.actor_tokenizer, self.tokenizer)
        examples = [
            causal_example(p + r, [len(p) + len(r) - 1], [0], record=i)
            for i, (p, r) in enumerate(zip(prompts, responses))
        ]
        scores = torch.zeros(len(samples))
        self.samples_seen += len(samples)
        for micro, spare in _micro_batches(examples, self.micro_batch_size, self.model.device):
            batch = collate(micro, self.tokenizer.pad_token_id)
            batch = batch.to(self.model.device)
            hidden = readout_hidden(self.model, batch, causal_lm=False)
            values = _linear(self.model.score, hidden).squeeze(-1).float().cpu()
            if not spare:
                scores[batch.records[batch.readout_example].cpu()] = values
        return RewardOutput(scores)


def split_steps(text: str, separator: str) -> list[tuple[int, int]]:
    """Character spans ``[start, end)`` of the non-empty steps of ``text``."""
    spans, start = [], 0
    for piece in text.split(separator):
        end = start + len(piece)
        if piece.strip():
            spans.append((start, end))
        start = end + len(separator)
    return spans


def char_to_token_end(tokenizer, response_ids: list[int], char_end: int) -> int:
    """Index of the response token that completes the first ``char_end`` characters of its text."""
    for k in range(len(response_ids)):
        if len(tokenizer.decode(response_ids[: k + 1], skip_special_tokens=True)) >= char_end:
            return k
    return len(response_ids) - 1


class PRMReward(RewardFunction):
    """Process reward model: split the response into steps, insert the placeholder after each, read
    ``P(+)`` per step. ``dense``: each step score is a reward at the step's last response token;
    ``min`` / ``last`` / ``mean``: one outcome score."""

    def __init__(
        self,
        model,
        tokenizer,
        actor_tokenizer,
        separator: str,
        placeholder: str,
        reward_token_ids: tuple[int, int],
        placeholder_id: int,
        aggregation: str,
        micro_batch_size: int,
    ) -> None:
        self.model, self.tokenizer, self.actor_tokenizer = model, tokenizer, actor_tokenizer
        self.separator, self.placeholder, self.placeholder_id = separator, placeholder, placeholder_id
        self.reward_token_ids, self.aggregation = list(reward_token_ids), aggregation
        self.micro_batch_size = micro_batch_size

    @torch.no_grad()
    def step_scores(self, samples: Samples) -> tuple[list[list[float]], list[list[tuple[int, int]]]]:
        spans = [split_steps(r, self.separator) for r in samples.responses]
        examples = []
        for i, (prompt, text) in enumerate(zip(samples.prompts, samples.responses)):
            steps = [text[s:e].strip() for s, e in spans[i]] or [text.strip() or "(empty)"]
            p = self.tokenizer(prompt)["input_ids"]
            # token level, as in PRM training: exactly one placeholder id per step, whatever the tokenizer
            r, marks = prm_response_ids(self.tokenizer, steps, self.placeholder, self.placeholder_id)
            examples.append(causal_example(p + r, [len(p) + m for m in marks], [0] * len(marks), record=i))
        per_sample: list[list[float]] = [[] for _ in range(len(samples))]
        head = self.model.get_output_embeddings()
        self.samples_seen += len(samples)
        for micro, spare in _micro_batches(examples, self.micro_batch_size, self.model.device):
            batch = collate(micro, self.tokenizer.pad_token_id)
            batch = batch.to(self.model.device)
            hidden = readout_hidden(self.model, batch, causal_lm=True)
            logits = F.linear(hidden, full_weight(head.weight)[self.reward_token_ids])
            if spare:
                continue
            probs = step_scores(logits).cpu().tolist()
            for e, prob in zip(batch.records[batch.readout_example].tolist(), probs):
                per_sample[e].append(prob)
        return per_sample, spans

    def score(self, samples: Samples) -> RewardOutput:
        per_sample, spans = self.step_scores(samples)
        if self.aggregation != "dense":
            agg = {"min": min, "last": lambda xs: xs[-1], "mean": lambda xs: sum(xs) / len(xs)}[self.aggregation]
            return RewardOutput(torch.tensor([agg(s) for s in per_sample]))
        T = max(len(r) for r in samples.response_ids)
        dense = torch.zeros(len(samples), T)
        for i, scores in enumerate(per_sample):
            ends = [e for _, e in spans[i]] or [len(samples.responses[i])]
            for score, char_end in zip(scores, ends):
                dense[i, char_to_token_end(self.actor_tokenizer, samples.response_ids[i], char_end)] += score
        return RewardOutput(torch.zeros(len(samples)), dense)
