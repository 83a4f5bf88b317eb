"""SIGTERM/SIGINT: finish the current optimizer step, save a checkpoint, stop.

Schedulers (Slurm, Kubernetes, torchrun's elastic agent) send SIGTERM before killing a job. The
checkpoint holds model, optimizer, scheduler, RNG and the data position, so `resume_from_checkpoint`
continues with exactly the batches an uninterrupted run would have seen.
"""

from __future__ import annotations

import logging
import signal

from transformers import TrainerCallback

logger = logging.getLogger(__name__)


class SaveOnSignal(TrainerCallback):
    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM,)) -> None:
        self.received: int | None = None
        for sig in signals:
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        logger.warning("received signal %d: saving a checkpoint after this step, then stopping", signum)
        self.received = signum

    def on_step_end(self, args, state, control, **kwargs):
        if self.received is not None:
            control.should_save = True
            control.should_training_stop = True
        return control
