"""Process reward model: the logits of the two reward tokens (``reward_tokens``, e.g. ``+`` / ``-``) read from the
LM head at every step placeholder.

One item = one labelled step: the cross-entropy of the two-way softmax (``rm.loss.step_loss``); unlabelled steps
(target -1) are scored but are no loss items. The evaluation adds ProcessBench (records with a first-error label)
and best-of-N (records with an answer and a correct flag) of ``llm.alignment.rm.evaluation``.
"""

from __future__ import annotations

import torch.nn.functional as F

from llm.alignment.lm import full_weight
from llm.alignment.rm.data import reward_tokens
from llm.alignment.rm.evaluation import first_error, step_score_metrics
from llm.alignment.rm.loss import step_loss, step_scores
from llm.alignment.rm.trainer import RewardTrainer
from llm.alignment.trainer import ItemOutputs
from llm.data.packing import PackedBatch
from llm.settings.reward import RewardModelArgument
from llm.utils.lora import head_bias


class PRMTrainer(RewardTrainer):
    """``reward_token_ids``: the tokenizer's ids of the positive and negative reward token, the LM-head rows read.
    The tokens' text (how a step's label is written in the scores file) comes from ``model_args.reward_tokens``."""

    causal_lm = True
    loss_items_description = "labelled steps"

    def __init__(self, *args, reward_token_ids: tuple[int, int], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.reward_token_ids = list(reward_token_ids)
        self.reward_tokens = reward_tokens(self.model_args or RewardModelArgument())  # positive, negative

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
        loss = step_loss(logits, batch.readout_target)
        values = {"score": step_scores(logits).detach(), "logits": logits.detach()}
        return ItemOutputs(loss, values, counted=batch.readout_target >= 0)

    def example_outputs(self, batch: PackedBatch, out: ItemOutputs) -> list[dict]:
        examples = [{"record": rec, "step_scores": [], "labels": []} for rec in batch.records.tolist()]
        for ex, score, label in zip(
            batch.readout_example.tolist(), out.values["score"].tolist(), batch.readout_target.tolist()
        ):
            examples[ex]["step_scores"].append(score)
            examples[ex]["labels"].append(self.reward_tokens[label] if label >= 0 else None)
        return examples

    def record_metrics(self, examples: list[dict], records: list) -> dict[str, float]:
        """ProcessBench over the records with a first-error label (their examples get ``predicted_first_error``),
        with ``prm_threshold_subset`` also at the threshold best on that subset; best-of-N over the records with
        an answer and a correct flag (``step_score_metrics``, which reads any step scorer's scores)."""
        args = self.args
        for ex in examples:
            rec = records[ex["record"]]
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
        positive_token = self.reward_tokens[0]
        steps = correct = solved = positive = labelled = 0
        for ex in examples:
            pairs = [(s, lab) for s, lab in zip(ex["step_scores"], ex["labels"]) if lab is not None]
            right = [(s > 0.5) == (lab == positive_token) for s, lab in pairs]
            steps += len(right)
            correct += sum(right)
            if right:  # a solution without a labelled step is in no solution accuracy
                labelled += 1
                solved += all(right)
            positive += sum(lab == positive_token for _, lab in pairs)
        if not steps:  # no examples, or no labelled step (best-of-N candidates): no step metrics rather than zeros
            return {}
        return {
            "step_accuracy": correct / max(steps, 1),
            "solution_accuracy": solved / max(labelled, 1),
            "majority_baseline": max(positive, steps - positive) / max(steps, 1),
        }
