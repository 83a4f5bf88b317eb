"""Where records come from: file formats read record by record, record locations for messages, ``map_keys``.

Files
    ``.json`` / ``.jsonl``: a JSON list of objects or JSON lines (one object per line). The first
    non-blank character decides (``[`` = list), whatever the extension. Both are read
    incrementally (lines one at a time, lists by chunks with ``JSONDecoder.raw_decode``), so
    eager and lazy reading run the same code and neither calls ``json.load`` on a whole file.
    Blank lines in JSON lines are not records and do not count. ``.parquet``: read by record
    batches with pyarrow. A directory: a Hugging Face dataset saved with ``save_to_disk``
    (``Dataset``, or ``DatasetDict`` whose ``"train"`` split is used), read in batches from its
    memory-mapped Arrow files. A value ``null`` (Arrow fills absent columns with it) counts as
    an absent field.

Renaming (``map_keys``)
    ``{"field this project reads": "column in the data"}`` renames columns of every record as it is
    read (MindSpeed-LLM's ``--map-keys``), e.g. ``{"src": "question", "tgt": "answer"}``: the field
    takes that column's value and a column already carrying the field's own name is ignored. Each
    key must be a field of the kind (:data:`FIELDS`); every record must have each mapped column (a
    null value counts as an absent field), else the run stops naming file, record and column.
"""

from __future__ import annotations

import json
import logging
import os
import re
import stat
from collections.abc import Iterator
from typing import Any, NoReturn

from llm.data.readers.records import FIELDS, SUPPORTED_FORMATS
from llm.utils.errors import UserError, closest
from llm.utils.paths import missing_reason

logger = logging.getLogger(__name__)

_JSON_CHUNK = 1 << 20  # characters read at a time from a JSON list
_BATCH = 1024  # rows per Arrow batch


# --------------------------------------------------------------------------------------------
# Raw readers: yield (line or None, object) per record
# --------------------------------------------------------------------------------------------


class RecordPlace:
    """Where a record is, for error messages."""

    __slots__ = ("index", "line", "names", "path")

    def __init__(self, path: str, index: int, line: int | None, names: dict[str, str] | None = None) -> None:
        self.path, self.index, self.line = path, index, line
        self.names = names or {}  # map_keys: field -> column, so that messages name the user's column too

    def __str__(self) -> str:
        return f"{self.path}: record {self.index}" + (f" (line {self.line})" if self.line is not None else "")

    def fail(self, field: str | None, problem: str, fix: str) -> NoReturn:
        place = f"{self}, field '{field}'" if field else str(self)
        if field in self.names:
            place += f" (column '{self.names[field]}' by map_keys)"
        raise UserError(f"{place}: {problem}. Fix: {fix}")


def detect_format(path: str) -> str:
    if os.path.isdir(path):
        return "hf"
    if not os.path.exists(path):
        raise UserError(f"data file {path} {missing_reason(path)}; supported formats: {SUPPORTED_FORMATS}")
    if stat.S_ISFIFO(os.stat(path).st_mode):
        # accepted on purpose (process substitution, a pipe from a decompressor): reading blocks until a writer comes
        logger.warning("data file %s is a FIFO (named pipe): reading waits until a program writes into it", path)
    ext = os.path.splitext(path)[1].lower()
    if ext in (".json", ".jsonl"):
        return "json"
    if ext == ".parquet":
        return "parquet"
    raise UserError(
        f"data file {path} has an unsupported extension {ext or '(none)'!r}; supported formats: {SUPPORTED_FORMATS}"
    )


def iter_raw(path: str, fmt: str) -> Iterator[tuple[int | None, Any]]:
    if fmt == "json":
        return _iter_json(path)
    if fmt == "parquet":
        return _iter_parquet(path)
    return _iter_hf(path)


def _open_text(path: str):
    # utf-8-sig drops a byte-order mark; newline=None keeps universal newlines for line numbers
    return open(path, encoding="utf-8-sig")


def _decode_error(path: str, err: UnicodeDecodeError) -> UserError:
    return UserError(f"{path}: the file is not valid UTF-8 text ({err}). Fix: save the file as UTF-8")


