"""One run per ``output_dir``, checked at start-up: the directory can be written, no other live run holds it,
and it does not hold another run's results unless the user said so.

- ``check_output_dir(path)``: ``output_dir`` (or, when it does not exist yet, its nearest existing parent)
  must be a directory this process can create files in; a file at that path, or a directory it cannot
  write, stops the run at once (``UserError``, exit 2) instead of at the first save.
- ``RunLock``: ``output_dir/.run.lock``, held with ``fcntl.flock`` for the life of the run and holding
  the holder's host, pid, start time and command line. A second run on the same directory stops at
  start-up naming the holder. The kernel releases a flock when its process dies however it dies (kill
  -9 included), so a lock file left by a killed run is stale: the next run takes it over with a warning
  naming the run that left it. Where the filesystem has no flock (some network mounts), the file is
  created with ``O_CREAT | O_EXCL`` and a lock whose holder is on this host and no longer alive is stale.
- ``run_guard(...)``: the context every entry point runs in. Signals first (``preemption.handle_signals``:
  SIGTERM before the first optimizer step stops the run at once), then the checks and the lock; the lock
  is released when the block ends: normally, by a ``UserError`` or any exception, or by SIGTERM (which
  ends in one of those). Under torchrun only global rank 0 takes the lock and looks at the directory;
  it broadcasts the outcome so that every rank stops with the same message (the process group exists
  by then: ``TrainingArguments`` creates it). PPO on Ray: the driver, the process running ``run_ppo.py``.

A non-empty ``output_dir``: first, a file no run of this project wrote (a user's config.json, tokenizer,
weights, notes: ``files_of_another_origin``) stops every run (evaluation-only too), whatever its options: a run
would replace files of the names it writes. What runs wrote is listed in ``output_dir/run_files.json``
(``llm.utils.run_files``). Besides what it lists, a run's own are: ``checkpoint-N`` and saves in progress
(``checkpoint-N.partial``, ``final.partial``), the lock, a subdirectory that is itself a run directory
(``run_pipeline.py``'s stages) and, in a run directory, the result files of ``RESULT_FILES``. A run directory of
a version before ``run_files.json`` is known by a checkpoint's ``checkpoint.json`` or by its
``final_model.json`` (which lists the final model's files). Then a directory holding a run's results
(``checkpoint-*``, a model, the trainer state; ``RUN_ARTEFACTS``) is refused for a training run unless
``resume_from_checkpoint`` continues that run or ``overwrite_output_dir: true`` says to start a new one there.
``overwrite_output_dir`` deletes nothing: files the new run writes replace the old ones of the same name, and
old ``checkpoint-*`` directories stay (the log names them). Telling "this run's own checkpoints" from "another
run's" is the job of the checkpoint markers (``llm.settings.fingerprint``): ``resume_from_checkpoint: auto`` is
to pick only checkpoints of this run; ``foreign_artefacts`` is the hook for that rule here.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import logging
import os
import re
import socket
import sys
import tempfile
from collections.abc import Iterator
from typing import Self

from llm.utils import preemption, run_files
from llm.utils.checkpoints import FINAL_MARKER, MARKER, checkpoint_dirs, checkpoint_problem
from llm.utils.errors import UserError

logger = logging.getLogger(__name__)

LOCK_NAME = ".run.lock"

# Names in an output_dir that a run wrote (its results, its checkpoints): another training run must not
# start over them without resume_from_checkpoint or overwrite_output_dir.
RUN_ARTEFACTS = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
    "adapter_model.safetensors",
    "trainer_state.json",
    "train_results.json",
    "all_results.json",
    "log_history.json",  # PPO
    "actor",  # PPO's final models
    "critic",
)


def check_output_dir(path: str | None, field: str = "output_dir") -> None:
    """``path`` can be created and written by this process; else a ``UserError`` naming it."""
    if not path:
        raise UserError(f"{field} is empty: set it to the directory the run writes to")
    full = os.path.abspath(path)
    if os.path.lexists(full) and not os.path.isdir(full):
        raise UserError(f"{field}={path}: {full} is a file, not a directory: remove it or choose another {field}")
    probe = full
    while not os.path.lexists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise UserError(f"{field}={path}: cannot create it, {probe} is a file, not a directory: choose another {field}")
    try:
        fd, name = tempfile.mkstemp(prefix=".write-test-", dir=probe)
        os.close(fd)
        os.unlink(name)
    except OSError as err:
        where = "it" if probe == full else f"{probe}, where it would be created"
        raise UserError(
            f"{field}={path}: cannot write in {where} ({err.strerror or err}): choose a directory you can write to"
        ) from None


def run_artefacts(output_dir: str) -> list[str]:
    """The names in ``output_dir`` that a run wrote (``checkpoint-*`` and ``RUN_ARTEFACTS``), sorted."""
    try:
        names = os.listdir(output_dir)
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = [n for n in names if n in RUN_ARTEFACTS or (n.startswith("checkpoint-") and n[11:].isdigit())]
    return sorted(found, key=lambda n: (not n.startswith("checkpoint-"), int(n[11:]) if n[11:].isdigit() else 0, n))


def foreign_artefacts(output_dir: str, fingerprint: str | None = None) -> list[str]:
    """What in ``output_dir`` belongs to another run. Today: every run artefact (``run_artefacts``); the hook
    for the checkpoint markers (``llm.settings.fingerprint``): with a ``fingerprint`` the files of a run with
    that fingerprint could be left out here."""
    return run_artefacts(output_dir)


# What a run writes beside its model outside the final save (results, per-example scores, the reward model's
# best-of-n plot, PPO's samples, TensorBoard's runs/): in a run directory they are the runs' own.
RESULT_FILES = (
    "all_results.json",
    "train_results.json",
    "eval_results.json",
    "eval_scores.jsonl",
    "eval_best_of_n.png",
    "samples.jsonl",
    "runs",
    FINAL_MARKER,
)
# a run's own whatever the directory: its lock, a checkpoint, a save in progress, a write test, a temporary file
_OWN_KIND = re.compile(r"^(checkpoint-\d+|checkpoint-\d+\.partial|final\.partial|\.write-test-.*|\.run\.lock)$")
_TEMPORARY = re.compile(r"^(.+)\.tmp\d+$")  # what an atomic JSON write leaves when killed


def run_directory_files(directory: str) -> set[str] | None:
    """The names runs of this project wrote in ``directory``; None when it is not a run directory."""
    names = run_files.recorded(directory)
    if names is None:
        names = _earlier_version_files(directory)
    return None if names is None else names | set(RESULT_FILES) | {run_files.RUN_FILES}


def _earlier_version_files(directory: str) -> set[str] | None:
    """A run directory written before ``run_files.json`` existed: its final model's files (``final_model.json``), or
    nothing more when a checkpoint with its marker shows it is one; None: not a run directory."""
    try:
        with open(os.path.join(directory, FINAL_MARKER), encoding="utf-8") as f:
            files = json.load(f).get("files")
        if isinstance(files, list):
            return {n for n in files if isinstance(n, str)}
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        pass
    if any(os.path.isfile(os.path.join(path, MARKER)) for _, path in checkpoint_dirs(directory)):
        return set()
    return None


def files_of_another_origin(output_dir: str) -> list[str]:
    """The entries of ``output_dir`` that no run of this project wrote (the module's docstring), sorted."""
    try:
        names = os.listdir(output_dir)
    except (FileNotFoundError, NotADirectoryError):
        return []
    own = run_directory_files(output_dir) or set()

    def ours(name: str) -> bool:
        if name in own or _OWN_KIND.match(name):
            return True
        temporary = _TEMPORARY.match(name)
        if temporary and (temporary.group(1) in own or temporary.group(1) == run_files.RUN_FILES):
            return True
        path = os.path.join(output_dir, name)
        return os.path.isdir(path) and not os.path.islink(path) and run_directory_files(path) is not None

    return sorted(n for n in names if not ours(n))


def check_own_directory(output_dir: str, field: str = "output_dir") -> None:
    """``output_dir`` holds nothing but what runs of this project wrote; else a ``UserError`` naming the rest."""
    found = files_of_another_origin(output_dir)
    if not found:
        return
    listed = ", ".join(found[:8]) + (f", ... ({len(found)} in all)" if len(found) > 8 else "")
    raise UserError(
        f"{field} {output_dir} holds files that no run of this project wrote ({listed}); a run writes its model, "
        f"tokenizer, config and results there and would replace files of the same names. Choose an empty or new "
        f"directory, or a subdirectory such as {os.path.join(output_dir, 'run')}"
    )


def claim(output_dir: str) -> None:
    """Records every entry now in ``output_dir`` as a run's (``llm.utils.run_files``): called once the checks
    have passed, and when the run ends."""
    names = [n for n in os.listdir(output_dir) if n != LOCK_NAME and not n.startswith(".write-test-")]
    run_files.record(output_dir, names)


def check_not_another_runs(output_dir: str, resume: str | None, overwrite: bool, field: str = "output_dir") -> None:
    """A training run does not start over another run's results unless resuming or told to overwrite."""
    if resume is not None and str(resume).lower() not in ("", "false", "none"):
        return
    found = foreign_artefacts(output_dir)
    if not found:
        return
    section = field.rpartition(".")[0] + "." if "." in field else ""  # PPO: "training."
    listed = ", ".join(found[:5]) + (f", ... ({len(found)} in all)" if len(found) > 5 else "")
    if overwrite:
        logger.warning(
            "overwrite_output_dir: %s already holds %s; this run writes over files of the same name and deletes "
            "nothing (old checkpoint-* directories stay)",
            output_dir,
            listed,
        )
        return
    raise UserError(
        f"{field} {output_dir} already holds another run's results ({listed}): set {section}resume_from_checkpoint "
        f"auto to continue that run, {section}overwrite_output_dir true to start a new run there (nothing is "
        f"deleted), or choose another {field}"
    )


# --- the lock ------------------------------------------------------------------------------


def _now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def _describe(holder: dict) -> str:
    host, pid, since = holder.get("host", "?"), holder.get("pid", "?"), holder.get("since", "?")
    return f"pid {pid} on host {host}, since {since}"


def _pid_alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, ValueError, TypeError):
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


