"""Relative input paths in config files, for both launch habits.

The bundled configs name paths from the repository root (``llm/assets/tiny-prm``); PaddleNLP users run
``cd llm && python run_reward.py config/...`` with paths relative to ``llm/``. A relative input path is
looked up in the working directory first, then from the repository root, and the first that exists
is used. Outputs (``output_dir``) stay relative to the working directory.
"""

from __future__ import annotations

import difflib
import errno
import os
import stat

from llm.utils.errors import UserError

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def search_dirs() -> list[str]:
    """Where a relative input path is looked for, in order (duplicates removed)."""
    return list(dict.fromkeys([os.getcwd(), REPO_ROOT]))


def resolve_input_path(value: str) -> str | None:
    """The path ``value`` names: as given if absolute or found from the working directory, else from the
    repository root; None if it exists nowhere."""
    if os.path.isabs(value):
        return value if os.path.exists(value) else None
    for base in search_dirs():
        candidate = os.path.join(base, value)
        if os.path.exists(candidate):
            return value if base == os.getcwd() else candidate
    return None


def missing_reason(value: str) -> str:
    """Why ``value`` names nothing, for messages: a dangling symbolic link or a loop of links is said as such
    (``os.path.exists`` is false for both, which would otherwise read "does not exist")."""
    bases = [""] if os.path.isabs(value) else search_dirs()
    for base in bases:
        candidate = os.path.join(base, value) if base else value
        if os.path.islink(candidate):
            try:
                os.stat(candidate)
            except OSError as err:
                if err.errno == errno.ELOOP:
                    return f"is a loop of symbolic links ({candidate})"
            return f"is a symbolic link to {os.readlink(candidate)!r}, which does not exist ({candidate})"
    return f"does not exist (looked in: {tried(value)}){nearest_hint(value)}"


def nearest_hint(value: str) -> str:
    """``; did you mean 'x'?`` for the existing file or directory whose name is nearest to ``value``'s, beside
    where it was looked for (a typo such as ``prm_trian.jsonl``); empty when nothing is near."""
    folder, name = os.path.split(value)
    bases = [""] if os.path.isabs(value) else search_dirs()
    for base in bases:
        directory = os.path.join(base, folder) if base else folder
        try:
            names = os.listdir(directory or ".")
        except OSError:
            continue
        match = difflib.get_close_matches(name, names, n=1, cutoff=0.75)
        if match:
            return f"; did you mean {os.path.join(folder, match[0])!r}?"
    return ""


def tried(value: str) -> str:
    """The places looked at for ``value``, for an error message."""
    if os.path.isabs(value):
        return value
    return ", ".join(os.path.join(base, value) for base in search_dirs())


def resolve_paths(value: str, field: str, where: str, *, required: bool = True) -> str:
    """One path or comma-separated paths (data mixes), each resolved; a missing one stops the run naming
    ``field`` and every place tried (``required`` false: a missing path is left as given, e.g. a hub id)."""
    parts = []
    for part in value.split(","):
        part = part.strip()
        found = resolve_input_path(part) if part else None
        if found is None:
            if required:
                raise UserError(f"{where}: {field} {part!r} {missing_reason(part)}")
            found = part
        parts.append(found)
    return ",".join(parts)


def read_text_file(found: str, shown: str, max_bytes: int | None = None, why: str = "") -> str:
    """The text of the regular file ``found`` (``shown`` names it in messages). A FIFO, device or directory is
    refused, never waited on (opened without blocking, checked before reading); with ``max_bytes`` a larger file
    is refused unread (``why``: what the limit is for)."""
    try:
        _check_regular(os.stat(found), shown, max_bytes, why)  # a FIFO is not even opened
        with os.fdopen(os.open(found, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)), "rb") as f:
            _check_regular(os.fstat(f.fileno()), shown, max_bytes, why)  # replaced since the stat
            data = f.read(-1 if max_bytes is None else max_bytes + 1)
        if max_bytes is not None and len(data) > max_bytes:  # it grew since
            raise UserError(f"{shown}: is over {max_bytes:,} bytes, which is not read{why}")
        return data.decode("utf-8")
    except OSError as err:
        raise UserError(f"{shown}: cannot read it ({err})") from None
    except UnicodeDecodeError as err:
        raise UserError(f"{shown}: cannot read it, not UTF-8 text ({err})") from None


def _check_regular(info: os.stat_result, shown: str, max_bytes: int | None, why: str) -> None:
    if stat.S_ISDIR(info.st_mode):
        raise UserError(f"{shown}: is a directory, not a file: give the file itself")
    if not stat.S_ISREG(info.st_mode):
        kind = "a FIFO (named pipe)" if stat.S_ISFIFO(info.st_mode) else "a device or socket"
        raise UserError(f"{shown}: is {kind}, not a regular file; reading it could wait forever: give the file")
    if max_bytes is not None and info.st_size > max_bytes:
        raise UserError(f"{shown}: is {info.st_size:,} bytes; over {max_bytes:,} is not read{why}")
