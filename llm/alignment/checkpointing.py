"""Checkpoint save and load of the alignment trainers: ``transformers.Trainer``'s ``_save*`` / ``_load*`` overrides.

checkpoint-N is written into checkpoint-N.partial (``llm.utils.checkpoints``) and renamed when complete, its
checkpoint.json marker last. Nothing in it is a pickle: the sharded state is safetensors + JSON
(``llm.utils.distributed``), the scheduler JSON, the RNG state safetensors + JSON, trainer_state.json JSON. Model
and optimizer state resume under any parallel layout (torch.distributed.checkpoint files in
``checkpoint-N/sharded_state``); with ``unified_checkpoint`` a checkpoint also holds the model as one Hugging Face
safetensors file. Checkpoints written by plain transformers load with ``torch.load(weights_only=True)`` only.

``CheckpointMixin`` goes before ``transformers.Trainer`` in the bases of ``AlignmentTrainer``, which sets
``_save_training_state`` and provides ``_raw_optimizer``.
"""

from __future__ import annotations

import logging
import math
import os

import torch
import torch.distributed as dist
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from llm.utils.distributed import SHARDED_STATE_DIR, load_sharded_state, save_sharded_state
from llm.utils.errors import UserError

logger = logging.getLogger(__name__)


class CheckpointMixin:
    """Atomic, pickle-free checkpoints for a ``transformers.Trainer`` subclass (see the module docstring)."""

    model_args = None  # the run's ModelArgument (``lora_merge``), set by the trainer
    run = None  # the run's RunContext (llm.alignment.context), set by the trainer
    _save_training_state = True  # optimizer, scheduler and RNG state in checkpoints (not save_only_model)

    @property
    def lora_merge(self) -> bool:
        """LoRA (``llm.utils.lora``): the final ``save_model`` also writes ``output_dir/merged``, the base with the
        adapter merged in (the model argument ``lora_merge``)."""
        return bool(self.model_args is not None and self.model_args.lora_merge)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        # Inside checkpoints the Hugging Face copy of the model is optional (unified_checkpoint); the final
        # save_model(output_dir) always writes it. Resuming reads the sharded state either way.
        if _internal_call and not self.args.unified_checkpoint:
            return
        super().save_model(output_dir, _internal_call)
        # LoRA (llm.utils.lora): output_dir holds the PEFT adapter; lora_merge adds the merged model to
        # output_dir/merged
        if not _internal_call and self.lora_merge and self.args.should_save:
            from llm.utils.lora import save_merged

            save_merged(self.model, output_dir or self.args.output_dir, self.processing_class)

    @property
    def run_fingerprint(self):
        """The run's fingerprint (``RunContext.fingerprint``, computed once), stored in every checkpoint; a trainer
        built without a run: its training arguments' alone."""
        if self.run is not None:
            return self.run.fingerprint
        if getattr(self, "_run_fingerprint", None) is None:
            from llm.settings.fingerprint import run_fingerprint

            self._run_fingerprint = run_fingerprint(self.args)
        return self._run_fingerprint

    def _checkpoint_barrier(self) -> None:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()

    def _save_checkpoint(self, model, trial) -> None:
        """transformers' ``_save_checkpoint`` made atomic: every rank writes into ``checkpoint-N.partial``; after a
        barrier the main process writes the marker and renames the directory; rotation (save_total_limit) counts
        only complete checkpoints of this run."""
        from transformers.trainer import TRAINER_STATE_NAME
        from transformers.trainer_callback import ExportableState
        from transformers.trainer_utils import SaveStrategy

        from llm.utils.checkpoints import (
            begin_checkpoint,
            finish_checkpoint,
            partial_dir,
            rotate_checkpoints,
            save_tree,
        )
        from llm.utils.disk_full import saving

        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        run_dir = self._get_output_dir(trial=trial)
        final = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        main = self.args.should_save
        fingerprint = self.run_fingerprint
        # a full disk: the unfinished checkpoint-N.partial removed, one message naming the last complete checkpoint
        with saving(run_dir, partial_dir(final), os.path.basename(final), main):
            partial = begin_checkpoint(final, main)
            self._checkpoint_barrier()
            self.save_model(partial, _internal_call=True)
            if self.args.save_strategy in (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST) and (
                self.state.best_global_step
            ):
                best = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.best_global_step}")
                if best == final or os.path.isdir(best):
                    self.state.best_model_checkpoint = best
            if self._save_training_state:
                save_sharded_state(os.path.join(partial, SHARDED_STATE_DIR), self.model, self._raw_optimizer())
                if main:
                    save_tree(partial, "scheduler", self.lr_scheduler.state_dict())
                self._save_rng_state(partial)
            if main:
                for cb in [
                    c for c in self.callback_handler.callbacks + [self.control] if isinstance(c, ExportableState)
                ]:
                    name, cb_state = cb.__class__.__name__, cb.state()
                    if isinstance(self.state.stateful_callbacks[name], list):
                        self.state.stateful_callbacks[name].append(cb_state)
                    else:
                        self.state.stateful_callbacks[name] = cb_state
                self.state.save_to_json(os.path.join(partial, TRAINER_STATE_NAME))
            self._checkpoint_barrier()  # every rank's files are in partial/
            if main:
                finish_checkpoint(partial, final, self.state.global_step, fingerprint)
        self._checkpoint_barrier()  # no rank goes on before checkpoint-N is in place
        if self.args.push_to_hub:
            self._push_from_checkpoint(final)
        if main:
            rotate_checkpoints(
                run_dir, self.args.save_total_limit, fingerprint, keep=(self.state.best_model_checkpoint, final)
            )

    def _save_rng_state(self, output_dir: str) -> None:
        """This process's RNG states (python, numpy, torch CPU and accelerator) as ``rng_state_<rank>.json`` +
        ``.safetensors``, instead of transformers' pickled ``rng_state*.pth``."""
        import random

        import numpy as np

        from llm.utils.checkpoints import save_tree

        states: dict = {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "cpu": torch.random.get_rng_state(),
        }
        if torch.cuda.is_available():
            states["cuda"] = torch.cuda.random.get_rng_state_all()
        npu = getattr(torch, "npu", None)
        if npu is not None and npu.is_available():
            states["npu"] = npu.random.get_rng_state_all()
        numpy_state = list(states["numpy"])
        numpy_state[1] = numpy_state[1].astype(np.int64)  # safetensors has no uint32 for every torch build
        states["numpy"] = tuple(numpy_state)
        save_tree(output_dir, f"rng_state_{self.args.process_index}", states)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        import random

        import numpy as np

        from llm.utils.checkpoints import MARKER, load_tree

        if checkpoint is None:
            return
        name = f"rng_state_{self.args.process_index}"
        if not os.path.isfile(os.path.join(checkpoint, f"{name}.json")):
            if os.path.isfile(os.path.join(checkpoint, MARKER)):
                logger.info(
                    "%s has no RNG state for process %d (saved by fewer processes): not restored",
                    checkpoint,
                    self.args.process_index,
                )
                return
            return self._torch_load_guarded(super()._load_rng_state, checkpoint)
        states = load_tree(checkpoint, name)
        try:
            version, internal, gauss = states["python"]
            random.setstate((version, tuple(internal), gauss))
            kind, keys, pos, has_gauss, cached = states["numpy"]
            np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
            torch.random.set_rng_state(states["cpu"])
            if torch.cuda.is_available() and "cuda" in states:
                cuda = states["cuda"]
                if len(cuda) == torch.cuda.device_count():
                    torch.cuda.random.set_rng_state_all(cuda)
                else:
                    torch.cuda.random.set_rng_state(cuda[min(torch.cuda.current_device(), len(cuda) - 1)])
            npu = getattr(torch, "npu", None)
            if npu is not None and npu.is_available() and "npu" in states and len(states["npu"]) == npu.device_count():
                npu.random.set_rng_state_all(states["npu"])
        except (KeyError, TypeError, ValueError, RuntimeError) as err:
            raise UserError(
                f"{os.path.join(checkpoint, name)}.json: not a valid RNG state ({err}); the checkpoint is damaged"
            ) from None

    @staticmethod
    def _torch_load_guarded(load, checkpoint: str, *args):
        """transformers' own loaders (a checkpoint written by plain transformers): torch.load(weights_only=True),
        whose refusal of a pickled object becomes one message."""
        import pickle

        try:
            return load(checkpoint, *args)
        except (pickle.UnpicklingError, RuntimeError, EOFError) as err:
            raise UserError(
                f"{checkpoint}: a .pt/.pth file in it is not plain tensors (torch.load refused it: "
                f"{str(err).splitlines()[0][:200]}); it is not loaded: resume from a checkpoint saved by this version"
            ) from None

    def _checkpoint_trainer_state(self, checkpoint: str):
        """trainer_state.json, read as plain JSON first so that a damaged one is one message."""
        from transformers.trainer import TRAINER_STATE_NAME
        from transformers.trainer_callback import TrainerState

        from llm.utils.checkpoints import read_json

        path = os.path.join(checkpoint, TRAINER_STATE_NAME)
        if not isinstance(read_json(path), dict):
            raise UserError(f"{path}: not a trainer state; the checkpoint is damaged")
        try:
            return TrainerState.load_from_json(path)
        except (TypeError, ValueError) as err:
            raise UserError(f"{path}: not a trainer state ({err}); the checkpoint is damaged") from None

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        self._checkpoint_trainer_state(resume_from_checkpoint)
        sharded = os.path.join(resume_from_checkpoint, SHARDED_STATE_DIR)
        if not os.path.isdir(sharded):  # a checkpoint written by plain transformers
            return self._torch_load_guarded(super()._load_from_checkpoint, resume_from_checkpoint, model)
        load_sharded_state(sharded, self.model, None)

    def _load_best_model(self) -> None:
        sharded = os.path.join(self.state.best_model_checkpoint, SHARDED_STATE_DIR)
        if not os.path.isdir(sharded):
            return super()._load_best_model()
        logger.info("loading the best model from %s (%s)", sharded, self.state.best_metric)
        load_sharded_state(sharded, self.model, None)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        from llm.utils.checkpoints import load_tree

        if checkpoint is None or not os.path.isdir(os.path.join(checkpoint, SHARDED_STATE_DIR)):
            return self._torch_load_guarded(super()._load_optimizer_and_scheduler, checkpoint)
        load_sharded_state(os.path.join(checkpoint, SHARDED_STATE_DIR), self.model, self._raw_optimizer())
        if not os.path.isfile(os.path.join(checkpoint, "scheduler.json")):
            raise UserError(f"{checkpoint}: no scheduler.json; the checkpoint is incomplete: resume from another one")
        self.lr_scheduler.load_state_dict(load_tree(checkpoint, "scheduler"))

    def _load_scaler(self, checkpoint: str | None) -> None:
        # The fp16 loss scale lives in the optimizer's param groups (llm.utils.precision.LossScaler), restored
        # with the optimizer state; a scaler.pt (plain transformers) is only read with weights_only.
        if checkpoint is not None and os.path.isfile(os.path.join(checkpoint, "scaler.pt")):
            self._torch_load_guarded(super()._load_scaler, checkpoint)

    def resume_of_a_finished_run(self, checkpoint: str | None):
        """When ``checkpoint`` is already at (or past) this run's last step: its model and state loaded, the
        ``TrainOutput`` to return instead of training (transformers would train one step more); else None."""
        from transformers.trainer_utils import TrainOutput

        if not checkpoint:
            return None
        state = self._checkpoint_trainer_state(checkpoint)
        planned = self._planned_max_steps()
        if planned is None or state.global_step < planned:
            return None
        logger.warning(
            "%s is at step %d and this run ends at step %d: the run is already complete, nothing to train "
            "(raise max_steps or num_train_epochs to train on)",
            checkpoint,
            state.global_step,
            planned,
        )
        self._load_from_checkpoint(checkpoint)
        self.state = state
        self.already_complete = True
        losses = [h["train_loss"] for h in state.log_history if "train_loss" in h]
        return TrainOutput(state.global_step, losses[-1] if losses else float("nan"), {})

    def _planned_max_steps(self) -> int | None:
        if self.args.max_steps > 0:
            return self.args.max_steps
        try:
            n = len(self.get_train_dataloader())
        except (TypeError, ValueError):
            return None
        ga = self.args.gradient_accumulation_steps
        return math.ceil(self.args.num_train_epochs * max(n // ga + int(n % ga > 0), 1))
