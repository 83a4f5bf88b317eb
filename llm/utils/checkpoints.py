"""Finding the checkpoint to resume from (shared by every entry point)."""

from __future__ import annotations

import os

from transformers.trainer_utils import get_last_checkpoint

from llm.utils.errors import UserError


def latest_checkpoint(value: str | None, output_dir: str) -> str | None:
    """``resume_from_checkpoint``: None/false, a checkpoint directory, or true/auto/last (newest in output_dir)."""
    if value is None or str(value).lower() in ("", "false", "none"):
        return None
    if str(value).lower() in ("true", "auto", "last"):
        last = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
        if last is None:
            raise UserError(f"resume_from_checkpoint={value!r}: no checkpoint-* directory in {output_dir}")
        return last
    if not os.path.isdir(value):
        raise UserError(f"resume_from_checkpoint: {value} is not a directory")
    return value
