"""The PPO training loop around ``PPOTrainer.train_step``: progress bar, logging, samples, checkpoints,
preemption (SIGTERM) and role failures; with ``actor_rollout.async_rollout`` the rollouts come from
``async_rollout.AsyncRollouts`` for the length of the loop (the next step's rollout generated while this
step updates)."""

from __future__ import annotations

from llm.alignment.ppo.async_rollout import AsyncRollouts
from llm.alignment.ppo.interfaces import RoleFailure
from llm.alignment.ppo.samples_log import trim_samples
from llm.utils import preemption


def train_loop(trainer) -> list[dict]:
    """``trainer.train``: steps up to ``training.max_steps``, then the final save; the log history."""
    t = trainer.c.training
    trainer._open_writer()
    trim_samples(trainer.samples_path, trainer.step)
    from tqdm.auto import tqdm

    # SIGTERM (llm.utils.preemption): before this run's first step has completed it stops the run at once;
    # after that the step in progress finishes, a checkpoint is saved and train() returns (exit 0).
    preemption.reassert()  # ray.init installs its own SIGTERM handler (it kills the workers and exits 1)
    bar = tqdm(total=t.max_steps, initial=trainer.step, disable=t.disable_tqdm, desc="ppo")
    finished = False
    if trainer.c.actor_rollout.async_rollout and trainer.step < t.max_steps:
        trainer.async_rollouts = AsyncRollouts(trainer)
    try:
        while trainer.step < t.max_steps:
            metrics = trainer.train_step()
            if trainer.async_rollouts is not None:
                metrics.update(trainer.async_rollouts.step_metrics(metrics))
            preemption.step_completed()
            bar.update(1)
            bar.set_postfix(score=f"{metrics['score']:.3f}", kl=f"{metrics['kl']:.3f}")
            if trainer.step % t.logging_steps == 0 or trainer.step == t.max_steps:
                trainer.log(metrics)
                trainer.log_samples(trainer.last_experience)
            saved = bool(t.save_steps and trainer.step % t.save_steps == 0)
            if saved:
                trainer.save_checkpoint()
            signum = preemption.stop_requested()
            if signum is not None and trainer.step < t.max_steps:
                if not saved:
                    trainer.save_checkpoint()
                finished = True
                _end_async(trainer, True)  # the rollout in flight is discarded (regenerated on resume)
                preemption.stopped_after_step(
                    signum, trainer.step, trainer.last_checkpoint, "--training.resume_from_checkpoint"
                )
                return trainer.log_history
        finished = True
        _end_async(trainer, True)
        preemption.training_finished()
        trainer.save_final()
    except RoleFailure as err:
        # The surviving roles may be mid-update: the last checkpoint is the consistent state to resume.
        where = (
            f"the last checkpoint is {trainer.last_checkpoint}: resume with --resume_from_checkpoint auto"
            if trainer.last_checkpoint
            else "no checkpoint was saved yet (training.save_steps)"
        )
        raise RoleFailure(f"{err}\nThe run stopped in step {trainer.step + 1}; {where}") from None
    finally:
        _end_async(trainer, finished)
        bar.close()
        if trainer.writer is not None:
            trainer.writer.close()
            trainer.writer = None
    return trainer.log_history


def _end_async(trainer, finished: bool) -> None:
    if trainer.async_rollouts is not None:
        rollouts, trainer.async_rollouts = trainer.async_rollouts, None
        rollouts.close(finished)
