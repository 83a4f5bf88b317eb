"""Generative process reward model (``prm_kind: generative``): a causal LM trained to write, after every step of a
solution, a critique and then a verdict token (``reward_tokens``), on the layout of ``llm.data.encode_genprm``.

One item = one critique or verdict token (the readouts; the problem and the steps carry no loss): its loss is
``w * -log p(token)``, ``w`` = ``critique_loss_weight`` for a critique token and ``verdict_loss_weight`` for a
verdict, and the trainer divides the sum by the global count of items of positive weight (``genprm_loss``). The
forward also reads each verdict position as the discriminative PRM reads its placeholder (p(+) = softmax over the
two reward tokens' logits): the teacher-forced ``verdict_accuracy`` (given the data's critique). The evaluation
then judges every dev record as the PRM is used (``llm.alignment.rm.generative``: the model writes the critiques,
then the verdicts): ``judged_step_accuracy``, ProcessBench and best-of-N from those scores, and each record's
``step_scores`` with the ``critiques`` written in ``eval_scores.jsonl``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from llm.alignment.lm import full_weight, readout_log_probs
from llm.alignment.rm.evaluation import first_error, step_score_metrics
from llm.alignment.rm.generative import CritiqueSettings, GenerativePRM
from llm.alignment.rm.loss import step_scores
from llm.alignment.rm.trainer import RewardTrainer
from llm.alignment.trainer import ItemOutputs
from llm.data.encode_genprm import VERDICT
from llm.data.encoding import render_prompt, start_ids
from llm.data.packing import PackedBatch
from llm.utils.lora import head_bias


def genprm_loss(token_log_probs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Per-item loss ``w * -log p(token)``: ``(N,)``, ``(N,)`` -> ``(N,)``."""
    return -weights * token_log_probs


def item_weights(parts: torch.Tensor, critique_weight: float, verdict_weight: float) -> torch.Tensor:
    """The loss weight of each readout: ``verdict_weight`` at verdicts, ``critique_weight`` at critique tokens."""
    verdict = torch.full(parts.shape, verdict_weight, dtype=torch.float32, device=parts.device)
    return torch.where(parts == VERDICT, verdict, critique_weight)


