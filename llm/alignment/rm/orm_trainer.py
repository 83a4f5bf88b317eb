"""Outcome reward model: a score head (``model.score``) read at the last token of each answer of a preference pair.

One item = one pair: ``-log sigmoid(s_chosen - s_rejected - margin)`` plus the optional centering and score
regularization terms (``rm.loss.pairwise_loss``), with ``margin``, ``center_rewards_coefficient`` and
``score_regularization`` read from the training arguments.

An ORM's dev split may also hold best-of-N candidates (``llm.data.readers.orm_eval``): one readout each
(``readout_part == CANDIDATE``), scored by the same head, in no loss (a pair's loss is the only item).
"""

from __future__ import annotations

from collections import defaultdict

import torch

from llm.alignment.rm.data import CANDIDATE
from llm.alignment.rm.evaluation import Candidate, orm_best_of_n_metrics
from llm.alignment.rm.loss import pairwise_loss
from llm.alignment.rm.trainer import RewardTrainer
from llm.alignment.trainer import ItemOutputs
from llm.data.packing import PackedBatch


class ORMTrainer(RewardTrainer):
    loss_items_description = "preference pairs"

    def count_items(self, batch: PackedBatch) -> int:
        return int((batch.readout_part == 0).sum())  # one chosen readout per pair; best-of-N candidates are none

    def head_parameters(self) -> list[torch.nn.Parameter]:
        # the score head's trained tensors (under LoRA the modules_to_save copy, not the frozen original)
        return [p for p in self.model.score.parameters() if p.requires_grad]

    def forward_items(self, model, batch: PackedBatch) -> ItemOutputs:
        hidden = self.readout_hidden(model, batch)
        head = self.model.score
        scores = head(hidden.to(head.weight.dtype)).squeeze(-1).float()
        part = batch.readout_part
        chosen, rejected = scores[part == 0], scores[part == 1]
        a = self.args
        loss = pairwise_loss(chosen, rejected, a.margin, a.center_rewards_coefficient, a.score_regularization)
        values = {"chosen": chosen.detach(), "rejected": rejected.detach()}
        single = part == CANDIDATE
        if model.training or not bool(single.any()):  # only pairs (an ORM trains on pairs only)
            return ItemOutputs(loss, values)
        # best-of-N candidates (evaluation): one item per example, a pair's loss or 0 (not counted) for a candidate
        pairs = batch.readout_example[part == 0]
        per_example = scores.new_zeros(batch.num_examples).index_put((pairs,), loss)
        counted = torch.zeros(batch.num_examples, dtype=torch.bool, device=scores.device).index_fill(0, pairs, True)
        values.update(
            candidate=scores[single].detach(), pair_example=pairs, candidate_example=batch.readout_example[single]
        )
        return ItemOutputs(per_example, values, counted=counted)

    def example_outputs(self, batch: PackedBatch, out: ItemOutputs) -> list[dict]:
        records = batch.records.tolist()
        v = out.values
        if "candidate" not in v:
            return [
                {"record": rec, "chosen_score": c, "rejected_score": r}
                for rec, c, r in zip(records, v["chosen"].tolist(), v["rejected"].tolist())
            ]
        # pairs and best-of-N candidates (a candidate's one score: "score")
        examples = [{"record": rec} for rec in records]
        for ex, c, r in zip(v["pair_example"].tolist(), v["chosen"].tolist(), v["rejected"].tolist()):
            examples[ex].update(chosen_score=c, rejected_score=r)
        for ex, score in zip(v["candidate_example"].tolist(), v["candidate"].tolist()):
            examples[ex]["score"] = score
        return examples

    def record_metrics(self, examples: list[dict], records: list) -> dict[str, float]:
        """Best-of-N over the candidates among ``examples`` (``bon@N``, ``weighted_vote@N`` with sigmoid weights,
        ``majority_vote@N``, ``pass@N``); each candidate's example gets its group, answer and correctness for the
        scores file."""
        groups: dict[str, list[Candidate]] = defaultdict(list)
        for ex in examples:
            if "score" in ex:
                rec = records[ex["record"]]
                ex.update(group=rec.group, answer=rec.answer, correct=rec.correct)
                groups[rec.group].append(Candidate([ex["score"]], rec.answer, rec.correct))
        if not groups:
            return {}
        bon = orm_best_of_n_metrics(groups, self.args.seed)
        self.plot_best_of_n(bon, "best-of-N (ORM)")
        return bon

    def metric_names(self) -> list[str]:
        return ["accuracy", "margin"]

    def metrics(self, examples: list[dict]) -> dict[str, float]:
        diffs = [ex["chosen_score"] - ex["rejected_score"] for ex in examples if "chosen_score" in ex]
        if not diffs:  # no examples, or best-of-N candidates only: no pair metrics rather than zeros
            return {}
        return {"accuracy": sum(d > 0 for d in diffs) / len(diffs), "margin": sum(diffs) / len(diffs)}
