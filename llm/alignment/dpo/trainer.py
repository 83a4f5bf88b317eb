"""DPO and its variants (IPO, hinge, SimPO, ORPO) on packed pairs ``[prompt | chosen | rejected]``.

One item = one pair: per-pair losses are summed and divided by the global pair count of the
optimizer step. Sequence log-probs are sums over the answer tokens' readouts (``encode_lm``
puts a readout at every answer token; the first rejected token is read at the last prompt position).

The reference log-probs of a pair come, in order of preference, from the batch (precomputed once
with ``with_reference_log_probs``), from the frozen ``ref_model`` on the fly, or are absent
(reference-free losses). A LoRA policy (a peft model) without a ``ref_model`` is its own reference with the
adapter disabled (``llm.utils.lora.reference_model``): the base model, with no second copy in memory.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from llm.alignment.dpo.loss import PairLogProbs, loss_spec, mean_nll, preference_loss
from llm.alignment.lm import READOUT_CHUNK, check_packed_attention, per_example_sums, token_log_probs
from llm.alignment.trainer import AlignmentTrainer, ItemOutputs, gather_objects
from llm.data.encode_lm import CHOSEN, PROMPT, REJECTED
from llm.data.packing import PackedBatch, PackedRow, collate
from llm.utils.distributed import with_spares
from llm.utils.lora import is_peft_model, reference_model


@dataclass(kw_only=True)  # after PackedRow's defaulted fields
class ReferencedRow(PackedRow):
    """A packed row of pairs with each pair's summed reference log-probs (in ``records`` order)."""

    ref_chosen: list[float]
    ref_rejected: list[float]


@dataclass
class PairBatch(PackedBatch):
    ref_chosen: torch.Tensor | None = None  # (E,) precomputed reference log-probs, or None
    ref_rejected: torch.Tensor | None = None

    def to(self, device: torch.device | str) -> PairBatch:
        return PairBatch(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in self.__dict__.items()})


def collate_pairs(rows: list[PackedRow], pad_token_id: int, kernel: str = "sdpa") -> PairBatch:
    """``collate`` plus the rows' precomputed reference log-probs when every row has them."""
    batch = collate(rows, pad_token_id=pad_token_id, kernel=kernel)
    if not all(isinstance(r, ReferencedRow) for r in rows):
        return PairBatch(**batch.__dict__)
    ref_c = torch.tensor([x for r in rows for x in r.ref_chosen], dtype=torch.float32)
    ref_r = torch.tensor([x for r in rows for x in r.ref_rejected], dtype=torch.float32)
    return PairBatch(**batch.__dict__, ref_chosen=ref_c, ref_rejected=ref_r)


def freeze_reference(ref_model: torch.nn.Module | None, device) -> torch.nn.Module | None:
    """A reference model as every trainer holds it: no gradient, eval mode, on ``device``; never trained, never in
    a checkpoint (a resume builds it again as the first run did)."""
    if ref_model is None:
        return None
    ref_model.requires_grad_(False)
    return ref_model.eval().to(device)


