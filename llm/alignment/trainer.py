"""Shared base of our trainers: ``transformers.Trainer`` fed typed ``PackedBatch``es (the loss / eval core).

What it adds to ``Trainer``:
- losses are summed per item (pair, step, token) and divided by the *global* item count of the
  optimizer step (all micro-batches, all ranks), so accumulation 4 x 1 == batch 4 == 2 ranks x 2;
- throughput logging in real (non-pad) tokens, and the pad ratio;
- ``evaluate`` computes metrics over per-example outputs gathered from all ranks and can return
  those per-example scores;
- the parallel layout of ``llm.utils.distributed`` (FSDP2 / tensor parallel models placed by
  transformers), and checkpoints that resume under any layout (``llm.alignment.checkpointing``);
- mixed precision (``llm.utils.precision``): every ``forward_items`` (training, evaluation, DPO's
  reference and precomputed log-probs) runs under the same bf16/fp16 autocast, and AdamW keeps fp32
  master weights of O2's half-precision weights (``MasterWeightAdamW``).
Subclasses implement ``forward_items``, ``count_items``, ``example_outputs`` and ``metrics``, and read their
hyper-parameters from ``self.args`` (the run's training arguments) and ``self.model_args``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
from accelerate.optimizer import AcceleratedOptimizer
from transformers import Trainer

from llm.alignment.checkpointing import CheckpointMixin
from llm.alignment.context import RunContext
from llm.data.packing import PackedBatch
from llm.settings.flat import ModelArgument
from llm.utils.distributed import tensor_parallel_on_cpu
from llm.utils.errors import UserError
from llm.utils.param_groups import own_learning_rate
from llm.utils.precision import LossScaler, MasterWeightAdamW
from llm.utils.preemption import SaveOnSignal

logger = logging.getLogger(__name__)


@dataclass
class ItemOutputs:
    """Per-item results of one batch: ``loss`` ``(I,)`` plus named per-item tensors for metrics."""

    loss: torch.Tensor
    values: dict[str, torch.Tensor]
    counted: torch.Tensor | None = None  # which items count in the loss's denominator (None: all)


EVAL_TIMED_BATCHES = 3  # batches timed before an evaluation without an earlier measurement logs its estimate
TRAIN_INTERVALS_KEPT = 50  # training micro-batch intervals kept for the speed estimate (median: pauses drop out)
FORWARD_SHARE = 1 / 3  # a forward's share of a forward + backward (the backward costs about two forwards)


def duration_text(seconds: float) -> str:
    """``<1 s``, ``45 s``, ``12 min``, ``1.5 h``: an estimate, in the unit it reads best in."""
    if seconds < 0.5:
        return "<1 s"
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def eval_plan_text(batches: int, seconds_per_batch: float | None, source: str = "") -> str:
    """The line logged before an evaluation: ``evaluation: 150 batches, ~2 min at 0.8 s/batch (source)``."""
    text = f"evaluation: {batches} batch{'es' if batches != 1 else ''}"
    if seconds_per_batch is None:
        return text
    total = duration_text(batches * seconds_per_batch)
    text += f", {'' if total.startswith('<') else '~'}{total} at {seconds_per_batch:.3g} s/batch"
    return f"{text} ({source})" if source else text


def gather_objects(obj: list) -> list:
    """Every rank's ``obj`` items, concatenated in rank order (``obj`` itself with one process)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return obj
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, obj)
    return [x for part in parts for x in part]


