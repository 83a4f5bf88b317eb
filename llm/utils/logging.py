"""Logging set-up and checkpoint discovery shared by the entry points."""

from __future__ import annotations

import logging
import sys

import transformers

from llm.utils.checkpoints import latest_checkpoint

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class CurrentStderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a record is emitted.

    A plain ``StreamHandler`` keeps the stream it was created with; when that stream is later
    replaced and closed (a notebook cell, pytest's capture, a redirecting launcher), every log
    call prints a "--- Logging error ---" traceback instead of the message.
    """

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ assigns it; the property always wins
        pass


def configure_logging(level: int) -> None:
    """One root handler for our loggers and transformers' (which otherwise keeps its own handler)."""
    handler = CurrentStderrHandler()
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    logging.basicConfig(level=level, handlers=[handler], force=True)
    transformers.utils.logging.set_verbosity(level)
    transformers.utils.logging.disable_default_handler()
    transformers.utils.logging.enable_propagation()


def setup_logging(training_args: transformers.TrainingArguments) -> None:
    """Logging for a flat-config script; then the parser's notes on the config (names with no effect here)."""
    configure_logging(logging.INFO if training_args.should_log else logging.WARNING)
    for note in training_args.config_notes:
        logging.getLogger("llm.config").info(note)


def resume_checkpoint(training_args: transformers.TrainingArguments) -> str | None:
    from llm.settings.fingerprint import training_fingerprint

    value = training_args.resume_from_checkpoint
    fingerprint = training_fingerprint(training_args) if value else None
    return latest_checkpoint(value, training_args.output_dir, fingerprint)
