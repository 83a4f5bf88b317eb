"""Shared base of our trainers: ``transformers.Trainer`` fed typed ``PackedBatch``es.

What it adds to ``Trainer``:
- losses are summed per item (pair, step, token) and divided by the *global* item count of the
  optimizer step (all micro-batches, all ranks), so accumulation 4 x 1 == batch 4 == 2 ranks x 2;
- throughput logging in real (non-pad) tokens, and the pad ratio;
- ``evaluate`` computes metrics over per-example outputs gathered from all ranks and can return
  those per-example scores;
- the parallel layout of ``llm.utils.distributed`` (FSDP2 / tensor parallel models placed by
  transformers) and a checkpoint that resumes under any layout: model and optimizer state in
  torch.distributed.checkpoint files (``checkpoint-N/sharded_state``), plus, with
  ``unified_checkpoint``, the model as one Hugging Face safetensors file;
- mixed precision (``llm.utils.precision``): every ``forward_items`` (training, evaluation, DPO's
  reference and precomputed log-probs) runs under the same bf16/fp16 autocast, and AdamW keeps fp32
  master weights of O2's half-precision weights (``MasterWeightAdamW``).
Subclasses implement ``forward_items``, ``count_items``, ``example_outputs`` and ``metrics``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
from accelerate.optimizer import AcceleratedOptimizer
from transformers import Trainer
from transformers.trainer import SCHEDULER_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from llm.data.packing import PackedBatch
from llm.utils.distributed import (
    SHARDED_STATE_DIR,
    load_sharded_state,
    save_sharded_state,
    tensor_parallel_on_cpu,
)
from llm.utils.errors import UserError
from llm.utils.precision import LossScaler, MasterWeightAdamW
from llm.utils.preemption import SaveOnSignal

logger = logging.getLogger(__name__)


@dataclass
class ItemOutputs:
    """Per-item results of one batch: ``loss`` ``(I,)`` plus named per-item tensors for metrics."""

    loss: torch.Tensor
    values: dict[str, torch.Tensor]


def _gather_objects(obj: list) -> list:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return obj
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, obj)
    return [x for part in parts for x in part]


class AlignmentTrainer(Trainer):
    def __init__(self, *args, **kwargs) -> None:
        training_args = kwargs["args"]
        self.layout = training_args.layout
        # Optimizer state, scheduler and RNG go into the sharded checkpoint written by _save_checkpoint
        # below, for every layout; transformers only saves the model (it refuses to checkpoint the
        # optimizer of a model placed by DistributedConfig at all).
        self._save_training_state = not training_args.save_only_model
        training_args.save_only_model = True
        super().__init__(*args, **kwargs)
        logger.info("parallel layout: %s", self.layout.describe())
        # Our compute_loss already divides by the global item count of the whole optimizer step.
        self.loss_is_scaled_for_ga = True
        self._sums: dict[str, float] = defaultdict(float)
        self._last_log_time = time.perf_counter()
        self._n_params = sum(p.numel() for p in self.model.parameters())

    @property
    def stopped_by_signal(self) -> bool:
        return any(isinstance(cb, SaveOnSignal) and cb.received for cb in self.callback_handler.callbacks)

    def train(self, *args, **kwargs):
        self.check_metric_for_best_model()
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

    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model)
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
            loss = out.loss.sum() / max(out.loss.numel(), 1)
        else:
            # DDP averages gradients over ranks; scale back so the result is sum / global count.
            loss = out.loss.sum() / num_items_in_batch * self.args.world_size
        if model.training:
            self._accumulate_train_metrics(inputs, out)
        return (loss, out) if return_outputs else loss

    def _accumulate_train_metrics(self, batch: PackedBatch, out: ItemOutputs) -> None:
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

    # --- checkpoints ----------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        # Inside checkpoints the Hugging Face copy of the model is optional (unified_checkpoint); the final
        # save_model(output_dir) always writes it. Resuming reads the sharded state either way.
        if _internal_call and not self.args.unified_checkpoint:
            return
        super().save_model(output_dir, _internal_call)

    def _raw_optimizer(self) -> torch.optim.Optimizer:
        opt = self.optimizer
        return opt.optimizer if isinstance(opt, AcceleratedOptimizer) else opt

    def _save_checkpoint(self, model, trial) -> None:
        # The training state first, the model and trainer_state.json last: a checkpoint directory that
        # holds trainer_state.json is complete.
        if self._save_training_state:
            output_dir = os.path.join(
                self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            )
            save_sharded_state(os.path.join(output_dir, SHARDED_STATE_DIR), self.model, self._raw_optimizer())
            if self.args.should_save:
                torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))
            self._save_rng_state(output_dir)
        super()._save_checkpoint(model, trial)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        sharded = os.path.join(resume_from_checkpoint, SHARDED_STATE_DIR)
        if not os.path.isdir(sharded):  # a checkpoint written by plain transformers
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        load_sharded_state(sharded, self.model, None)

    def _load_best_model(self) -> None:
        sharded = os.path.join(self.state.best_model_checkpoint, SHARDED_STATE_DIR)
        if not os.path.isdir(sharded):
            return super()._load_best_model()
        logger.info("loading the best model from %s (%s)", sharded, self.state.best_metric)
        load_sharded_state(sharded, self.model, None)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None or not os.path.isdir(os.path.join(checkpoint, SHARDED_STATE_DIR)):
            return super()._load_optimizer_and_scheduler(checkpoint)
        load_sharded_state(os.path.join(checkpoint, SHARDED_STATE_DIR), self.model, self._raw_optimizer())
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))

    # --- evaluation ---------------------------------------------------------------------------
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        metrics, _ = self.evaluate_with_outputs(eval_dataset, metric_key_prefix)
        return metrics

    def evaluate_with_outputs(self, eval_dataset=None, metric_key_prefix: str = "eval"):
        """Metrics over the whole eval set (gathered from all ranks) and the per-example outputs."""
        start = time.perf_counter()
        dataloader = self.get_eval_dataloader(eval_dataset)
        model = self.model
        was_training = model.training
        model.eval()
        examples = []
        with torch.no_grad():
            for batch in dataloader:
                batch = self._prepare_inputs(batch)
                with self.compute_loss_context_manager():
                    out = self.forward_items(model, batch)
                # Each example carries its own loss sum and item count, so examples repeated across
                # ranks (DistributedSampler evens out the shards) are counted once below.
                owner = self.item_examples(batch, out.loss.numel())
                sums = torch.zeros(batch.num_examples, dtype=torch.float64, device=out.loss.device)
                sums.index_add_(0, owner, out.loss.double())
                counts = torch.bincount(owner, minlength=batch.num_examples)
                for ex, loss_sum, n in zip(self.example_outputs(batch, out), sums.tolist(), counts.tolist()):
                    examples.append({**ex, "_loss": loss_sum, "_items": n})
        model.train(was_training)
        unique = {ex["record"]: ex for ex in _gather_objects(examples)}
        examples = [unique[k] for k in sorted(unique)]
        loss = sum(ex.pop("_loss") for ex in examples) / max(sum(ex.pop("_items") for ex in examples), 1)
        metrics = {"loss": loss, **self.metrics(examples)}
        metrics["runtime"] = time.perf_counter() - start
        metrics = {f"{metric_key_prefix}_{k}": v for k, v in metrics.items()}
        if not math.isfinite(loss):
            metrics[f"{metric_key_prefix}_loss"] = float("nan")
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics, examples
