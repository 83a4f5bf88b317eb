"""Logging set-up and checkpoint discovery shared by the entry points."""

from __future__ import annotations

import logging
import sys

import transformers

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


class UntrueLines(logging.Filter):
    """Drops transformers' lines that are not true of our runs: "Training completed. Do not forget to share your
    model" is logged by ``Trainer.train`` even when a signal stopped it (our runner prints the real outcome)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Training completed. Do not forget to share" not in str(record.msg)


def configure_logging(level: int) -> None:
    """One root handler for our loggers and transformers' (which otherwise keeps its own handler)."""
    handler = CurrentStderrHandler()
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    handler.addFilter(UntrueLines())
    logging.basicConfig(level=level, handlers=[handler], force=True)
    transformers.utils.logging.set_verbosity(level)
    transformers.utils.logging.disable_default_handler()
    transformers.utils.logging.enable_propagation()


def log_config_notes(notes: list[str], source: str | None = None) -> None:
    """The configuration path's notes (what a dialect's name became, names with no effect here), one line each
    on the ``llm.config`` logger; ``source`` (the config file) leads each line when the notes do not name it."""
    logger = logging.getLogger("llm.config")
    for note in notes:
        logger.info("%s: %s" if source else "%s%s", source or "", note)


def setup_logging(training_args: transformers.TrainingArguments) -> None:
    """Logging for a flat-config script (``configure_logging`` at the level of this process's rank); then the
    parser's notes on the config."""
    configure_logging(logging.INFO if training_args.should_log else logging.WARNING)
    log_config_notes(training_args.config_notes)
