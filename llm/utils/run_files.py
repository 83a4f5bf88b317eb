"""What in an ``output_dir`` runs of this project wrote: ``output_dir/run_files.json``, the names they put there.

A run never writes over a file it did not write (a user's config.json, tokenizer.json, weights, notes):
``llm.utils.rundir`` refuses, at start-up, an ``output_dir`` holding any name such a file does not list.
The list grows in three places, each before or after the writes it covers:

- at start-up, once the checks have passed: every name then in the directory (all of them a run's);
- the final save (``llm.utils.checkpoints.finish_final``): the names it moves in, before it moves them, so a
  save cut half-way leaves no file the next run would take for someone else's;
- when the run ends, however it ends: every name then in the directory (results, logs, samples).

Only the main process writes the file. It holds no paths and no secrets, only names; a damaged or foreign
``run_files.json`` counts as none (and is then itself a file of another origin).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable

RUN_FILES = "run_files.json"
FORMAT = 1
WRITTEN_BY = "llm-alignment"  # this project


def recorded(directory: str) -> set[str] | None:
    """The names ``directory/run_files.json`` lists; None when there is no such file or it is not one of ours."""
    try:
        with open(os.path.join(directory, RUN_FILES), encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    names = data.get("names") if isinstance(data, dict) and data.get("written_by") == WRITTEN_BY else None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        return None
    return set(names)


def record(directory: str, names: Iterable[str]) -> None:
    """Adds ``names`` (entries of ``directory``, not paths) to its ``run_files.json``, creating it."""
    before = recorded(directory)
    after = (before or set()) | {n for n in names if n != RUN_FILES and os.sep not in n}
    if after == before:
        return
    path = os.path.join(directory, RUN_FILES)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"written_by": WRITTEN_BY, "format": FORMAT, "names": sorted(after)}, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
