"""Reward-model trainer: ORM (score head on pairs) or PRM (reward-token logits at step placeholders).

The two modes differ only in how the final hidden states at the readout positions become
per-item losses and per-example outputs; everything else is ``AlignmentTrainer``.

An ORM's dev split may also hold best-of-N candidates (``llm.data.readers.orm_eval``): one readout each
(``readout_part == CANDIDATE``), scored by the same head, in no loss (a pair's loss is the only item).

Precision (``llm.utils.precision``): the heads get the hidden states cast to their weight's dtype (the
matmul runs in bf16/fp16 under the trainer's autocast, O1 and O2); reward logits and scores are upcast
to fp32 before the cross-entropy, softmax and log-sigmoid of ``rm.loss``.
"""

from __future__ import annotations

import functools
import os
from collections import defaultdict

import torch
import torch.nn.functional as F

from llm.alignment.lm import check_packed_attention, full_weight, readout_hidden
from llm.alignment.rm import readout
from llm.alignment.rm.evaluation import (
    Candidate,
    Solution,
    best_of_n_metrics,
    best_threshold,
    first_error,
    metric_name,
    orm_best_of_n_metrics,
    plot_best_of_n,
    processbench_metrics,
)
from llm.alignment.rm.loss import pairwise_loss, step_loss, step_scores
from llm.alignment.trainer import AlignmentTrainer, ItemOutputs
from llm.data.packing import PackedBatch
from llm.utils.errors import UserError
from llm.utils.lora import head_bias

BEST_OF_N_PLOT = "eval_best_of_n.png"  # next to eval_results.json
CANDIDATE = 2  # readout_part of an ORM best-of-N candidate's one readout (a pair's: 0 chosen, 1 rejected)