class GenPRMTrainer(RewardTrainer):
    """``reward_token_ids``: the tokenizer's ids of the positive and negative verdict tokens; ``reward_tokens``: their
    text, as the records' labels write them."""

    causal_lm = True
    loss_items_description = "critique or verdict tokens of positive loss weight"

    def __init__(
        self, *args, reward_token_ids: tuple[int, int], reward_tokens: tuple[str, str] = ("+", "-"), **kwargs
    ) -> None:
        super().__init__(*args, **kwargs)
        self.reward_token_ids, self.reward_tokens = list(reward_token_ids), tuple(reward_tokens)

    def weights(self, batch: PackedBatch) -> torch.Tensor:
        return item_weights(batch.readout_part, self.args.critique_loss_weight, self.args.verdict_loss_weight)

    def count_items(self, batch: PackedBatch) -> int:
        return int((self.weights(batch) > 0).sum())

    def forward_items(self, model, batch: PackedBatch) -> ItemOutputs:
        hidden = self.readout_hidden(model, batch)
        head = self.model.get_output_embeddings()
        weight, bias = full_weight(head.weight), full_weight(head_bias(head))
        logps, hits = readout_log_probs(hidden, batch.readout_target, weight, bias)
        w = self.weights(batch)
        verdict = batch.readout_part == VERDICT
        pair_bias = bias[self.reward_token_ids] if bias is not None else None
        pair = F.linear(hidden[verdict].to(weight.dtype), weight[self.reward_token_ids], pair_bias).float()
        values = {"nll": -logps.detach(), "hits": hits, "verdict_score": step_scores(pair).detach()}
        return ItemOutputs(genprm_loss(logps, w.to(logps.dtype)), values, counted=w > 0)

    def example_outputs(self, batch: PackedBatch, out: ItemOutputs) -> list[dict]:
        # "_"-fields: for the metrics, not columns of the scores file
        examples = [
            {"record": r, "forced_step_scores": [], "_targets": [], "_nll": 0.0, "_tokens": 0}
            for r in batch.records.tolist()
        ]
        verdict = (batch.readout_part == VERDICT).tolist()
        owners, nll = batch.readout_example.tolist(), out.values["nll"].tolist()
        targets = batch.readout_target.tolist()
        scores = iter(out.values["verdict_score"].tolist())
        for ex, is_verdict, value, target in zip(owners, verdict, nll, targets):
            if is_verdict:
                examples[ex]["forced_step_scores"].append(next(scores))
                examples[ex]["_targets"].append(int(target == self.reward_token_ids[0]))
            else:
                examples[ex]["_nll"] += value
                examples[ex]["_tokens"] += 1
        return examples

    def metric_names(self) -> list[str]:
        return ["verdict_accuracy", "critique_ppl", "judged_step_accuracy"]

    def metrics(self, examples: list[dict]) -> dict[str, float]:
        """Teacher-forced: the verdicts read after the data's critiques, the critique tokens' perplexity."""
        pairs = [
            (s, t) for ex in examples if "_targets" in ex for s, t in zip(ex["forced_step_scores"], ex["_targets"])
        ]
        tokens = sum(ex.get("_tokens", 0) for ex in examples)
        out = {}
        if pairs:
            out["verdict_accuracy"] = sum((s > 0.5) == bool(t) for s, t in pairs) / len(pairs)
        if tokens:
            mean = sum(ex.get("_nll", 0.0) for ex in examples) / tokens
            out["critique_ppl"] = math.exp(mean) if mean < 709.0 else math.inf
        return out

    def judge(self, records: list) -> list:
        """Every record judged by generation (the model writes the critiques), in eval mode."""
        args, tok = self.args, self.processing_class
        chat = self.run.use_chat_template if self.run is not None else False
        prompts = [render_prompt(r.prompt, tok, chat) if r.prompt else start_ids(tok) for r in records]
        settings = CritiqueSettings(
            args.critique_samples,
            args.max_critique_tokens,
            args.critique_temperature,
            args.seed,
            args.per_device_eval_batch_size,
        )
        scorer = GenerativePRM(self.model, tok, tuple(self.reward_token_ids), settings)
        was_training = self.model.training
        self.model.eval()
        try:
            return scorer.judge(prompts, [list(r.steps) for r in records])
        finally:
            self.model.train(was_training)

    def record_metrics(self, examples: list[dict], records: list) -> dict[str, float]:
        """Every dev record judged by generation: its ``step_scores`` and ``critiques`` (a list per pass with
        ``critique_samples`` > 1) join its example (a record without critiques gets one), then the judged step
        accuracy, ProcessBench and best-of-N over those scores (``step_score_metrics``)."""
        args = self.args
        judged = self.judge(records)
        have = {ex["record"] for ex in examples}
        examples += [{"record": i} for i in range(len(records)) if i not in have]
        examples.sort(key=lambda ex: ex["record"])
        right = steps = 0
        for ex in examples:
            rec, j = records[ex["record"]], judged[ex["record"]]
            if not ex.get("forced_step_scores"):  # a record without critiques: no teacher-forced verdicts
                ex.pop("forced_step_scores", None)
            ex["step_scores"] = j.scores
            ex["critiques"] = j.critiques[0] if len(j.critiques) == 1 else j.critiques
            ex["labels"] = rec.labels
            for score, label in zip(j.scores, rec.labels):
                if label is not None:
                    steps += 1
                    right += (score > 0.5) == (label == self.reward_tokens[0])
            if getattr(rec, "first_error", None) is not None:
                ex["first_error"] = rec.first_error
                ex["predicted_first_error"] = first_error(j.scores, args.prm_threshold)
        metrics = step_score_metrics(
            [j.scores for j in judged],
            records,
            args.prm_threshold,
            args.prm_threshold_subset,
            [a.strip() for a in args.bon_aggregations.split(",")],
            args.seed,
        )
        if steps:
            metrics["judged_step_accuracy"] = right / steps
        if "bon_groups" in metrics:
            self.plot_best_of_n(metrics, "best-of-N (generative PRM)")
        return metrics
