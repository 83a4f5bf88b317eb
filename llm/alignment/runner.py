"""What every ``run_*.py`` does after building its trainer: train, save, evaluate, write the result files."""

from __future__ import annotations

import json
import logging
import os

from llm.alignment.context import RunContext
from llm.data.prepare import PackedData, overlong_results
from llm.settings.flat import DataArgument, TrainingArguments
from llm.utils import preemption
from llm.utils.checkpoints import FINAL_STAGING, begin_final, final_model_complete, finish_final, latest_checkpoint
from llm.utils.disk_full import saving
from llm.utils.distributed import barrier
from llm.utils.rundir import run_guard

logger = logging.getLogger(__name__)

TRAINER_STATE_NAME = "trainer_state.json"  # transformers.trainer's name for it (not imported: a heavy module)


def resume_checkpoint(trainer, training_args: TrainingArguments) -> str | None:
    """The checkpoint to resume (None: a fresh start), matched against the trainer's run fingerprint (computed here
    only when resuming, and kept for the checkpoints)."""
    value = training_args.resume_from_checkpoint
    fingerprint = trainer.run_fingerprint if value else None
    return latest_checkpoint(value, training_args.output_dir, fingerprint)


def output_dir_guard(run: RunContext):
    """The block a flat script builds and trains in (``llm.utils.rundir.run_guard``): SIGTERM handled from here
    on, ``output_dir`` writable and locked for this run, and not another run's unless resuming or overwriting."""
    data_args, training_args = run.data_args, run.training_args
    writes_model = training_args.do_train and not (data_args.benchmark or data_args.autotuner_benchmark)
    return run_guard(
        training_args.output_dir,
        resume=training_args.resume_from_checkpoint,
        overwrite=training_args.overwrite_output_dir,
        trains=writes_model,
        # compared across the processes of a torchrun: one process has nothing to compare, so no data hashing
        config=run_settings(run) if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None,
    )


# the run's shape (when it stops, saves, evaluates, batches): with the fingerprint's fields, what every process
# of one run must agree on
RUN_SHAPE = (
    "output_dir",
    "do_train",
    "do_eval",
    "max_steps",
    "num_train_epochs",
    "save_strategy",
    "save_steps",
    "eval_strategy",
    "eval_steps",
    "logging_steps",
    "per_device_train_batch_size",
    "per_device_eval_batch_size",
    "gradient_accumulation_steps",
)


def run_settings(run: RunContext) -> dict:
    """What every process of a run must have alike: the fingerprint's values and the run's shape."""
    values = dict(run.fingerprint.values)
    values.update({name: str(getattr(run.training_args, name, None)) for name in RUN_SHAPE})
    values["dev_dataset_path"] = run.data_args.dev_dataset_path
    return values


def save_final_model(trainer, out: str) -> None:
    """The model, tokenizer and trainer state into ``out``, never written in place: every rank saves into
    ``out/final.partial``, then the main process moves the files in and writes ``final_model.json`` last
    (``llm.utils.checkpoints.begin_final``). A save stopped half-way leaves the previous files whole, and a
    resumed run that finds no complete final model saves it again; a full disk removes the staging directory and
    is one message (``llm.utils.disk_full``)."""
    main = trainer.is_world_process_zero()
    with saving(out, os.path.join(out, FINAL_STAGING), "the final model", main):  # a full disk: one message
        staging = begin_final(out, main)
        barrier()
        trainer.save_model(staging)
        if main:
            trainer.state.save_to_json(os.path.join(staging, TRAINER_STATE_NAME))
        barrier()
        if main:
            finish_final(out, trainer.state.global_step)


def write_json(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)


def write_scores(path: str, examples: list[dict], records: list) -> None:
    """Per-example outputs as JSON lines, naming the source file and record of each."""
    with open(path, "w", encoding="utf-8") as f:
        for ex in examples:
            rec = records[ex["record"]]
            row = {"source": rec.source, "index": rec.index}
            row.update({k: v for k, v in ex.items() if k != "record" and not k.startswith("_")})  # _: the trainer's
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def train_and_evaluate(
    trainer,
    data_args: DataArgument,
    training_args: TrainingArguments,
    train: PackedData | None = None,
    dev: PackedData | None = None,
) -> dict:
    """``do_train``: train (resuming if asked), save model + state; ``do_eval``: metrics to ``eval_results.json``
    and per-example outputs to ``eval_scores.jsonl`` (``dev``: the dev split the trainer evaluates, whose records
    they name); everything to ``all_results.json``, with the records each split skipped as too long. Returns the
    results."""
    out = training_args.output_dir
    results: dict = {}
    if training_args.do_train:
        resumed = resume_checkpoint(trainer, training_args)
        result = trainer.train(resume_from_checkpoint=resumed)
        if trainer.stopped_by_signal:  # checkpoint saved: say so (Ctrl-C: exit 130 from here)
            step = trainer.state.global_step
            checkpoint = os.path.join(out, f"checkpoint-{step}")
            preemption.stopped_after_step(preemption.stop_requested(), step, checkpoint, "--resume_from_checkpoint")
            return results
        if getattr(trainer, "already_complete", False):
            # resumed at its last step: the final model is there already, unless its save was stopped half-way
            if not final_model_complete(out, trainer.state.global_step):
                logger.warning(
                    "%s holds no complete final model (its save did not finish): saving it from the last checkpoint",
                    out,
                )
                save_final_model(trainer, out)
        elif not (data_args.benchmark or data_args.autotuner_benchmark):
            save_final_model(trainer, out)
        results.update({f"train_{k}" if not k.startswith("train") else k: v for k, v in result.metrics.items()})
        if resumed:  # transformers' train_* figures cover the steps after the resume: the whole run's beside them
            results.update(whole_run_results(trainer.state.log_history, resumed))
    if training_args.do_eval:
        metrics, examples = trainer.evaluate_with_outputs()
        results.update(metrics)
        if trainer.is_world_process_zero():
            write_json(os.path.join(out, "eval_results.json"), metrics)
            write_scores(os.path.join(out, "eval_scores.jsonl"), examples, dev.records if dev else [])
    if results:
        results.update(overlong_results(train, dev))  # records skipped as too long, per split
    if trainer.is_world_process_zero() and results:
        write_json(os.path.join(out, "all_results.json"), results)
        logger.info("results (%s): %s", os.path.join(out, "all_results.json"), summary_line(results))
    return results


def whole_run_results(log_history: list[dict], resumed: str) -> dict:
    """``train_loss_whole_run`` (the mean of every logged training loss, from step 1, the resumed checkpoint's
    log included) and ``train_resumed_from`` (its step), named apart from transformers' ``train_loss`` /
    ``train_runtime``, which cover only the steps this process ran."""
    losses = [h["loss"] for h in log_history if "loss" in h and "eval_loss" not in h]
    step = int(resumed.rstrip("/").rpartition("-")[2]) if resumed.rstrip("/").rpartition("-")[2].isdigit() else None
    out: dict = {"train_resumed_from": step}
    if losses:
        out["train_loss_whole_run"] = sum(losses) / len(losses)
    return out


SUMMARY_SKIPPED = ("runtime", "per_second", "flos")  # speed figures: in all_results.json, not the one line


def summary_line(results: dict) -> str:
    """The run's results as one line (the process of rank 0 prints it once, under torchrun too)."""
    shown = {
        k: v for k, v in sorted(results.items()) if isinstance(v, (int, float)) and not k.endswith(SUMMARY_SKIPPED)
    }
    return ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in shown.items())