class RewardTrainer(AlignmentTrainer):
    # The last decoder layer runs at the readout positions only (llm/alignment/rm/readout.py); same numbers.
    last_layer_at_readouts = True

    def __init__(
        self,
        *args,
        process_reward: bool,
        reward_token_ids: tuple[int, int] | None = None,
        reward_tokens: tuple[str, str] = ("+", "-"),
        margin: float = 0.0,
        center_rewards_coefficient: float = 0.0,
        score_regularization: float = 0.0,
        **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        check_packed_attention(self.model, "RewardTrainer")
        self.process_reward = process_reward
        self.reward_token_ids = list(reward_token_ids) if reward_token_ids else None
        self.reward_tokens = tuple(reward_tokens)  # how labels are written: the positive and negative token
        self.margin = margin
        self.center = center_rewards_coefficient
        self.regularization = score_regularization
        if process_reward and self.reward_token_ids is None:
            raise ValueError("PRM mode needs reward_token_ids")
        self.readouts_only = self.last_layer_at_readouts and readout.install(self.model)

    @property
    def loss_items_description(self) -> str:
        return "labelled steps" if self.process_reward else "preference pairs"

    # one "item" = one step (PRM) or one pair (ORM)
    def count_items(self, batch: PackedBatch) -> int:
        # unlabelled steps (target -1) are scored but are no loss items; nor are an ORM's best-of-N candidates
        if self.process_reward:
            return int((batch.readout_target >= 0).sum())
        return int((batch.readout_part == 0).sum())  # one chosen readout per pair

    def forward_items(self, model, batch: PackedBatch) -> ItemOutputs:
        call = functools.partial(model, readout_index=batch.readout_index) if self.readouts_only else model
        hidden = readout_hidden(call, batch, causal_lm=self.process_reward)
        if self.process_reward:
            head = self.model.get_output_embeddings()
            # under lora_train_head peft wraps the head: its weight has the trained reward rows merged in
            weight, bias = full_weight(head.weight), full_weight(head_bias(head))
            bias = bias[self.reward_token_ids] if bias is not None else None
            # accelerate returns the forward's outputs in fp32; O2's head weight is bf16
            logits = F.linear(hidden.to(weight.dtype), weight[self.reward_token_ids], bias).float()
            loss = step_loss(logits, batch.readout_target)
            values = {"score": step_scores(logits).detach(), "logits": logits.detach()}
            return ItemOutputs(loss, values, counted=batch.readout_target >= 0)
        head = self.model.score
        scores = head(hidden.to(head.weight.dtype)).squeeze(-1).float()
        part = batch.readout_part
        chosen, rejected = scores[part == 0], scores[part == 1]
        loss = pairwise_loss(chosen, rejected, self.margin, self.center, self.regularization)
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
        if not self.process_reward and "candidate" not in out.values:
            return [
                {"record": rec, "chosen_score": c, "rejected_score": r}
                for rec, c, r in zip(records, out.values["chosen"].tolist(), out.values["rejected"].tolist())
            ]
        if not self.process_reward:  # pairs and best-of-N candidates (a candidate's one score: "score")
            examples = [{"record": rec} for rec in records]
            v = out.values
            for ex, c, r in zip(v["pair_example"].tolist(), v["chosen"].tolist(), v["rejected"].tolist()):
                examples[ex].update(chosen_score=c, rejected_score=r)
            for ex, score in zip(v["candidate_example"].tolist(), v["candidate"].tolist()):
                examples[ex]["score"] = score
            return examples
        examples = [{"record": rec, "step_scores": [], "labels": []} for rec in records]
        for ex, score, label in zip(
            batch.readout_example.tolist(), out.values["score"].tolist(), batch.readout_target.tolist()
        ):
            examples[ex]["step_scores"].append(score)
            examples[ex]["labels"].append(self.reward_tokens[label] if label >= 0 else None)
        return examples

    def eval_metrics(self, examples: list[dict]) -> dict[str, float]:
        """The step / pair metrics, and over the eval records that carry them: ProcessBench (records with a
        first-error label) and best-of-N (records with an answer and a correct flag) of
        ``llm.alignment.rm.evaluation``. ProcessBench examples get ``predicted_first_error``. An ORM: the pair
        metrics over its pairs and its best-of-N over its candidates (``orm_best_of_n``)."""
        metrics = self.metrics(examples)
        records = getattr(self, "eval_records", None)
        if not records:
            return metrics
        if not self.process_reward:
            return {**metrics, **self.orm_best_of_n(examples, records)}
        args = self.args
        solutions, groups = [], defaultdict(list)
        for ex in examples:
            rec = records[ex["record"]]
            if getattr(rec, "first_error", None) is not None:
                ex["first_error"] = rec.first_error
                ex["predicted_first_error"] = first_error(ex["step_scores"], args.prm_threshold)
                solutions.append(Solution(ex["step_scores"], rec.first_error, rec.subset, rec.generator))
            if getattr(rec, "correct", None) is not None and ex["step_scores"]:
                groups[rec.group].append(Candidate(ex["step_scores"], rec.answer, rec.correct))
        if solutions:
            metrics.update(processbench_metrics(solutions, args.prm_threshold))
            subset = args.prm_threshold_subset
            if subset is not None:
                tuned = [s for s in solutions if s.subset is not None and metric_name(s.subset) == metric_name(subset)]
                if not tuned:
                    found = sorted({s.subset for s in solutions if s.subset is not None})
                    raise UserError(
                        f"prm_threshold_subset={subset!r}: no ProcessBench record of that subset in the eval data "
                        f"(subsets: {', '.join(found) or 'none'})"
                    )
                best, best_f1 = best_threshold(tuned)
                metrics["processbench_best_threshold"], metrics[f"processbench_{metric_name(subset)}_best_f1"] = (
                    best,
                    best_f1,
                )
                at_best = processbench_metrics(solutions, best)
                metrics.update(
                    {f"{k}_at_best_threshold": v for k, v in at_best.items() if k != "processbench_threshold"}
                )
        if groups:
            aggregations = [a.strip() for a in args.bon_aggregations.split(",")]
            bon = best_of_n_metrics(groups, aggregations, args.seed)
            metrics.update(bon)
            self.plot_best_of_n(bon, "best-of-N")
        return metrics

    def orm_best_of_n(self, examples: list[dict], records: list) -> dict[str, float]:
        """An ORM's best-of-N over the candidates among ``examples`` (``bon@N``, ``weighted_vote@N`` with
        sigmoid weights, ``majority_vote@N``, ``pass@N``); each candidate's example gets its group, answer and
        correctness for the scores file."""
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

    def plot_best_of_n(self, metrics: dict[str, float], title: str) -> None:
        if self.is_world_process_zero():
            os.makedirs(self.args.output_dir, exist_ok=True)
            plot_best_of_n(metrics, os.path.join(self.args.output_dir, BEST_OF_N_PLOT), title)

    def metric_names(self) -> list[str]:
        return (
            ["step_accuracy", "solution_accuracy", "majority_baseline"]
            if self.process_reward
            else ["accuracy", "margin"]
        )

    def metrics(self, examples: list[dict]) -> dict[str, float]:
        if not examples:
            return {}
        if not self.process_reward:
            diffs = [ex["chosen_score"] - ex["rejected_score"] for ex in examples if "chosen_score" in ex]
            if not diffs:  # best-of-N candidates only: no pair metrics rather than zeros
                return {}
            return {"accuracy": sum(d > 0 for d in diffs) / len(diffs), "margin": sum(diffs) / len(diffs)}
        steps = correct = solved = positive = labelled = 0
        for ex in examples:
            pairs = [(s, lab) for s, lab in zip(ex["step_scores"], ex["labels"]) if lab is not None]
            right = [(s > 0.5) == (lab == self.reward_tokens[0]) for s, lab in pairs]
            steps += len(right)
            correct += sum(right)
            if right:  # a solution without a labelled step is in no solution accuracy
                labelled += 1
                solved += all(right)
            positive += sum(lab == self.reward_tokens[0] for _, lab in pairs)
        if not steps:  # no labelled step (best-of-N candidates): no step metrics rather than zeros
            return {}
        return {
            "step_accuracy": correct / max(steps, 1),
            "solution_accuracy": solved / max(labelled, 1),
            "majority_baseline": max(positive, steps - positive) / max(steps, 1),
        }
