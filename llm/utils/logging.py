"""Logging set-up and checkpoint discovery shared by the entry points."""

from __future__ import annotations

import logging

import transformers

from llm.utils.checkpoints import latest_checkpoint


def setup_logging(training_args: transformers.TrainingArguments) -> None:
    level = logging.INFO if training_args.should_log else logging.WARNING
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=level, force=True)
    transformers.utils.logging.set_verbosity(level)
    transformers.utils.logging.enable_explicit_format()


def resume_checkpoint(training_args: transformers.TrainingArguments) -> str | None:
    return latest_checkpoint(training_args.resume_from_checkpoint, training_args.output_dir)