class RunLock:
    """``output_dir/.run.lock`` held by this process (see the module's docstring)."""

    def __init__(self, output_dir: str) -> None:
        self.output_dir = output_dir
        self.path = os.path.join(output_dir, LOCK_NAME)
        self.fd: int | None = None
        self.stale: dict | None = None  # the holder of a stale lock taken over

    def _read(self, fd: int | None = None) -> dict:
        try:
            if fd is None:
                with open(self.path, encoding="utf-8") as f:
                    text = f.read()
            else:
                os.lseek(fd, 0, os.SEEK_SET)
                text = os.read(fd, 1 << 16).decode("utf-8", "replace")
            data = json.loads(text) if text.strip() else {}
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def _held_by(self, holder: dict) -> UserError:
        return UserError(
            f"output_dir {self.output_dir} is in use by another run: {_describe(holder)} (its lock: {self.path}). "
            "Wait for it to finish or stop it, or choose another output_dir; a lock whose run was killed is "
            "taken over by itself"
        )

    def acquire(self) -> Self:
        os.makedirs(self.output_dir, exist_ok=True)
        for _ in range(10):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = self._read(fd)
                os.close(fd)
                raise self._held_by(holder) from None
            except OSError as err:
                os.close(fd)
                if err.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    return self._acquire_exclusive()
                raise
            try:  # the holder before us may have removed the file between our open and our flock
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            previous = self._read(fd)
            if previous:
                self.stale = previous
            self.fd = fd
            self._write(fd)
            break
        else:
            raise UserError(f"output_dir {self.output_dir}: could not take the lock {self.path}: it keeps changing")
        self._warn_stale()
        return self

    def _acquire_exclusive(self) -> Self:
        """No flock on this filesystem: create the file exclusively; a dead holder on this host is stale."""
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                holder = self._read()
                if holder.get("host") == socket.gethostname() and not _pid_alive(holder.get("pid")):
                    self.stale = holder
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(self.path)
                    continue
                raise self._held_by(holder) from None
            self.fd = fd
            self._write(fd)
            self._warn_stale()
            return self
        raise UserError(f"output_dir {self.output_dir}: could not take the lock {self.path}")

    def _write(self, fd: int) -> None:
        info = {"host": socket.gethostname(), "pid": os.getpid(), "since": _now(), "argv": sys.argv}
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, (json.dumps(info) + "\n").encode())
        os.fsync(fd)

    def _warn_stale(self) -> None:
        if self.stale:
            logger.warning(
                "output_dir %s: taking over the lock left by a run that ended without releasing it (%s)",
                self.output_dir,
                _describe(self.stale),
            )

    def release(self) -> None:
        fd, self.fd = self.fd, None
        if fd is None:
            return
        with contextlib.suppress(OSError):
            os.unlink(self.path)  # while still locked: a waiting run sees the file gone and opens a new one
        with contextlib.suppress(OSError):
            os.close(fd)

    def __enter__(self) -> Self:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