def _first_char(path: str) -> str:
    try:
        with _open_text(path) as f:
            while chunk := f.read(4096):
                stripped = chunk.lstrip()
                if stripped:
                    return stripped[0]
    except UnicodeDecodeError as err:
        raise _decode_error(path, err) from None
    return ""


def _iter_json(path: str) -> Iterator[tuple[int | None, Any]]:
    if _first_char(path) == "[":
        yield from _iter_json_list(path)
    else:
        yield from _iter_json_lines(path)


def _iter_json_lines(path: str) -> Iterator[tuple[int | None, Any]]:
    index = 0
    with _open_text(path) as f:
        line_no = 0
        while True:
            try:
                line = f.readline()
            except UnicodeDecodeError as err:
                raise _decode_error(path, err) from None
            if not line:
                return
            line_no += 1
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                RecordPlace(path, index, line_no).fail(
                    None,
                    f"invalid JSON at column {err.colno}: {err.msg}",
                    "a JSON lines file holds one complete JSON object per line; a .json file may instead "
                    "hold a JSON list of objects ([{...}, {...}])",
                )
            yield line_no, obj
            index += 1


_WS = re.compile(r"[ \t\n\r]*")


class _JsonListReader:
    """Streams the elements of a top-level JSON list, chunk by chunk, tracking line numbers."""

    def __init__(self, f, path: str) -> None:
        self.f, self.path = f, path
        self.buf, self.pos, self.eof = "", 0, False
        self.line, self.col = 1, 0  # line and 0-based column of buf[0]
        self.decoder = json.JSONDecoder()

    def _more(self, size: int | None = None) -> bool:
        if self.eof:
            return False
        try:
            data = self.f.read(size or _JSON_CHUNK)
        except UnicodeDecodeError as err:
            raise _decode_error(self.path, err) from None
        if not data:
            self.eof = True
            return False
        done = self.buf[: self.pos]
        newline = done.rfind("\n")
        self.line += done.count("\n")
        self.col = len(done) - newline - 1 if newline >= 0 else self.col + len(done)
        self.buf, self.pos = self.buf[self.pos :] + data, 0
        return True

    def where(self, pos: int) -> tuple[int, int]:
        newline = self.buf.rfind("\n", 0, pos)
        col = pos - newline - 1 if newline >= 0 else self.col + pos
        return self.line + self.buf.count("\n", 0, pos), col + 1

    def peek(self) -> str:
        """Skip whitespace; the next character, or "" at the end of the file."""
        while True:
            self.pos = _WS.match(self.buf, self.pos).end()
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if not self._more():
                return ""

    def error(self, problem: str, index: int | None = None) -> NoReturn:
        line, col = self.where(self.pos)
        at = f"record {index} " if index is not None else ""
        raise UserError(
            f"{self.path}: {at}(line {line}, column {col}): invalid JSON: {problem}. Fix: a .json file holds "
            "a JSON list of objects ([{...}, {...}]) or one JSON object per line"
        )

    def value(self, index: int) -> Any:
        size = _JSON_CHUNK
        while True:
            try:
                obj, end = self.decoder.raw_decode(self.buf, self.pos)
            except json.JSONDecodeError as err:
                # a value cut by the chunk end fails near the end (or as an unterminated string)
                truncated = err.pos >= len(self.buf) - 16 or err.msg.startswith("Unterminated string")
                if truncated and self._more(size):
                    size *= 2
                    continue
                self.pos = err.pos
                self.error(err.msg, index)
            if end == len(self.buf) and self._more(size):  # e.g. a number that continues
                size *= 2
                continue
            self.pos = end
            return obj

    def __iter__(self) -> Iterator[tuple[int | None, Any]]:
        self.peek()
        self.pos += 1  # the "["
        index = 0
        if self.peek() == "]":
            self.pos += 1
        else:
            while True:
                if self.peek() == "":
                    self.error("the list is not closed with ']'", index)
                line = self.where(self.pos)[0]
                yield line, self.value(index)
                index += 1
                sep = self.peek()
                if sep == "]":
                    self.pos += 1
                    break
                if sep != ",":
                    self.error("expected ',' or ']' after a list element" if sep else "the list is not closed with ']'")
                self.pos += 1
                if self.peek() == "]":
                    self.error("trailing comma before ']'")
        if self.peek() != "":
            self.error("extra data after the end of the JSON list")


