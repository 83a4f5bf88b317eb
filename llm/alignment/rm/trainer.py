"""The shared base of the reward-model trainers: ``ORMTrainer`` (``orm_trainer.py``, a score head on preference
pairs) and ``PRMTrainer`` (``prm_trainer.py``, reward-token logits at step placeholders).

The two differ only in how the final hidden states at the readout positions become per-item losses and
per-example outputs, and in the metrics over the dev records; everything else is ``AlignmentTrainer``. What
they share: the last decoder layer run at the readout positions only (``readout.py``), the dev records whose
ProcessBench / best-of-N fields the evaluation reads, and the best-of-N plot.

Precision (``llm.utils.precision``): the heads get the hidden states cast to their weight's dtype (the
matmul runs in bf16/fp16 under the trainer's autocast, O1 and O2); reward logits and scores are upcast
to fp32 before the cross-entropy, softmax and log-sigmoid of ``rm.loss``.
"""

from __future__ import annotations

import functools
import os

import torch

from llm.alignment.lm import check_packed_attention, readout_hidden
from llm.alignment.rm import readout
from llm.alignment.rm.evaluation import plot_best_of_n
from llm.alignment.trainer import AlignmentTrainer
from llm.data.packing import PackedBatch

BEST_OF_N_PLOT = "eval_best_of_n.png"  # next to eval_results.json


class RewardTrainer(AlignmentTrainer):
    """``args``: ``RewardTrainingArguments``. ``eval_records``: the dev split's records (``PackedData.records``),
    whose ProcessBench / best-of-N fields ``record_metrics`` reads; None: no such metrics."""

    # The last decoder layer runs at the readout positions only (llm/alignment/rm/readout.py); same numbers.
    last_layer_at_readouts = True
    causal_lm = False  # the model: a causal LM (the PRM's reward-token logits) or a sequence classifier (ORM)

    def __init__(self, *args, eval_records: list | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        check_packed_attention(self.model, type(self).__name__)
        self.eval_records = eval_records or []
        self.readouts_only = self.last_layer_at_readouts and readout.install(self.model)

    def readout_hidden(self, model: torch.nn.Module, batch: PackedBatch) -> torch.Tensor:
        """Final hidden states ``(N, H)`` at the batch's readouts (the last layer run at those positions only)."""
        call = functools.partial(model, readout_index=batch.readout_index) if self.readouts_only else model
        return readout_hidden(call, batch, causal_lm=self.causal_lm)

    def eval_metrics(self, examples: list[dict]) -> dict[str, float]:
        """The pair / step metrics, and those over the eval records that carry their fields (``record_metrics``)."""
        metrics = self.metrics(examples)
        if not self.eval_records:
            return metrics
        return {**metrics, **self.record_metrics(examples, self.eval_records)}

    def record_metrics(self, examples: list[dict], records: list) -> dict[str, float]:
        """Metrics over the eval records with ProcessBench / best-of-N fields; may add fields to ``examples``."""
        raise NotImplementedError

    def plot_best_of_n(self, metrics: dict[str, float], title: str) -> None:
        if self.is_world_process_zero():
            os.makedirs(self.args.output_dir, exist_ok=True)
            plot_best_of_n(metrics, os.path.join(self.args.output_dir, BEST_OF_N_PLOT), title)
