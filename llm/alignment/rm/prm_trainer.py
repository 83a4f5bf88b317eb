"""Process reward model: the logits of the two reward tokens (``reward_tokens``, e.g. ``+`` / ``-``) read from the
LM head at every step placeholder.

One item = one labelled step: the cross-entropy of the two-way softmax (``rm.loss.step_loss``), or with
``soft_labels`` the binary cross-entropy of p(+) against the step's soft label (``rm.loss.soft_step_loss``);
unlabelled steps (target -1) are scored but are no loss items. The evaluation adds ProcessBench (records with a first-error label)
and best-of-N (records with an answer and a correct flag) of ``llm.alignment.rm.evaluation``.
"""

from __future__ import annotations

import torch.nn.functional as F

from llm.alignment.lm import full_weight
from llm.alignment.rm.evaluation import first_error, step_score_metrics
from llm.alignment.rm.loss import soft_step_loss, step_loss, step_scores
from llm.alignment.rm.trainer import RewardTrainer
from llm.alignment.trainer import ItemOutputs
from llm.data.encode_reward import POSITIVE, UNLABELLED
from llm.data.packing import PackedBatch
from llm.utils.lora import head_bias


class PRMTrainer(RewardTrainer):
    """``reward_token_ids``: the tokenizer's ids of the positive and negative reward token, the LM-head rows read.

    A step's label is its readout target from encoding on (``encode_prm``: ``POSITIVE`` 0, negative 1, unlabelled
    -1): the loss and the step metrics read that index, never the reward tokens' text. The scores file shows each
    step's label as the dev record holds it (``record_metrics`` copies it, as it copies ``first_error``)."""

    causal_lm = True
    loss_items_description = "labelled steps"

    def __init__(self, *args, reward_token_ids: tuple[int, int], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.reward_token_ids = list(reward_token_ids)

    def count_items(self, batch: PackedBatch) -> int:
        return int((batch.readout_target >= 0).sum())  # unlabelled steps (target -1) are no loss items

    def forward_items(self, model, batch: PackedBatch) -> ItemOutputs:
        hidden = self.readout_hidden(model, batch)
        head = self.model.get_output_embeddings()
        # under lora_train_head peft wraps the head: its weight has the trained reward rows merged in
        weight, bias = full_weight(head.weight), full_weight(head_bias(head))
        bias = bias[self.reward_token_ids] if bias is not None else None
        # accelerate returns the forward's outputs in fp32; O2's head weight is bf16
        logits = F.linear(hidden.to(weight.dtype), weight[self.reward_token_ids], bias).float()
        if self.args.soft_labels:  # BCE on p(+) against each step's soft label (its hard label where it has none)
            loss = soft_step_loss(logits, batch.readout_target, batch.readout_value)
        else:
            loss = step_loss(logits, batch.readout_target)
        values = {"score": step_scores(logits).detach(), "logits": logits.detach()}
        return ItemOutputs(loss, values, counted=batch.readout_target >= 0)

    def example_outputs(self, batch: PackedBatch, out: ItemOutputs) -> list[dict]:
        # "_step_targets": each scored step's readout target, for the metrics (not a column of the scores file)
        examples = [{"record": rec, "step_scores": [], "_step_targets": []} for rec in batch.records.tolist()]
        for ex, score, target in zip(
            batch.readout_example.tolist(), out.values["score"].tolist(), batch.readout_target.tolist()
        ):
            examples[ex]["step_scores"].append(score)
            examples[ex]["_step_targets"].append(target)
        return examples

    def record_metrics(self, examples: list[dict], records: list) -> dict[str, float]:
        """ProcessBench over the records with a first-error label (their examples get ``predicted_first_error``),
        with ``prm_threshold_subset`` also at the threshold best on that subset; best-of-N over the records with
        an answer and a correct flag (``step_score_metrics``, which reads any step scorer's scores)."""
        args = self.args
        for ex in examples:
            rec = records[ex["record"]]
            ex["labels"] = rec.labels[: len(ex["step_scores"])]  # the scored steps' labels (a cut keeps the first)
            if getattr(rec, "first_error", None) is not None:
                ex["first_error"] = rec.first_error
                ex["predicted_first_error"] = first_error(ex["step_scores"], args.prm_threshold)
        metrics = step_score_metrics(
            [ex["step_scores"] for ex in examples],
            [records[ex["record"]] for ex in examples],
            args.prm_threshold,
            args.prm_threshold_subset,
            [a.strip() for a in args.bon_aggregations.split(",")],
            args.seed,
        )
        if "bon_groups" in metrics:
            self.plot_best_of_n(metrics, "best-of-N")
        return metrics

    def metric_names(self) -> list[str]:
        return ["step_accuracy", "solution_accuracy", "majority_baseline"]

    def metrics(self, examples: list[dict]) -> dict[str, float]:
        steps = correct = solved = positive = labelled = 0
        for ex in examples:
            pairs = [(s, t) for s, t in zip(ex["step_scores"], ex["_step_targets"]) if t != UNLABELLED]
            right = [(s > 0.5) == (t == POSITIVE) for s, t in pairs]
            steps += len(right)
            correct += sum(right)
            if right:  # a solution without a labelled step is in no solution accuracy
                labelled += 1
                solved += all(right)
            positive += sum(t == POSITIVE for _, t in pairs)
        if not steps:  # no examples, or no labelled step (best-of-N candidates): no step metrics rather than zeros
            return {}
        return {
            "step_accuracy": correct / max(steps, 1),
            "solution_accuracy": solved / max(labelled, 1),
            "majority_baseline": max(positive, steps - positive) / max(steps, 1),
        }