def _iter_json_list(path: str) -> Iterator[tuple[int | None, Any]]:
    with _open_text(path) as f:
        yield from _JsonListReader(f, path)


def _iter_parquet(path: str) -> Iterator[tuple[int | None, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        batches = pq.ParquetFile(path).iter_batches(batch_size=_BATCH)
    except (pa.ArrowException, OSError, ValueError) as err:
        raise UserError(f"{path}: cannot read the file as Parquet ({err}). Fix: give a valid .parquet file") from None
    while True:
        try:
            batch = next(batches, None)
        except (pa.ArrowException, OSError, ValueError) as err:
            raise UserError(f"{path}: the Parquet file is corrupt ({err}). Fix: rewrite the file") from None
        if batch is None:
            return
        for row in batch.to_pylist():
            yield None, row


def _iter_hf(path: str) -> Iterator[tuple[int | None, Any]]:
    import datasets
    import pyarrow as pa

    try:
        ds = datasets.load_from_disk(path)
    except IndexError:  # datasets cannot load a saved data set without rows (no Arrow files): no records
        return
    except (pa.ArrowException, OSError, ValueError, KeyError) as err:
        raise UserError(
            f"{path}: the directory is not a Hugging Face dataset written by save_to_disk ({err}); "
            f"supported formats: {SUPPORTED_FORMATS}"
        ) from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise UserError(
                f"{path}: the DatasetDict has no 'train' split (splits: {', '.join(ds)}). Fix: point to the split "
                f"directory itself (e.g. {os.path.join(path, next(iter(ds), 'SPLIT'))}) or save the data as 'train'"
            )
        ds = ds["train"]
    for batch in ds.with_format(None).iter(batch_size=_BATCH):
        columns = list(batch)
        for values in zip(*(batch[c] for c in columns)):
            yield None, dict(zip(columns, values))


# --------------------------------------------------------------------------------------------
# Renaming (map_keys)
# --------------------------------------------------------------------------------------------


def check_map_keys(map_keys: dict[str, str] | None, kind: str) -> dict[str, str]:
    if map_keys is None:
        return {}
    example = '{"src": "question", "tgt": "answer"}'
    if not isinstance(map_keys, dict):
        raise UserError(
            f"map_keys {map_keys!r} is invalid: give an object "
            f'{{"field this project reads": "column in your data"}}, e.g. {example}'
        )
    fields = FIELDS[kind]
    for field, column in map_keys.items():
        if not isinstance(field, str) or not isinstance(column, str) or not column:
            raise UserError(
                f"map_keys {map_keys!r}: {field!r}: {column!r} is invalid: map each field name to the name "
                f"of a column (non-empty strings), e.g. {example}"
            )
        if field not in fields:
            raise UserError(
                f"map_keys {map_keys!r}: {field!r} is not a field of {kind!r} records (closest: "
                f"{closest(field, fields)}); the keys are the field names this project reads "
                f"({', '.join(fields)}) and the values the columns of your data"
            )
    return dict(map_keys)


def rename(rec: dict, names: dict[str, str], where: RecordPlace) -> dict:
    """``map_keys``: each field takes its column's value; the mapped columns and any column that already
    carries a mapped field's name are dropped, so the renaming is simultaneous (a swap works)."""
    for field, column in names.items():
        if column not in rec:
            have = ", ".join(repr(k) for k in rec) or "none"
            where.fail(
                field,
                f"the record has no column {column!r} (it has: {have})",
                f"correct map_keys ({{{field!r}: <one of the record's columns>}}) or add the column to the data",
            )
    out = {k: v for k, v in rec.items() if k not in names and k not in names.values()}
    out.update({field: rec[column] for field, column in names.items()})
    return out
