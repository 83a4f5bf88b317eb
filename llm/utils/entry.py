"""What every ``run_*.py`` does after building its trainer: train, save, evaluate, write the result files."""

from __future__ import annotations

import json
import os

from llm.data.pipeline import overlong_results
from llm.utils.arguments import DataArgument, TrainingArguments
from llm.utils.logging import resume_checkpoint
from llm.utils.rundir import run_guard


def output_dir_guard(data_args: DataArgument, training_args: TrainingArguments):
    """The block a flat script builds and trains in (``llm.utils.rundir.run_guard``): SIGTERM handled from here
    on, ``output_dir`` writable and locked for this run, and not another run's unless resuming or overwriting."""
    writes_model = training_args.do_train and not (data_args.benchmark or data_args.autotuner_benchmark)
    return run_guard(
        training_args.output_dir,
        resume=training_args.resume_from_checkpoint,
        overwrite=training_args.overwrite_output_dir,
        trains=writes_model,
    )


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
            row.update({k: v for k, v in ex.items() if k != "record"})
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def train_and_evaluate(trainer, data_args: DataArgument, training_args: TrainingArguments, dev_records: list) -> dict:
    """``do_train``: train (resuming if asked), save model + state; ``do_eval``: metrics to ``eval_results.json``
    and per-example outputs to ``eval_scores.jsonl``; everything to ``all_results.json``. Returns the results."""
    out = training_args.output_dir
    results: dict = {}
    if training_args.do_train:
        result = trainer.train(resume_from_checkpoint=resume_checkpoint(training_args))
        if trainer.stopped_by_signal:
            return results  # checkpoint saved; resume with resume_from_checkpoint=auto
        if getattr(trainer, "already_complete", False):
            pass  # resumed at its last step: the final model and state are there already; nothing changes
        elif not (data_args.benchmark or data_args.autotuner_benchmark):
            trainer.save_model(out)
            trainer.save_state()
        results.update({f"train_{k}" if not k.startswith("train") else k: v for k, v in result.metrics.items()})
    if training_args.do_eval:
        metrics, examples = trainer.evaluate_with_outputs()
        results.update(metrics)
        if trainer.is_world_process_zero():
            write_json(os.path.join(out, "eval_results.json"), metrics)
            write_scores(os.path.join(out, "eval_scores.jsonl"), examples, dev_records)
    if results:
        results.update(overlong_results(data_args))  # records skipped as too long, per split
    if trainer.is_world_process_zero() and results:
        write_json(os.path.join(out, "all_results.json"), results)
    return results
