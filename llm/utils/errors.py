"""User-facing errors: one clear message and exit code 2, never a traceback."""

from __future__ import annotations

import difflib
import errno
import sys
from collections.abc import Callable, Iterable


class UserError(ValueError):
    """Bad configuration or bad data. The message names the file, record/field and the fix."""


class DiskFull(UserError):
    """A full disk, reported by a process that wrote part of a save (``llm.utils.disk_full``)."""


DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# how a full disk reads when the error is not an OSError (safetensors' Rust writer, an error wrapping one)
DISK_FULL_TEXTS = ("No space left on device", "Disk quota exceeded", "os error 28", "os error 122")


def is_disk_full(err: BaseException | None) -> bool:
    """Whether ``err``, or an error it was raised from, is a full disk or an exceeded quota."""
    for _ in range(8):  # a chain of causes; never a loop
        if err is None:
            return False
        if isinstance(err, DiskFull) or (isinstance(err, OSError) and err.errno in DISK_FULL_ERRNOS):
            return True
        if not isinstance(err, OSError) and any(text in str(err) for text in DISK_FULL_TEXTS):
            return True
        err = err.__cause__ or err.__context__
    return False


def closest(name: str, candidates: Iterable[str], n: int = 3) -> str:
    """Human-readable list of the valid names closest to ``name``."""
    matches = difflib.get_close_matches(name, list(candidates), n=n, cutoff=0.5)
    return ", ".join(repr(m) for m in matches) if matches else "(no close match)"


def run_cli(main: Callable[[list[str] | None], object], argv: list[str] | None = None) -> None:
    """Run an entry point; a UserError prints its message and exits with status 2. A finished distributed run
    meets at a barrier and closes its process group: a rank that exits while another still holds gloo
    connections to it can make that one abort at interpreter exit (SIGABRT, seen under load in CI).
    A run stopped by SIGTERM before it had anything to save (``llm.utils.preemption.StoppedBySignal``) prints
    one line and exits with 128 + the signal number, without the barrier (the other ranks stop on their own).
    A full disk (ENOSPC) is one message and exit 2 too: a save reports it itself (``llm.utils.disk_full``); any other
    write (results, logs) here: every save is written aside and renamed when complete, so what is left is whole
    and the run resumes from it."""
    from llm.utils.preemption import StoppedBySignal

    try:
        main(argv)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
    except Exception as err:
        if not is_disk_full(err):
            raise
        print(
            f"error: no space left on device writing {getattr(err, 'filename', None) or 'a file'}: free space, then "
            "run again with "
            "resume_from_checkpoint auto (an unfinished save is never resumed from; the last complete "
            "checkpoint is)",
            file=sys.stderr,
            flush=True,
        )
        sys.exit(2)
    except StoppedBySignal as err:
        print(str(err), file=sys.stderr, flush=True)
        sys.exit(err.exit_code)
    except KeyboardInterrupt:  # Ctrl-C before the run's own handler is installed (imports, argument parsing)
        print("interrupted (Ctrl-C) before the run started: nothing to save", file=sys.stderr, flush=True)
        sys.exit(130)
    close_process_group()


def close_process_group() -> None:
    import torch.distributed as dist

    # world of one: no peer to wait for, and the group may be another library's (vLLM in-process makes one)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
        dist.destroy_process_group()