class AlignmentTrainer(CheckpointMixin, Trainer):
    """``Trainer`` keywords, plus ``model_args``: the run's model arguments (``lora_merge``), and ``run``: the run's
    ``RunContext`` (``llm.alignment.context``: the fingerprint its checkpoints hold); None for a trainer built
    without them (tests), which reads their defaults and fingerprints its training arguments alone."""

    def __init__(self, *args, model_args: ModelArgument | None = None, run: RunContext | None = None, **kwargs) -> None:
        training_args = kwargs["args"]
        self.model_args, self.run = model_args, run
        self.layout = training_args.layout
        # Optimizer state, scheduler and RNG go into the sharded checkpoint written by CheckpointMixin._save_checkpoint,
        # for every layout (transformers, told save_only_model, saves none: TrainingArguments.__post_init__).
        self._save_training_state = training_args.save_training_state
        super().__init__(*args, **kwargs)
        logger.info("parallel layout: %s", self.layout.describe())
        # Our compute_loss already divides by the global item count of the whole optimizer step.
        self.loss_is_scaled_for_ga = True
        self._sums: dict[str, float] = defaultdict(float)
        self._last_log_time = time.perf_counter()
        self._n_params = sum(p.numel() for p in self.model.parameters())
        # for the evaluation time estimate: seconds between training micro-batches, an evaluation's s/batch
        self._train_intervals: list[float] = []
        self._last_train_batch: float | None = None
        self._eval_seconds_per_batch: float | None = None

    @property
    def stopped_by_signal(self) -> bool:
        return any(isinstance(cb, SaveOnSignal) and cb.received for cb in self.callback_handler.callbacks)

    def train(self, *args, **kwargs):
        self.check_metric_for_best_model()
        resume = kwargs.get("resume_from_checkpoint", args[0] if args else None)
        finished = self.resume_of_a_finished_run(resume if isinstance(resume, str) else None)
        if finished is not None:  # (llm.alignment.checkpointing)
            return finished
        return super().train(*args, **kwargs)

    def check_metric_for_best_model(self) -> None:
        """``metric_for_best_model`` must be a metric this trainer reports (checked before training, not after
        the first evaluation); ``eval_`` is optional, as in transformers."""
        name = self.args.metric_for_best_model
        if name is None:
            return
        valid = ["loss", *self.metric_names()]
        if name.removeprefix("eval_") not in valid:
            raise UserError(
                f"metric_for_best_model={name!r} is not a metric of {type(self).__name__}; it reports "
                f"{', '.join(valid)} (each also as eval_<name>)"
            )
        if name.removeprefix("eval_") == "loss" and self.eval_has_loss_items() is False:
            raise UserError(
                f"metric_for_best_model={name!r} (transformers' default with load_best_model_at_end or "
                f"lr_scheduler_type reduce_lr_on_plateau) needs eval_loss, but the eval data has no loss item (no "
                f"{self.loss_items_description}), so no evaluation reports eval_loss. Fix: drop load_best_model_at_end "
                "(and save_strategy best / lr_scheduler_type reduce_lr_on_plateau), or add "
                f"{self.loss_items_description} to the eval data"
            )

    loss_items_description = "records with a loss"  # the loss items in the trainer's terms, for messages

    def eval_has_loss_items(self) -> bool | None:
        """Whether the eval data holds at least one loss item (``count_items``), told from its packed rows without
        a forward; None when there is no eval data or it cannot be told without reading it (streamed, several)."""
        rows = self.eval_dataset
        if not isinstance(rows, list) or not rows:
            return None
        return any(self.count_items(self.data_collator(rows[i : i + 64])) for i in range(0, len(rows), 64))

    def _determine_best_metric(self, metrics: dict[str, float], trial) -> bool:
        # transformers raises a KeyError (a traceback) when an evaluation lacks the metric, e.g. eval_loss of eval
        # data without loss items that check_metric_for_best_model could not see before training (streamed)
        name = self.args.metric_for_best_model
        if name is not None and (name if name.startswith("eval_") else f"eval_{name}") not in metrics:
            reported = ", ".join(k for k in metrics if k not in ("eval_runtime", "epoch")) or "none"
            raise UserError(
                f"metric_for_best_model={name!r}: this evaluation did not report it (it reported: {reported}); "
                "eval_loss needs eval data with a loss item, the other metrics the records they are computed "
                "over. Fix: choose a metric that the eval data gives, or drop load_best_model_at_end"
            )
        return super()._determine_best_metric(metrics, trial)

    # --- to implement -------------------------------------------------------------------------
    def metric_names(self) -> list[str]:
        """Names of the metrics ``metrics`` returns (for validating ``metric_for_best_model``)."""
        raise NotImplementedError

    def forward_items(self, model: torch.nn.Module, batch: PackedBatch) -> ItemOutputs:
        raise NotImplementedError

    def count_items(self, batch: PackedBatch) -> int:
        raise NotImplementedError

    def example_outputs(self, batch: PackedBatch, out: ItemOutputs) -> list[dict]:
        """One dict per example (must hold 'record'), used for metrics and the scores file."""
        raise NotImplementedError

    def metrics(self, examples: list[dict]) -> dict[str, float]:
        raise NotImplementedError

    def eval_metrics(self, examples: list[dict]) -> dict[str, float]:
        """Metrics of an evaluation over the whole eval set (all ranks' examples, each record once); may add
        per-example fields for the scores file. Default: ``metrics``."""
        return self.metrics(examples)

    def item_examples(self, batch: PackedBatch, num_items: int) -> torch.Tensor:
        """Example index of each loss item: items are either whole examples (pairs) or readouts (steps, tokens)."""
        if num_items == batch.readout_index.numel():
            return batch.readout_example
        if num_items == batch.num_examples:
            return torch.arange(num_items, device=batch.records.device)
        raise NotImplementedError(f"{type(self).__name__}: map its {num_items} loss items to examples")

    # --- Trainer hooks ------------------------------------------------------------------------
    def create_accelerator_and_postprocess(self) -> None:
        with tensor_parallel_on_cpu(self.layout):
            super().create_accelerator_and_postprocess()
        self.loss_scaler: LossScaler | None = None
        if self.args.fp16:
            # Our fp16 loss scaling (llm.utils.precision) in place of accelerate's GradScaler, which needs CUDA and
            # refuses O2's fp16 gradients; the fp16 autocast on every device (accelerate turns it off on a CPU).
            self.loss_scaler = LossScaler()
            self.accelerator.scaler = self.loss_scaler
            self.accelerator.native_amp = True

    def head_parameters(self) -> list[torch.nn.Parameter]:
        """The trained parameters of a new head that trains at ``args.head_learning_rate`` (ORM); none here."""
        return []

    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model)
        head_lr = getattr(self.args, "head_learning_rate", None)
        if head_lr is not None:
            moved = own_learning_rate(self._raw_optimizer(), self.head_parameters(), head_lr)
            logger.info(
                "head_learning_rate: %d head tensors (%d parameters) at peak lr %g, the rest at %g",
                len(moved),
                sum(p.numel() for p in moved),
                head_lr,
                self.args.learning_rate,
            )
        if self.loss_scaler is not None:
            self.loss_scaler.bind(self._raw_optimizer())
        return optimizer

    def _clip_grad_norm(self, model):
        if self.loss_scaler is None:
            return super()._clip_grad_norm(model)
        return self.loss_scaler.unscale_and_clip(self._raw_optimizer(), self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        if self.loss_scaler is None:
            return super()._get_grad_norm(model, grad_norm)
        return self.loss_scaler.unscale_and_clip(self._raw_optimizer(), 0.0) if grad_norm is None else grad_norm

    def compute_loss_context_manager(self) -> contextlib.ExitStack:
        # accelerate autocasts only the forward of the model it prepared, and only once training starts:
        # evaluation-only runs, DPO's reference model and the heads applied after the forward would run
        # without it. This is the same autocast (bf16/fp16 with mixed precision, none in fp32) around them all.
        stack = super().compute_loss_context_manager()
        stack.enter_context(self.accelerator.autocast())
        return stack

    @staticmethod
    def get_optimizer_cls_and_kwargs(args, model=None):
        optimizer_cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
        if optimizer_cls is torch.optim.AdamW:
            # fp32 master weights for O2's bf16/fp16 weights; the same AdamW for fp32 ones
            optimizer_cls = MasterWeightAdamW
        elif args.fp16_opt_level == "O2":
            logger.warning(
                "fp16_opt_level O2 with optim=%s: it steps on the half-precision weights themselves "
                "(fp32 master weights need AdamW: adamw_torch or adamw_torch_fused)",
                args.optim,
            )
        return optimizer_cls, kwargs

    def _prepare_inputs(self, inputs: PackedBatch) -> PackedBatch:
        return inputs.to(self.args.device)

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device) -> torch.Tensor:
        count = torch.tensor(float(sum(self.count_items(b) for b in batch_samples)), device=device)
        if dist.is_available() and dist.is_initialized() and self.args.world_size > 1:
            dist.all_reduce(count)
        return count

    def floating_point_ops(self, inputs: PackedBatch) -> int:
        return 6 * self._n_params * inputs.num_real_tokens

    def compute_loss(self, model, inputs: PackedBatch, return_outputs=False, num_items_in_batch=None):
        out = self.forward_items(model, inputs)
        if num_items_in_batch is None:  # outside the training loop: plain mean of this batch
            n = out.loss.numel() if out.counted is None else int(out.counted.sum())
            loss = out.loss.sum() / max(n, 1)
        else:
            # DDP averages gradients over ranks; scale back so the result is sum / global count.
            loss = out.loss.sum() / num_items_in_batch * self.args.world_size
        if model.training:
            self._accumulate_train_metrics(inputs, out)
        return (loss, out) if return_outputs else loss

    def _accumulate_train_metrics(self, batch: PackedBatch, out: ItemOutputs) -> None:
        now = time.perf_counter()
        if self._last_train_batch is not None:
            kept = self._train_intervals[-(TRAIN_INTERVALS_KEPT - 1) :]
            self._train_intervals = [*kept, now - self._last_train_batch]
        self._last_train_batch = now
        with torch.no_grad():
            for key, value in self.metrics(self.example_outputs(batch, out)).items():
                self._sums[f"{key}__sum"] += value
            self._sums["batches"] += 1
            self._sums["real_tokens"] += batch.num_real_tokens
            self._sums["slots"] += batch.input_ids.numel()

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs and self._sums["batches"]:
            sums = self._reduce_sums()
            now = time.perf_counter()
            for key, value in sums.items():
                if key.endswith("__sum"):
                    logs[key[: -len("__sum")]] = value / sums["batches"]
            logs["tokens_per_second"] = sums["real_tokens"] / max(now - self._last_log_time, 1e-9)
            logs["pad_ratio"] = 1.0 - sums["real_tokens"] / max(sums["slots"], 1)
            self._sums.clear()
            self._last_log_time = now
        super().log(logs, start_time)

    def _reduce_sums(self) -> dict[str, float]:
        keys = sorted(self._sums)
        values = torch.tensor([self._sums[k] for k in keys], dtype=torch.float64)
        if dist.is_available() and dist.is_initialized() and self.args.world_size > 1:
            dist.all_reduce(values)
            values /= self.layout.tp  # the ranks of a tensor-parallel group see the same batch
        return dict(zip(keys, values.tolist()))

    def _raw_optimizer(self) -> torch.optim.Optimizer:
        opt = self.optimizer
        return opt.optimizer if isinstance(opt, AcceleratedOptimizer) else opt

    # --- evaluation ---------------------------------------------------------------------------
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        metrics, _ = self.evaluate_with_outputs(eval_dataset, metric_key_prefix)
        return metrics

    def eval_speed_estimate(self) -> tuple[float | None, str]:
        """Seconds per eval batch before an evaluation starts, and where the number comes from: this run's
        last evaluation, else the training speed (the median interval between training micro-batches, scaled
        by the eval / train batch sizes and by a forward's share of a forward + backward), else none yet."""
        if self._eval_seconds_per_batch is not None:
            return self._eval_seconds_per_batch, "measured in the last evaluation"
        if len(self._train_intervals) < 3:
            return None, ""
        intervals = sorted(self._train_intervals)
        per_row = intervals[len(intervals) // 2] / self.args.per_device_train_batch_size
        return per_row * self.args.per_device_eval_batch_size * FORWARD_SHARE, "estimated from the training speed"

    def evaluate_with_outputs(self, eval_dataset=None, metric_key_prefix: str = "eval"):
        """Metrics over the whole eval set (gathered from all ranks) and the per-example outputs. Before it starts,
        the log says how many batches it runs and, from an earlier measurement, about how long that takes; with
        none, the estimate follows once the first batches are timed."""
        start = time.perf_counter()
        dataloader = self.get_eval_dataloader(eval_dataset)
        try:
            batches: int | None = len(dataloader)
        except TypeError:  # a stream: no length
            batches = None
        speed, source = self.eval_speed_estimate()
        if batches is not None:
            logger.info(eval_plan_text(batches, speed, source))
        model = self.model
        was_training = model.training
        model.eval()
        examples = []
        done = 0
        with torch.no_grad():
            for batch in dataloader:
                if speed is None and batches is not None and done == EVAL_TIMED_BATCHES < batches:
                    measured = (time.perf_counter() - start) / done
                    logger.info(eval_plan_text(batches, measured, f"timed on the first {done} batches"))
                done += 1
                batch = self._prepare_inputs(batch)
                with self.compute_loss_context_manager():
                    out = self.forward_items(model, batch)
                # Each example carries its own loss sum and item count, so examples repeated across
                # ranks (DistributedSampler evens out the shards) are counted once below.
                owner = self.item_examples(batch, out.loss.numel())
                sums = torch.zeros(batch.num_examples, dtype=torch.float64, device=out.loss.device)
                sums.index_add_(0, owner, out.loss.double())
                counted = owner if out.counted is None else owner[out.counted]
                counts = torch.bincount(counted, minlength=batch.num_examples)
                for ex, loss_sum, n in zip(self.example_outputs(batch, out), sums.tolist(), counts.tolist()):
                    examples.append({**ex, "_loss": loss_sum, "_items": n})
        model.train(was_training)
        if done:
            self._eval_seconds_per_batch = (time.perf_counter() - start) / done
        self._last_train_batch = None  # the next training interval would include this evaluation
        unique = {ex["record"]: ex for ex in gather_objects(examples)}
        examples = [unique[k] for k in sorted(unique)]
        loss_sum = sum(ex.pop("_loss") for ex in examples)
        items = sum(ex.pop("_items") for ex in examples)
        # No loss item (e.g. a reward model's dev data of best-of-N candidates only): no eval_loss at all, not a
        # 0 that reads as a perfect loss (see check_metric_for_best_model for the best model by loss).
        metrics = {"loss": loss_sum / items} if items else {}
        metrics.update(self.eval_metrics(examples))
        metrics["runtime"] = time.perf_counter() - start
        metrics = {f"{metric_key_prefix}_{k}": v for k, v in metrics.items()}
        if items and not math.isfinite(loss_sum):
            metrics[f"{metric_key_prefix}_loss"] = float("nan")
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics, examples
