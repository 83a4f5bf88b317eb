"""A full disk during a save: one message, the unfinished save removed, nothing complete lost.

Every save is written aside (``checkpoint-N.partial``, ``output_dir/final.partial``: ``llm.utils.checkpoints``)
and renamed into place only when complete, so a save that runs out of space leaves every complete checkpoint and
the previous final model whole. ``saving(...)`` wraps a save: a full disk (ENOSPC, or EDQUOT: a quota), whether
raised as an ``OSError``, as safetensors' ``SafetensorError`` ("... No space left on device (os error 28)"), as
torch.distributed.checkpoint's ``CheckpointException`` (the sharded state), or as torch's writer's RuntimeError
on a filesystem left with under 1 MiB free (its message does not say why), removes what the save had written
(giving that space back) and becomes one ``UserError`` (exit 2) naming the directory, what the save needs where
that is known, what is free, and the last complete checkpoint to resume from. ``disk_full_as_error`` is for the
processes that write parts of a save without knowing the run (PPO's roles on Ray): it turns the error into a
``DiskFull``, which crosses to the driver as itself.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator

from llm.utils.checkpoints import checkpoint_dirs, checkpoint_problem, read_marker
from llm.utils.errors import DiskFull, UserError, is_disk_full

NEARLY_FULL = 1 << 20  # bytes free under which a save's failure is taken for a full disk (the module docstring)


@contextlib.contextmanager
def disk_full_as_error(directory: str) -> Iterator[None]:
    """A full disk while writing into ``directory`` becomes a ``DiskFull`` (the rest passes unchanged)."""
    try:
        yield
    except DiskFull:
        raise
    except Exception as err:
        if not is_disk_full(err):
            raise
        raise DiskFull(f"no space left on device writing {directory}") from None


def no_space_left(directory: str) -> bool:
    """Whether the filesystem of ``directory`` is (all but) full: how torch's writer fails there says nothing of
    the cause ("RuntimeError: [enforce fail at inline_container.cc] unexpected pos ...")."""
    try:
        return shutil.disk_usage(directory).free < NEARLY_FULL
    except OSError:
        return False


def size_of(path: str) -> int:
    """Bytes of the files under ``path`` (0 when it is gone)."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    total = 0
    for root, _, names in os.walk(path):
        for name in names:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def human(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def last_complete_checkpoint(output_dir: str) -> tuple[str, int] | None:
    """The newest complete checkpoint in ``output_dir`` and its size in bytes (from its marker), or None."""
    for _, path in checkpoint_dirs(output_dir):
        if checkpoint_problem(path) is None:
            marker = read_marker(path) or {"files": {}}
            return path, sum(v for v in marker["files"].values() if isinstance(v, int))
    return None


def disk_full_message(output_dir: str, what: str, written: int, field: str = "output_dir") -> str:
    """The message of a save of ``what`` into ``output_dir`` that filled the disk after ``written`` bytes."""
    section = field.rpartition(".")[0] + "." if "." in field else ""
    try:
        free = f"{human(shutil.disk_usage(output_dir).free)} free there now"
    except OSError:
        free = "the free space unknown"
    last = last_complete_checkpoint(output_dir)
    sized = last is not None and last[1] and what.startswith("checkpoint-")  # the final model's size is not known
    need = f"; a complete checkpoint of this run takes {human(last[1])}" if sized else ""
    head = (
        f"no space left on device saving {what} in {field} {output_dir} (it had written {human(written)}{need}; "
        f"{free}); the unfinished save was removed. Free space, or point {field} elsewhere"
    )
    if last is None:
        return f"{head}: there is no complete checkpoint to resume from, the run starts afresh"
    return (
        f"{head}; the last complete checkpoint is {last[0]}: with the space freed {section}resume_from_checkpoint "
        f"auto continues from it (in another {field}: {section}resume_from_checkpoint {last[0]})"
    )


@contextlib.contextmanager
def saving(output_dir: str, partial: str, what: str, is_main: bool = True, field: str = "output_dir") -> Iterator[None]:
    """A save of ``what`` (``checkpoint-4``, ``the final model``) into ``partial``, a directory written aside in
    ``output_dir``: a full disk removes ``partial`` (the main process) and raises one ``UserError``."""
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException: the sharded state's writer

    try:
        yield
    except (Exception, CheckpointException) as err:
        if not (is_disk_full(err) or (isinstance(err, (OSError, RuntimeError)) and no_space_left(output_dir))):
            raise
        written = size_of(partial)
        if is_main:
            shutil.rmtree(partial, ignore_errors=True)
        raise UserError(disk_full_message(output_dir, what, written, field)) from None
