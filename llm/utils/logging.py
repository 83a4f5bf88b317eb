"""Logging set-up and checkpoint discovery shared by the entry points."""

from __future__ import annotations

import logging
import os

import transformers
from transformers.trainer_utils import get_last_checkpoint

from llm.utils.errors import UserError


def setup_logging(training_args: transformers.TrainingArguments) -> None:
    level = logging.INFO if training_args.should_log else logging.WARNING
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=level, force=True)
    transformers.utils.logging.set_verbosity(level)
    transformers.utils.logging.enable_explicit_format()


def resume_checkpoint(training_args: transformers.TrainingArguments) -> str | None:
    """``resume_from_checkpoint``: a checkpoint directory, or "true"/"auto" for the newest in output_dir."""
    value = training_args.resume_from_checkpoint
    if value is None or str(value).lower() in ("", "false", "none"):
        return None
    if str(value).lower() in ("true", "auto", "last"):
        last = get_last_checkpoint(training_args.output_dir) if os.path.isdir(training_args.output_dir) else None
        if last is None:
            raise UserError(
                f"resume_from_checkpoint={value!r}: no checkpoint-* directory in {training_args.output_dir}"
            )
        return last
    if not os.path.isdir(value):
        raise UserError(f"resume_from_checkpoint: {value} is not a directory")
    return value