class DPOTrainer(AlignmentTrainer):
    """``args``: ``DPOTrainingArguments``, whose ``loss_type``, ``beta``, ``label_smoothing``, ``simpo_gamma``,
    ``sft_loss_weight`` and ``reference_free`` it reads. ``ref_model``: the frozen reference (None: precomputed
    log-probs, a LoRA policy's base, or no reference); ``readout_chunk``: readouts per LM-head block."""

    def __init__(
        self,
        *args,
        ref_model: torch.nn.Module | None = None,
        readout_chunk: int = READOUT_CHUNK,
        **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        check_packed_attention(self.model, "DPOTrainer")
        self.readout_chunk = readout_chunk
        self.spec = loss_spec(self.args.loss_type)
        self.uses_reference = self.args.uses_reference
        self.ref_model = freeze_reference(ref_model, self.args.device)
        # a LoRA policy without an explicit reference: the base model (adapter disabled) is the reference
        self.adapter_reference = ref_model is None and is_peft_model(self.model)

    def _reference_context(self, model):
        """``model`` as the reference: the policy's base with its adapter disabled, or ``model`` itself."""
        if model is self.model and self.adapter_reference:
            return reference_model(model)
        return contextlib.nullcontext(model)

    # one item = one pair
    def count_items(self, batch: PackedBatch) -> int:
        return batch.num_examples

    def pair_log_probs(self, model: torch.nn.Module, head: torch.nn.Linear, batch: PackedBatch):
        """Per-pair answer log-prob sums and lengths, and the per-readout log-probs."""
        logps, _ = token_log_probs(model, head, batch, self.readout_chunk)
        part = batch.readout_part
        ones = torch.ones_like(logps)
        pairs = PairLogProbs(
            per_example_sums(logps, batch, part == CHOSEN),
            per_example_sums(logps, batch, part == REJECTED),
            per_example_sums(ones, batch, part == CHOSEN),
            per_example_sums(ones, batch, part == REJECTED),
        )
        return pairs, logps

    def reference_log_probs(self, batch: PairBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not self.uses_reference:
            return None
        if batch.ref_chosen is not None:
            return batch.ref_chosen, batch.ref_rejected
        model = self.ref_model
        if model is None:
            if not self.adapter_reference:
                raise ValueError("DPOTrainer: no reference model and no precomputed reference log-probs in the batch")
            model = self.model
        with torch.no_grad(), self._reference_context(model) as ref_model:
            ref, _ = self.pair_log_probs(ref_model, ref_model.get_output_embeddings(), batch)
        return ref.chosen, ref.rejected

    def forward_items(self, model, batch: PairBatch) -> ItemOutputs:
        policy, logps = self.pair_log_probs(model, self.model.get_output_embeddings(), batch)
        a = self.args
        out = preference_loss(
            a.loss_type, policy, self.reference_log_probs(batch), a.beta, a.label_smoothing, a.simpo_gamma
        )
        loss = out.loss
        if self.spec.nll_term:
            # ORPO's NLL covers the prompt and the chosen answer, as the official code and TRL compute it.
            seq = (batch.readout_part == CHOSEN) | (batch.readout_part == PROMPT)
            loss = loss + mean_nll(
                per_example_sums(logps, batch, seq), per_example_sums(torch.ones_like(logps), batch, seq)
            )
        elif a.sft_loss_weight:
            loss = loss + a.sft_loss_weight * mean_nll(policy.chosen, policy.chosen_tokens)
        values = {
            "chosen_reward": out.chosen_rewards,
            "rejected_reward": out.rejected_rewards,
            "chosen_logps": out.chosen_logps,
            "rejected_logps": out.rejected_logps,
        }
        return ItemOutputs(loss, values)

    def example_outputs(self, batch: PackedBatch, out: ItemOutputs) -> list[dict]:
        columns = {k: v.tolist() for k, v in out.values.items()}
        return [
            {"record": rec, **{k: col[i] for k, col in columns.items()}} for i, rec in enumerate(batch.records.tolist())
        ]

    def metric_names(self) -> list[str]:
        return [
            "rewards/chosen",
            "rewards/rejected",
            "rewards/margins",
            "rewards/accuracies",
            "logps/chosen",
            "logps/rejected",
        ]

    def metrics(self, examples: list[dict]) -> dict[str, float]:
        """TRL's names: rewards/{chosen,rejected,margins,accuracies}, logps/{chosen,rejected} (means over pairs)."""
        if not examples:
            return {}
        n = len(examples)
        mean = lambda key: sum(ex[key] for ex in examples) / n
        return {
            "rewards/chosen": mean("chosen_reward"),
            "rewards/rejected": mean("rejected_reward"),
            "rewards/margins": mean("chosen_reward") - mean("rejected_reward"),
            "rewards/accuracies": sum(ex["chosen_reward"] > ex["rejected_reward"] for ex in examples) / n,
            "logps/chosen": mean("chosen_logps"),
            "logps/rejected": mean("rejected_logps"),
        }

    # --- reference log-probs computed once ---------------------------------------------------
    def precompute_reference_log_probs(self) -> None:
        """Attach the reference log-probs to the train and eval rows once, then drop the reference model."""
        if self.train_dataset is not None:
            self.train_dataset = self.with_reference_log_probs(
                self.train_dataset, self.args.per_device_train_batch_size
            )
        if self.eval_dataset is not None:
            self.eval_dataset = self.with_reference_log_probs(self.eval_dataset, self.args.per_device_eval_batch_size)
        self.ref_model = None

    def with_reference_log_probs(self, rows: list[PackedRow], batch_size: int) -> list[ReferencedRow]:
        """``rows`` with every pair's reference log-probs, from ``ref_model`` or (without one) the current,
        i.e. initial, policy (a LoRA policy: its base, adapter disabled). Ranks share the work and exchange the
        results."""
        model = self.ref_model if self.ref_model is not None else self.model
        was_training = model.training
        model.eval()
        # Data-parallel ranks share the chunks. Under FSDP2 / tensor parallelism every forward is a collective:
        # the ranks of a tensor-parallel group run the same chunk, and a rank left without one runs a spare
        # forward so that all ranks make the same number of calls.
        dp, dp_rank = self.layout.dp, self.args.process_index // self.layout.tp
        starts = list(range(0, len(rows), batch_size))
        mine = starts[dp_rank::dp]
        rounds = math.ceil(len(starts) / dp) if self.layout.native else len(mine)
        done = []
        with torch.no_grad(), self.compute_loss_context_manager(), self._reference_context(model) as model:
            for start, spare in with_spares(mine, rounds, 0):
                chunk = rows[start : start + batch_size]
                batch = self.data_collator(chunk).to(self.args.device)
                ref, _ = self.pair_log_probs(model, model.get_output_embeddings(), batch)
                if spare:
                    continue
                c, r = ref.chosen.tolist(), ref.rejected.tolist()
                for i, row in enumerate(chunk):
                    first = sum(len(x.records) for x in chunk[:i])
                    n = len(row.records)
                    done.append((start + i, c[first : first + n], r[first : first + n]))
        model.train(was_training)
        by_row = {i: (c, r) for i, c, r in gather_objects(done)}
        return [
            ReferencedRow(**row.__dict__, ref_chosen=by_row[i][0], ref_rejected=by_row[i][1])
            for i, row in enumerate(rows)
        ]
