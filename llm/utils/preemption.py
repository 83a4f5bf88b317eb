"""SIGTERM and Ctrl-C (SIGINT): finish the current optimizer step, save a checkpoint, stop (SIGTERM: exit 0;
Ctrl-C: exit 130, with one line saying how to resume).

Schedulers (Slurm, Kubernetes, torchrun's elastic agent) send SIGTERM before killing a job. The
checkpoint holds model, optimizer, scheduler, RNG and the data position, so `resume_from_checkpoint`
continues with exactly the batches an uninterrupted run would have seen.

What a SIGTERM does depends on where the run is:

- before the first optimizer step of this run has completed (loading models, reading or tokenising data,
  inside the first step): there is nothing new to save, so the run stops at once: ``StoppedBySignal``
  is raised where the process is (a blocking read included), the lock on ``output_dir`` is released,
  and ``run_cli`` prints one line and exits with 128 + the signal number (143 for SIGTERM);
- after a step has completed: the current step finishes, a checkpoint is saved, one line names it and how to
  resume (``stopped_after_step``); the run exits 0 after SIGTERM (a scheduler's request, honoured), 130 after
  Ctrl-C (an interrupted command, as shells expect);
- after training (the final save, evaluation): the run finishes them;
- a second signal always exits at once (the same exit code), saving nothing; one within a second of the
  first is the same request (``timeout`` sends SIGTERM to its child and then to the whole process group).

``handle_signals()`` installs the handler for the life of a run (``llm.utils.rundir.run_guard``) and
restores the previous one after; the trainers report their progress with ``step_completed()`` and
``training_finished()`` (``SaveOnSignal`` does it for ``transformers.Trainer``) and look at
``stop_requested()`` at each step's end. A library that installs its own SIGTERM handler (``ray.init``
does) is followed by ``reassert()``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator

from transformers import TrainerCallback

logger = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)

STARTING, TRAINING, FINISHING = "starting", "training", "finishing"

# Signals this close (seconds) to the first one are the same request: `timeout` sends SIGTERM to its child and
# then to the child's process group, so a run under it receives two at once. A later one is a second signal.
SAME_SIGNAL_WINDOW = 1.0


class StoppedBySignal(BaseException):
    """A signal stopped the run before anything was left to save. A BaseException, like KeyboardInterrupt:
    ``except Exception`` in library code (data loading, tokenisation) does not swallow it."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class _State:
    def __init__(self) -> None:
        self.phase = STARTING
        self.received: int | None = None  # a signal to act on at the end of the current step
        self.count = 0
        self.first = 0.0  # time.monotonic() of the first signal
        self.installed = False
        self.hard_exit: Callable[[], None] | None = None


_state = _State()


def _name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _handle(signum, frame) -> None:
    now = time.monotonic()
    if _state.count and now - _state.first < SAME_SIGNAL_WINDOW:
        return  # the same request again: `timeout` signals its child, then the child's whole process group
    _state.count += 1
    _state.first = _state.first if _state.count > 1 else now
    name = _name(signum)
    if _state.count > 1:
        _exit_now(signum, f"stopped: a second {name}: exiting at once, nothing saved")
    if _state.phase == TRAINING:
        logger.warning(
            "received %s: saving a checkpoint after this step, then stopping (send it again to exit now)", name
        )
        _state.received = signum
    elif _state.phase == FINISHING:
        logger.warning("received %s: training has ended, finishing the final save (send it again to exit now)", name)
    else:
        raise StoppedBySignal(
            signum, f"stopped by {name} before the first optimizer step of this run completed: nothing to save"
        )


def _exit_now(signum: int, message: str) -> None:
    hook, _state.hard_exit = _state.hard_exit, None
    if hook is not None:
        with contextlib.suppress(Exception):
            hook()
    with contextlib.suppress(Exception):
        print(message, file=sys.stderr, flush=True)
        sys.stdout.flush()
    os._exit(128 + signum)


def install(signals: tuple[int, ...] = SIGNALS) -> None:
    """Our handler for ``signals`` (main thread only; elsewhere a no-op)."""
    with contextlib.suppress(ValueError):  # not the main thread
        for sig in signals:
            signal.signal(sig, _handle)
        _state.installed = True


def reassert(signals: tuple[int, ...] = SIGNALS) -> None:
    """Put our handler back after a library replaced it (``ray.init``), when a run has installed it."""
    if _state.installed:
        install(signals)


def _reset() -> None:
    _state.phase, _state.received, _state.count, _state.first = STARTING, None, 0, 0.0


@contextlib.contextmanager
def handle_signals(signals: tuple[int, ...] = SIGNALS) -> Iterator[None]:
    """Our handler for the life of a run; the previous handlers (and state) are restored after it."""
    try:
        previous = {sig: signal.getsignal(sig) for sig in signals}
    except ValueError:
        previous = {}
    was_installed = _state.installed
    _reset()
    install(signals)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError, TypeError):
            for sig, handler in previous.items():
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        _state.installed = was_installed
        _reset()


def on_hard_exit(hook: Callable[[], None] | None) -> None:
    """What to do before a second signal ends the process at once (release the lock on output_dir)."""
    _state.hard_exit = hook


def step_completed() -> None:
    """An optimizer step of this run has completed: a signal now means finish the step, save, stop."""
    if _state.phase == STARTING:
        _state.phase = TRAINING


def training_finished() -> None:
    _state.phase = FINISHING


def stopped_after_step(signum: int, step: int, checkpoint: str | None, resume_option: str) -> None:
    """A run stopped by ``signum`` after saving ``checkpoint`` at ``step``: one line saying so and how to resume.
    After SIGTERM the run then ends normally (exit 0); after Ctrl-C this raises ``StoppedBySignal`` (exit 130)."""
    name = " (Ctrl-C)" if signum == signal.SIGINT else ""
    message = (
        f"stopped by signal {signum}{name} after step {step}: saved {checkpoint}; resume with {resume_option} auto"
    )
    if signum == signal.SIGINT:
        raise StoppedBySignal(signum, message)
    logger.warning("%s", message)


def stop_requested() -> int | None:
    """The signal received during training (to save and stop at this step's end), else None."""
    return _state.received


class SaveOnSignal(TrainerCallback):
    """The ``transformers.Trainer`` side: each step's end reports progress and, after a signal, saves and
    stops. Installs the handler itself when no ``handle_signals`` block has (a trainer built on its own)."""

    def __init__(self, signals: tuple[int, ...] = SIGNALS) -> None:
        if not _state.installed:
            install(signals)
        _state.received = None
        _state.phase = STARTING
        self.acted = False

    @property
    def received(self) -> int | None:
        return _state.received

    def on_step_end(self, args, state, control, **kwargs):
        step_completed()
        if _state.received is not None:
            control.should_save = True
            control.should_training_stop = True
            self.acted = True
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if _state.received is not None and not self.acted:
            # The signal came after the last step's end: no step saved for it, so the run ends as usual
            # (final model and state saved) instead of as a stopped one.
            logger.warning("training ended before the signal could stop it: saving the final model")
            _state.received = None
        training_finished()
        return control