# --- what every entry point runs in ---------------------------------------------------------


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def config_mismatch(config: dict | None) -> str | None:
    """On rank 0: the fields on which any process's ``config`` differs from rank 0's (None: all agree, or one
    process, or no process group). Every rank takes part (an all-gather)."""
    import torch.distributed as dist

    if config is None or not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return None
    configs: list = [None] * dist.get_world_size()
    dist.all_gather_object(configs, config)
    differing = []
    for rank, other in enumerate(configs[1:], start=1):
        for key in sorted(set(configs[0]) | set(other)):
            if configs[0].get(key) != other.get(key):
                differing.append(f"{key} (rank 0: {configs[0].get(key)!r}, rank {rank}: {other.get(key)!r})")
    if not differing:
        return None
    return (
        "the processes of this run were given different settings: "
        + "; ".join(differing[:8])
        + ("; ..." if len(differing) > 8 else "")
        + ": launch every rank with the same config file and overrides"
    )


def _share_outcome(error: str | None) -> str | None:
    """Rank 0's outcome (None or the error message) on every rank of the default process group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return error
    box = [error]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def check_something_to_resume(output_dir: str, resume: str | None, field: str = "output_dir") -> None:
    """``resume_from_checkpoint: auto`` with no checkpoint in ``output_dir`` stops here, before any model or data
    loads, saying how to start instead (a named checkpoint directory is checked where it is read)."""
    if resume is None or str(resume).lower() not in ("true", "auto", "last"):
        return
    skipped = []
    for _, path in checkpoint_dirs(output_dir):
        problem = checkpoint_problem(path)
        if problem is None:
            return
        skipped.append(f"{os.path.basename(path)} ({problem})")
    section = field.rpartition(".")[0] + "." if "." in field else ""
    why = f" (skipped: {'; '.join(skipped)})" if skipped else ""
    raise UserError(
        f"{section}resume_from_checkpoint={resume}: {field} {output_dir} holds no complete checkpoint to resume "
        f"from{why}: run without {section}resume_from_checkpoint to start afresh there"
    )


@contextlib.contextmanager
def run_guard(
    output_dir: str,
    resume: str | None = None,
    overwrite: bool = False,
    trains: bool = True,
    field: str = "output_dir",
    config: dict | None = None,
) -> Iterator[None]:
    """The start-up checks and the lock for the life of a run (see the module's docstring). ``trains``: the run
    writes checkpoints and a model (a training run), so another run's results in ``output_dir`` are refused.
    ``field``: the config's name of ``output_dir``, for the messages. ``config``: this process's settings (field ->
    JSON value); processes of one torchrun given different ones stop here, naming the fields, instead of hanging
    later in a collective that only some of them reach."""
    with preemption.handle_signals():
        check_output_dir(output_dir, field)  # every rank: each writes its own shards
        lock = None
        claimed = False
        error = config_mismatch(config)
        if _rank() == 0 and error is None:
            try:
                lock = RunLock(output_dir).acquire()
                check_own_directory(output_dir, field)
                if trains:
                    check_not_another_runs(output_dir, resume, overwrite, field)
                    check_something_to_resume(output_dir, resume, field)
                claim(output_dir)
                claimed = True
            except UserError as err:
                error = str(err)
            except Exception as err:  # noqa: BLE001 - the other ranks must never wait for an outcome that never comes
                error = f"output_dir {output_dir}: {type(err).__name__}: {err}"
        try:
            error = _share_outcome(error)
            if error is not None:
                raise UserError(error)
            preemption.on_hard_exit(lock.release if lock is not None else None)
            yield
        finally:
            preemption.on_hard_exit(None)
            if claimed:  # what the run wrote beside its saves (results, logs); a full disk may refuse it
                with contextlib.suppress(OSError):
                    claim(output_dir)
            if lock is not None:
                lock.release()
