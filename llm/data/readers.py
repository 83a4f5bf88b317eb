"""Read and validate alignment data: PRM steps, preference pairs, PPO prompts and SFT conversations.

Every record is checked when it is read. A problem raises :class:`UserError` whose message
names the file, the record number (0-based; for JSON text also the 1-based line it starts on),
the field and the fix. No record is ever dropped silently.

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

Schemas (``kind``)
    ``"prm"``: PaddleNLP ``{"src", "tgt", "responses": [step...], "labels": ["+", "-"...]}`` or TRL
    stepwise ``{"prompt", "completions": [step...], "labels": [true, false...]}``. A label may
    be a reward token or a boolean in either format (true = first token, false = second).
    Math-Shepherd comes in two layouts without a separate prompt (``PRMRecord.prompt`` is
    empty; the question starts the first step): PaddleNLP's conversion ``{"src": [""], "tgt": [],
    "responses": ["<question> Step 1: ...", "Step 2: ..."], "labels"}`` and the Hugging Face rows
    ``{"input": "<question> Step 1: ... ки\\nStep 2: ... ки", "label": <the same text with "+" or
    "-" in place of each ки>}``: ``input`` is split at the placeholder into steps (stripped) and
    each label is the reward token that replaces that placeholder in ``label``.
    ProcessBench (Qwen) ``{"id", "generator", "problem", "steps": [...], "label": <index of the
    earliest wrong step, or -1>, "final_answer_correct"}``: the problem is the user turn; the steps
    before ``label`` are labelled correct, the step at ``label`` wrong, and the later ones carry no
    label (``None``: scored, but in no loss or step metric); ``PRMRecord.first_error`` keeps the label,
    ``subset`` the record's ``subset`` field or the prefix of an ``id`` like ``"gsm8k-12"``.
    Best-of-N candidates: any PRM layout with ``answer`` (the final answer) and ``correct`` (a boolean)
    is one candidate of its problem's group (``group`` when given, else the prompt and question text);
    such a record may leave out ``labels`` (its steps are then unlabelled).
    ``"pair"``: PaddleNLP ``{"src", "tgt", "response": [r0, r1], "sort": [s0, s1]}`` (higher sort
    = chosen) or TRL ``{"prompt", "chosen", "rejected"}``. In TRL form ``chosen``/``rejected`` may
    be strings or message lists; of a message list the last message (role assistant) is the
    answer. Without ``prompt`` (TRL "implicit prompt"), chosen and rejected must be full
    conversations that share every message before the last; that shared part is the prompt.
    ``"prompt"``: ``{"src", "tgt"}`` or ``{"prompt", "reference" | "answer" | "tgt"}`` (first one
    present wins; a number is turned into a string). For ``src`` with n turns, ``tgt`` may hold
    n-1 turns (history only, no reference) or n turns (history, then the reference answer);
    a ``reference``/``answer`` field is used when ``tgt`` gives none.
    ``"sft"``: PaddleNLP ``{"src", "tgt"}`` with as many ``tgt`` turns as ``src`` turns (each user
    turn followed by its answer; a single turn may be two strings) or TRL conversational
    ``{"messages": [{"role", "content"}...]}``: an optional leading system message, then a user
    turn first and an assistant turn last. Every assistant turn is an answer to train on.

Prompts
    ``src`` is a string (one user turn) or a list of user turns and ``tgt`` the assistant turns
    between them: the prompt is src[0] (user), tgt[0] (assistant), src[1] (user), ... so for
    prm/pair ``src`` has exactly one turn more than ``tgt`` (``tgt: []`` or absent for a single
    turn). A TRL ``prompt`` is a string (one user turn) or a list of ``{"role", "content"}``
    messages ending with a user turn. An optional ``"system"`` string becomes a leading system
    message. Texts are kept as they are; they are only checked not to be blank.

Mixing (:func:`load_dataset_records`)
    ``paths`` is one path or comma-separated paths. Without ``probs`` the files are concatenated
    in order. With ``probs`` the sources are interleaved with exactly the semantics of
    ``datasets.interleave_datasets(ds, probabilities=probs, seed=seed,
    stopping_strategy="all_exhausted")``: the algorithm is reimplemented (no Arrow round trip)
    with the same ``numpy.random.default_rng(seed)`` draws in blocks of 1000, so the order is
    identical to the Hugging Face one, and identical between eager and lazy mode. A source is
    restarted from its beginning when it runs out, and the output stops right after the last
    source with probability > 0 has been read to the end once. A source with probability 0 is
    never read (Hugging Face raises for it instead). Records keep ``source``/``index``.

Renaming (``map_keys``)
    ``{"field this project reads": "column in the data"}`` renames columns of every record as it is
    read (MindSpeed-LLM's ``--map-keys``), e.g. ``{"src": "question", "tgt": "answer"}``: the field
    takes that column's value and a column already carrying the field's own name is ignored. Each
    key must be a field of the kind (:data:`FIELDS`); every record must have each mapped column (a
    null value counts as an absent field), else the run stops naming file, record and column.

Lazy mode
    ``lazy=True`` returns an iterator that reads and validates as it goes, in constant memory.
    It does not shuffle: records come in file order (interleaved as above when mixing), and
    eager reading returns exactly the same sequence.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from llm.utils.errors import UserError, closest
from llm.utils.paths import tried

Message = dict  # {"role": "system" | "user" | "assistant", "content": str}

KINDS = ("prm", "pair", "prompt", "sft")
ROLES = ("system", "user", "assistant")
SUPPORTED_FORMATS = (
    ".json (a JSON list of objects, or JSON lines), .jsonl (JSON lines), .parquet, "
    "or a Hugging Face dataset directory written by save_to_disk (Dataset, or DatasetDict with a 'train' split)"
)
FORMATS = {
    "prm": 'PaddleNLP {"src", "tgt", "responses": [steps], "labels": [reward tokens]} '
    '(src [""] when the question starts the first step), TRL stepwise {"prompt", "completions": [steps], '
    '"labels": [true/false]} or Math-Shepherd {"input": "<steps, each ending with the placeholder>", '
    '"label": "<input with a reward token in place of each placeholder>"}',
    "pair": 'PaddleNLP {"src", "tgt", "response": [r0, r1], "sort": [s0, s1]} or TRL {"prompt", "chosen", "rejected"}',
    "prompt": 'PaddleNLP {"src", "tgt" (optional reference)} or {"prompt", "reference" or "answer" (optional)}',
    "sft": 'PaddleNLP {"src": [user turns], "tgt": [one answer per user turn]} '
    'or TRL conversational {"messages": [{"role", "content"}, ...]}',
}

# The fields each kind reads (the names map_keys may map onto).
FIELDS = {
    "prm": (
        "src",
        "tgt",
        "system",
        "responses",
        "labels",
        "prompt",
        "completions",
        "input",
        "label",
        "problem",
        "steps",
        "id",
        "generator",
        "subset",
        "final_answer_correct",
        "answer",
        "correct",
        "group",
    ),
    "pair": ("src", "tgt", "system", "response", "sort", "prompt", "chosen", "rejected"),
    "prompt": ("src", "tgt", "system", "prompt", "reference", "answer"),
    "sft": ("src", "tgt", "system", "messages"),
}

_JSON_CHUNK = 1 << 20  # characters read at a time from a JSON list
_BATCH = 1024  # rows per Arrow batch


@dataclass
class PRMRecord:
    """Process reward (Math-Shepherd) record."""

    # conversation before the answer, in order, ends with a user turn; empty when the record has no
    # separate prompt (Math-Shepherd layouts: the question starts the first step)
    prompt: list[Message]
    steps: list[str]
    labels: list[str | None]  # each one of reward_tokens, or None (unlabelled); len == len(steps)
    source: str  # file path it came from
    index: int  # 0-based record number in that file
    first_error: int | None = None  # ProcessBench: the earliest wrong step, -1 when all are right
    subset: str | None = None  # ProcessBench subset (gsm8k, math, ...)
    generator: str | None = None  # the model that wrote the solution
    group: str | None = None  # best-of-N: the problem this candidate answers
    answer: str | None = None  # best-of-N: its final answer
    correct: bool | None = None  # best-of-N: whether that answer is right


@dataclass
class PairRecord:
    """Preference pair (ORM / DPO)."""

    prompt: list[Message]
    chosen: str
    rejected: str
    source: str
    index: int


@dataclass
class PromptRecord:
    """PPO prompt with an optional reference answer."""

    prompt: list[Message]
    reference: str | None
    source: str
    index: int


@dataclass
class SFTRecord:
    """Supervised fine-tuning conversation; every assistant message is a training target."""

    messages: list[Message]  # optional system message, then starts with a user turn, ends with an assistant turn
    source: str
    index: int


Record = PRMRecord | PairRecord | PromptRecord | SFTRecord


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def iter_records(
    path: str,
    kind: str,
    *,
    reward_tokens: str | Sequence[str] = ("+", "-"),
    placeholder: str = "ки",
    map_keys: dict[str, str] | None = None,
) -> Iterator[Record]:
    """Stream the validated records of one file, in file order, in constant memory.

    Arguments, path and format are checked at once; records are read and checked as the
    iterator advances. An empty file raises when the iterator reaches its end.
    """
    kind = _check_kind(kind)
    tokens = _check_reward_tokens(reward_tokens)
    placeholder = _check_placeholder(placeholder)
    names = _check_map_keys(map_keys, kind)
    path = os.fspath(path)
    fmt = _detect_format(path)
    return _iter_validated(path, fmt, kind, tokens, placeholder, names)


def read_records(
    path: str,
    kind: str,
    *,
    reward_tokens: str | Sequence[str] = ("+", "-"),
    placeholder: str = "ки",
    map_keys: dict[str, str] | None = None,
) -> list[Record]:
    """Read and validate every record of one file."""
    return list(iter_records(path, kind, reward_tokens=reward_tokens, placeholder=placeholder, map_keys=map_keys))


def load_dataset_records(
    paths: str | Sequence[str],
    kind: str,
    *,
    probs: str | Sequence[float] | None = None,
    seed: int = 42,
    lazy: bool = False,
    reward_tokens: str | Sequence[str] = ("+", "-"),
    placeholder: str = "ки",
    map_keys: dict[str, str] | None = None,
) -> list[Record] | Iterator[Record]:
    """Read one or several data sets (comma-separated ``paths``), mixed by ``probs`` if given.

    Eager mode reads and validates every file before returning. ``lazy=True`` returns an
    iterator (no shuffling) that yields the same sequence while reading as it goes.
    ``map_keys`` renames the columns of every file's records (see the module docstring).
    """
    kind = _check_kind(kind)
    tokens = _check_reward_tokens(reward_tokens)
    placeholder = _check_placeholder(placeholder)
    names = _check_map_keys(map_keys, kind)
    path_list = _split_paths(paths)
    weights = _parse_probs(probs, path_list) if probs is not None else None
    formats = [_detect_format(p) for p in path_list]

    def opener(i: int) -> Callable[[], Iterator[Record]]:
        return lambda: _iter_validated(path_list[i], formats[i], kind, tokens, placeholder, names)

    if lazy:
        if weights is None:
            return _chain([opener(i) for i in range(len(path_list))])
        return _interleave([opener(i) for i in range(len(path_list))], weights, seed)

    if weights is None:
        return [rec for i in range(len(path_list)) for rec in opener(i)()]
    loaded = [list(opener(i)()) if weights[i] > 0 else [] for i in range(len(path_list))]
    return list(_interleave([_list_opener(recs) for recs in loaded], weights, seed))


# --------------------------------------------------------------------------------------------
# Argument checks
# --------------------------------------------------------------------------------------------


def _check_kind(kind: str) -> str:
    if kind not in KINDS:
        raise UserError(
            f"unknown data kind {kind!r}; use one of {', '.join(map(repr, KINDS))} "
            f"(closest: {closest(str(kind), KINDS)})"
        )
    return kind


def _check_reward_tokens(reward_tokens: str | Sequence[str]) -> tuple[str, str]:
    tokens = reward_tokens.split(",") if isinstance(reward_tokens, str) else list(reward_tokens)
    if len(tokens) != 2 or not all(isinstance(t, str) and t for t in tokens) or tokens[0] == tokens[1]:
        raise UserError(
            f"reward_tokens {reward_tokens!r} is invalid: give exactly two different non-empty tokens, "
            'first positive then negative, e.g. "+,-"'
        )
    return tokens[0], tokens[1]


def _check_placeholder(placeholder: str) -> str:
    if not isinstance(placeholder, str) or not placeholder:
        raise UserError(f'placeholder {placeholder!r} is invalid: give a non-empty string, e.g. "ки"')
    return placeholder


def _check_map_keys(map_keys: dict[str, str] | None, kind: str) -> dict[str, str]:
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


def _split_paths(paths: str | Sequence[str]) -> list[str]:
    if isinstance(paths, (str, os.PathLike)):
        parts = [p.strip() for p in os.fspath(paths).split(",")]
    else:
        parts = [os.fspath(p).strip() for p in paths]
    if not parts or any(not p for p in parts):
        raise UserError(
            f"data paths {paths!r} contain an empty entry: give one path or comma-separated paths "
            '("a.jsonl,b.parquet") without empty items'
        )
    return parts


def _parse_probs(probs: str | Sequence[float], paths: list[str]) -> list[float]:
    items: list[Any] = probs.split(",") if isinstance(probs, str) else list(probs)
    values = []
    for item in items:
        try:
            value = float(item.strip() if isinstance(item, str) else item)
        except (TypeError, ValueError):
            raise UserError(
                f'probabilities {probs!r}: {item!r} is not a number; give one number per data path, e.g. "0.7,0.3"'
            ) from None
        if not math.isfinite(value) or value < 0:
            raise UserError(f"probabilities {probs!r}: {item!r} must be a finite number >= 0")
        values.append(value)
    if len(values) != len(paths):
        raise UserError(
            f"probabilities {probs!r} give {len(values)} value(s) for {len(paths)} data path(s) "
            f"({', '.join(paths)}); give exactly one probability per path, in the same order"
        )
    total = sum(values)
    if total <= 0:
        raise UserError(f"probabilities {probs!r} sum to 0; at least one data set needs a probability > 0")
    return [v / total for v in values]


def _detect_format(path: str) -> str:
    if os.path.isdir(path):
        return "hf"
    if not os.path.exists(path):
        raise UserError(
            f"data file {path} does not exist (looked in: {tried(path)}); supported formats: {SUPPORTED_FORMATS}"
        )
    ext = os.path.splitext(path)[1].lower()
    if ext in (".json", ".jsonl"):
        return "json"
    if ext == ".parquet":
        return "parquet"
    raise UserError(
        f"data file {path} has an unsupported extension {ext or '(none)'!r}; supported formats: {SUPPORTED_FORMATS}"
    )


# --------------------------------------------------------------------------------------------
# Mixing
# --------------------------------------------------------------------------------------------


def _list_opener(records: list[Record]) -> Callable[[], Iterator[Record]]:
    return lambda: iter(records)


def _chain(openers: list[Callable[[], Iterator[Record]]]) -> Iterator[Record]:
    for open_source in openers:
        yield from open_source()


_RESTART = object()


def _interleave(openers: list[Callable[[], Iterator[Record]]], probs: list[float], seed: int) -> Iterator[Record]:
    """``interleave_datasets(..., stopping_strategy="all_exhausted")`` over re-openable sources.

    Each source is peeked one record ahead so that it counts as exhausted right after its last
    record, as in Hugging Face; an exhausted source restarts from its beginning when drawn again.
    """
    import numpy as np

    n = len(openers)
    drawable = [i for i in range(n) if probs[i] > 0]
    iters: list[Iterator[Record] | None] = [None] * n
    heads: list[Any] = [_RESTART] * n
    exhausted = [False] * n
    rng = np.random.default_rng(seed)
    for i in drawable:  # open every source first: a bad or empty file fails before any output
        iters[i] = openers[i]()
        heads[i] = next(iters[i])
    while True:
        for draw in rng.choice(n, size=1000, p=probs):
            if all(exhausted[i] for i in drawable):
                return
            i = int(draw)
            if heads[i] is _RESTART:
                iters[i] = openers[i]()
                heads[i] = next(iters[i])
            yield heads[i]
            heads[i] = next(iters[i], _RESTART)
            if heads[i] is _RESTART:
                exhausted[i] = True


# --------------------------------------------------------------------------------------------
# Raw readers: yield (line or None, object) per record
# --------------------------------------------------------------------------------------------


class _Where:
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


def _iter_raw(path: str, fmt: str) -> Iterator[tuple[int | None, Any]]:
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
                _Where(path, index, line_no).fail(
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
# Validation
# --------------------------------------------------------------------------------------------


def _iter_validated(
    path: str, fmt: str, kind: str, tokens: tuple[str, str], placeholder: str, names: dict[str, str]
) -> Iterator[Record]:
    parse = {"prm": _parse_prm, "pair": _parse_pair, "prompt": _parse_prompt, "sft": _parse_sft}[kind]
    index = 0
    for line, obj in _iter_raw(path, fmt):
        where = _Where(path, index, line, names)
        if not isinstance(obj, dict):
            where.fail(
                None, f"is a JSON {_type_name(obj)}, not an object", f"every record must be an object: {FORMATS[kind]}"
            )
        yield parse(_rename(obj, names, where) if names else obj, where, tokens, placeholder)
        index += 1
    if index == 0:
        raise UserError(
            f"{path}: no records found (the file or data set is empty). Fix: give a file with at least one "
            f"record in the {kind!r} format: {FORMATS[kind]}"
        )


def _rename(rec: dict, names: dict[str, str], where: _Where) -> dict:
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


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, (list, tuple)):
        return "list"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _present(rec: dict, key: str) -> bool:
    return rec.get(key) is not None


_FORMAT_NAMES = {"paddle": "PaddleNLP", "trl": "TRL", "shepherd": "Math-Shepherd", "processbench": "ProcessBench"}


def _pick_format(
    rec: dict,
    where: _Where,
    kind: str,
    paddle: tuple[str, ...],
    trl: tuple[str, ...],
    shepherd: tuple[str, ...] = (),
    processbench: tuple[str, ...] = (),
) -> str:
    """'paddle', 'trl', 'shepherd' or 'processbench' by the marker fields present."""
    found = {
        fmt: [k for k in markers if _present(rec, k)]
        for fmt, markers in (("paddle", paddle), ("trl", trl), ("shepherd", shepherd), ("processbench", processbench))
    }
    found = {fmt: keys for fmt, keys in found.items() if keys}
    if len(found) > 1:
        mixed = " with ".join(f"{_FORMAT_NAMES[fmt]} fields ({', '.join(keys)})" for fmt, keys in found.items())
        where.fail(None, f"mixes {mixed}", f"use one format per record: {FORMATS[kind]}")
    if not found:
        keys = ", ".join(repr(k) for k in rec) or "none"
        where.fail(
            None,
            f"missing required fields (the record has: {keys})",
            f"a {kind!r} record must use one of the accepted formats: {FORMATS[kind]}",
        )
    return next(iter(found))


def _require(rec: dict, where: _Where, kind: str, fields: tuple[str, ...], fmt_name: str) -> None:
    missing = [k for k in fields if not _present(rec, k)]
    if missing:
        names = ", ".join(repr(k) for k in missing)
        where.fail(
            missing[0],
            f"missing required field(s) {names} for the {fmt_name} format",
            f"add {names}; accepted formats: {FORMATS[kind]}",
        )


# ---- prompts ---------------------------------------------------------------------------------


def _turns(value: Any, field: str, where: _Where) -> list[str]:
    """A PaddleNLP src/tgt value: None, a string or a list of strings."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)) and all(isinstance(t, str) for t in value):
        return list(value)
    where.fail(
        field,
        f"must be a string or a list of strings, got {_type_name(value)}",
        f"write {field} as a list of turn texts",
    )


def _system(rec: dict, where: _Where) -> list[Message]:
    value = rec.get("system")
    if value is None:
        return []
    if not isinstance(value, str):
        where.fail("system", f"must be a string, got {_type_name(value)}", "give the system prompt as one string")
    return [{"role": "system", "content": value}] if value.strip() else []


def _history(src: list[str], tgt: list[str], where: _Where) -> list[Message]:
    """src[0] (user), tgt[0] (assistant), src[1] (user), ...; requires len(src) == len(tgt) + 1."""
    if not src:
        where.fail(
            "src", "the prompt is empty (src has no turns)", "give the question as a string or a list of user turns"
        )
    for j, text in enumerate(src):
        if not text.strip():
            where.fail("src", f"turn {j} is empty: the prompt is empty", "give a non-empty text for every user turn")
    for j, text in enumerate(tgt):
        if not text.strip():
            where.fail("tgt", f"turn {j} is empty", "give a non-empty text for every earlier assistant turn")
    messages: list[Message] = []
    for j, text in enumerate(src):
        messages.append({"role": "user", "content": text})
        if j < len(tgt):
            messages.append({"role": "assistant", "content": tgt[j]})
    return messages


def _paddle_prompt(rec: dict, where: _Where, allow_none: bool = False) -> list[Message]:
    """Prompt for prm/pair records: src has exactly one turn more than tgt.

    ``allow_none`` (PRM): a single empty src turn with no tgt means there is no separate prompt, as in
    PaddleNLP's Math-Shepherd conversion, where the question starts the first step; the prompt is [].
    """
    src = _turns(rec["src"], "src", where)
    if not src:
        where.fail(
            "src", "the prompt is empty (src has no turns)", "give the question as a string or a list of user turns"
        )
    tgt_value = rec.get("tgt")
    tgt = [] if tgt_value == "" else _turns(tgt_value, "tgt", where)
    if allow_none and len(src) == 1 and not src[0].strip() and not tgt:
        if _system(rec, where):
            where.fail(
                "system",
                "is given but src is empty: without a prompt the text is the steps alone (the question at the "
                "start of the first step)",
                "put the question in src, or drop the system prompt",
            )
        return []
    if len(src) != len(tgt) + 1:
        where.fail(
            "tgt",
            f"src has {len(src)} turn(s) and tgt has {len(tgt)}; src must have exactly one turn more than tgt "
            "(tgt holds the assistant answers between the user turns)",
            'use "tgt": [] for a single-turn record, or give one assistant turn per earlier user turn',
        )
    return _system(rec, where) + _history(src, tgt, where)


def _messages(value: Any, field: str, where: _Where) -> list[Message]:
    if not isinstance(value, (list, tuple)) or not value:
        where.fail(
            field,
            f"must be a non-empty list of messages, got {_type_name(value)}",
            'give [{"role": ..., "content": ...}]',
        )
    out: list[Message] = []
    for j, msg in enumerate(value):
        if not (isinstance(msg, dict) and isinstance(msg.get("role"), str) and isinstance(msg.get("content"), str)):
            where.fail(
                field,
                f"message {j} is not an object with string 'role' and 'content' (got {_type_name(msg)})",
                'write every message as {"role": "user", "content": "..."}',
            )
        if msg["role"] not in ROLES:
            where.fail(field, f"message {j} has role {msg['role']!r}", f"use one of {', '.join(map(repr, ROLES))}")
        if not msg["content"].strip():
            where.fail(
                field, f"message {j} ({msg['role']}) has empty content", "give a non-empty text for every message"
            )
        out.append({"role": msg["role"], "content": msg["content"]})
    return out


def _check_conversation(messages: list[Message], field: str, where: _Where) -> None:
    for j, msg in enumerate(messages):
        if msg["role"] == "system" and j > 0:
            where.fail(field, f"message {j} is a system message after the start", "put the system message first")
    if not messages or all(m["role"] == "system" for m in messages):
        where.fail(field, "the prompt is empty (no user turn)", "give at least one user message")
    if messages[-1]["role"] != "user":
        where.fail(
            field,
            f"the prompt ends with a {messages[-1]['role']} message",
            "the prompt must end with the user turn to answer",
        )


def _add_system(rec: dict, messages: list[Message], field: str, where: _Where) -> list[Message]:
    system = _system(rec, where)
    if system and messages[0]["role"] == "system":
        where.fail("system", f"is given and '{field}' already starts with a system message", "keep only one of the two")
    return system + messages


def _trl_prompt(rec: dict, where: _Where) -> list[Message]:
    value = rec["prompt"]
    if isinstance(value, str):
        if not value.strip():
            where.fail("prompt", "the prompt is empty", "give the question text")
        messages = [{"role": "user", "content": value}]
    elif isinstance(value, (list, tuple)):
        messages = _messages(value, "prompt", where)
        _check_conversation(messages, "prompt", where)
    else:
        where.fail(
            "prompt", f"must be a string or a list of messages, got {_type_name(value)}", "give the question text"
        )
    return _add_system(rec, messages, "prompt", where)


# ---- prm ---------------------------------------------------------------------------------------


def _steps(value: Any, field: str, where: _Where, placeholder: str) -> list[str]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(s, str) for s in value):
        where.fail(
            field, f"must be a list of step strings, got {_type_name(value)}", "give the solution as a list of steps"
        )
    if not value:
        where.fail(field, "has no steps", "give at least one solution step")
    for j, step in enumerate(value):
        if not step.strip():
            where.fail(field, f"step {j} is empty", "remove the empty step (and its label) or give its text")
        if placeholder in step:
            where.fail(
                field,
                f"step {j} contains the placeholder text {placeholder!r}",
                "remove it from the step text: the trainer appends the placeholder after every step itself "
                "(split Math-Shepherd style text at the placeholders into steps first), or choose a "
                "placeholder_token that does not occur in the data",
            )
    return list(value)


def _labels(value: Any, where: _Where, tokens: tuple[str, str], n_steps: int, steps_field: str) -> list[str]:
    allowed = f"{tokens[0]!r} (correct) or {tokens[1]!r} (wrong)"
    if not isinstance(value, (list, tuple)):
        where.fail(
            "labels", f"must be a list with one label per step, got {_type_name(value)}", f"use labels {allowed}"
        )
    if len(value) != n_steps:
        where.fail(
            "labels",
            f"has {len(value)} label(s) but '{steps_field}' has {n_steps} step(s)",
            "give exactly one label per step",
        )
    out = []
    for j, label in enumerate(value):
        if isinstance(label, bool):
            out.append(tokens[0] if label else tokens[1])
        elif isinstance(label, str) and label in tokens:
            out.append(label)
        else:
            where.fail(
                "labels",
                f"label {j} is {label!r}, which is not one of the reward tokens {tokens[0]!r}, {tokens[1]!r}",
                f"use {allowed} (or true/false), or set reward_tokens to the tokens your data uses",
            )
    return out


def _shepherd_steps(rec: dict, where: _Where, tokens: tuple[str, str], placeholder: str) -> tuple[list[str], list[str]]:
    """Hugging Face Math-Shepherd row: steps are ``input`` split at the placeholder, each label is the
    reward token standing at that placeholder's place in ``label`` (elsewhere the two texts are equal)."""
    for field in ("input", "label"):
        if not isinstance(rec[field], str):
            where.fail(field, f"must be a string, got {_type_name(rec[field])}", "give the solution text")
    text, marked = rec["input"], rec["label"]
    pieces = text.split(placeholder)
    if len(pieces) == 1:
        where.fail(
            "input",
            f"has no placeholder {placeholder!r}, so no step to score",
            f"end every step with {placeholder!r}, or set placeholder_token to the step mark your data uses",
        )
    if pieces[-1].strip():
        where.fail(
            "input",
            f"has text after the last placeholder {placeholder!r} ({pieces[-1].strip()[:40]!r}), which no label covers",
            f"end the last step with {placeholder!r} too",
        )
    fix = (
        f"'label' must be 'input' with each {placeholder!r} replaced by {tokens[0]!r} (correct) or "
        f"{tokens[1]!r} (wrong), or set reward_tokens to the marks your data uses"
    )

    def differs(pos: int, start: int, expected: str) -> NoReturn:
        k = len(os.path.commonprefix([marked[pos : pos + len(expected)], expected]))
        where.fail(
            "label",
            f"differs from 'input' outside the step marks at character {start + k} of input (input has "
            f"{expected[k : k + 20]!r}, label has {marked[pos + k : pos + k + 20]!r})",
            fix,
        )

    labels: list[str] = []
    pos = start = 0  # in label, in input
    for j, piece in enumerate(pieces[:-1]):
        if not marked.startswith(piece, pos):
            differs(pos, start, piece)
        pos, start = pos + len(piece), start + len(piece) + len(placeholder)
        # prefer the reward token that the next piece of text follows (one token may be a prefix of the other)
        found = [t for t in tokens if marked.startswith(t, pos)]
        found.sort(key=lambda t: not marked.startswith(pieces[j + 1], pos + len(t)))
        if not found:
            where.fail(
                "label",
                f"step {j}: at the place of its {placeholder!r} the label has {marked[pos : pos + 10]!r}, "
                f"which does not start with a reward token {tokens[0]!r} or {tokens[1]!r}",
                fix,
            )
        labels.append(found[0])
        pos += len(found[0])
    if marked[pos:] != pieces[-1]:
        differs(pos, start, pieces[-1])
    steps = [piece.strip() for piece in pieces[:-1]]
    for j, step in enumerate(steps):
        if not step:
            where.fail("input", f"step {j} is empty (nothing before its {placeholder!r})", "remove the empty step")
    return steps, labels


def _parse_prm(rec: dict, where: _Where, tokens: tuple[str, str], placeholder: str) -> PRMRecord:
    processbench = ("problem", "steps")
    # "label" marks Math-Shepherd's layout, unless ProcessBench's fields are there (its label is the first error)
    shepherd = ("input",) if any(_present(rec, k) for k in processbench) else ("input", "label")
    fmt = _pick_format(rec, where, "prm", ("src", "responses"), ("prompt", "completions"), shepherd, processbench)
    candidate = _candidate(rec, where)
    if fmt == "processbench":
        return _processbench(rec, where, tokens, placeholder, candidate)
    if fmt == "shepherd":
        _require(rec, where, "prm", ("input", "label"), "Math-Shepherd")
        steps, labels = _shepherd_steps(rec, where, tokens, placeholder)
        return PRMRecord([], steps, labels, where.path, where.index, **candidate)
    unlabelled = candidate["correct"] is not None and not _present(rec, "labels")
    if fmt == "paddle":
        _require(rec, where, "prm", ("src", "responses") + (() if unlabelled else ("labels",)), "PaddleNLP PRM")
        prompt, steps_field = _paddle_prompt(rec, where, allow_none=True), "responses"
    else:
        _require(rec, where, "prm", ("prompt", "completions") + (() if unlabelled else ("labels",)), "TRL stepwise")
        prompt, steps_field = _trl_prompt(rec, where), "completions"
    steps = _steps(rec[steps_field], steps_field, where, placeholder)
    labels = [None] * len(steps) if unlabelled else _labels(rec["labels"], where, tokens, len(steps), steps_field)
    if candidate["correct"] is not None and candidate["group"] is None:
        candidate["group"] = json.dumps([m["content"] for m in prompt] + ([] if prompt else steps[:1]))
    return PRMRecord(prompt, steps, labels, where.path, where.index, **candidate)


_SUBSET_ID = re.compile(r"^(.+)-\d+$")


def _optional_text(rec: dict, field: str, where: _Where) -> str | None:
    if not _present(rec, field):
        return None
    value = rec[field]
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        where.fail(field, f"must be a string or a number, got {_type_name(value)}", f"give {field} as a string")
    return str(value)


def _candidate(rec: dict, where: _Where) -> dict:
    """The best-of-N fields (``group``, ``answer``, ``correct``) and ``generator``; answer and correct come together."""
    out = {
        "group": _optional_text(rec, "group", where),
        "answer": _optional_text(rec, "answer", where),
        "generator": _optional_text(rec, "generator", where),
        "correct": None,
    }
    # ProcessBench's final_answer_correct is the correctness of a candidate that gives its answer
    flag = "correct" if _present(rec, "correct") or out["answer"] is None else "final_answer_correct"
    if _present(rec, flag):
        if not isinstance(rec[flag], bool):
            where.fail(flag, f"must be true or false, got {_type_name(rec[flag])}", "give a JSON boolean")
        out["correct"] = rec[flag]
    if (out["answer"] is None) != (out["correct"] is None):
        have, need = ("answer", "correct") if out["answer"] is not None else ("correct", "answer")
        where.fail(need, f"is missing while '{have}' is given", "a best-of-N candidate needs both answer and correct")
    return out


def _processbench(rec: dict, where: _Where, tokens: tuple[str, str], placeholder: str, candidate: dict) -> PRMRecord:
    _require(rec, where, "prm", ("problem", "steps", "label"), "ProcessBench")
    if not isinstance(rec["problem"], str) or not rec["problem"].strip():
        where.fail("problem", "must be a non-empty string", "give the problem text")
    steps = _steps(rec["steps"], "steps", where, placeholder)
    first = rec["label"]
    if isinstance(first, bool) or not isinstance(first, int) or not -1 <= first < len(steps):
        where.fail(
            "label",
            f"must be the index of the earliest wrong step (0 to {len(steps) - 1}) or -1, got {first!r}",
            "give ProcessBench's integer label",
        )
    labels: list[str | None] = [tokens[0]] * len(steps) if first < 0 else [tokens[0]] * first + [tokens[1]]
    labels += [None] * (len(steps) - len(labels))
    subset = _optional_text(rec, "subset", where)
    if subset is None and isinstance(rec.get("id"), str):
        match = _SUBSET_ID.match(rec["id"])
        subset = match.group(1) if match else None
    prompt = [{"role": "user", "content": rec["problem"]}]
    if candidate["correct"] is not None and candidate["group"] is None:
        candidate["group"] = rec["problem"]
    return PRMRecord(prompt, steps, labels, where.path, where.index, first_error=first, subset=subset, **candidate)


# ---- pair --------------------------------------------------------------------------------------


def _answer_text(value: Any, field: str, where: _Where) -> str:
    if isinstance(value, str):
        text = value
    elif isinstance(value, (list, tuple)):
        messages = _messages(value, field, where)
        if messages[-1]["role"] != "assistant":
            where.fail(field, f"the last message has role {messages[-1]['role']!r}", "end it with the assistant answer")
        text = messages[-1]["content"]
    else:
        where.fail(field, f"must be a string or a list of messages, got {_type_name(value)}", "give the answer text")
    if not text.strip():
        where.fail(field, "the answer is empty", "give a non-empty answer")
    return text


def _parse_pair(rec: dict, where: _Where, tokens: tuple[str, str], placeholder: str) -> PairRecord:
    fmt = _pick_format(rec, where, "pair", ("src", "response", "sort"), ("prompt", "chosen", "rejected"))
    if fmt == "paddle":
        _require(rec, where, "pair", ("src", "response", "sort"), "PaddleNLP pair")
        prompt = _paddle_prompt(rec, where)
        response, sort = rec["response"], rec["sort"]
        if not (
            isinstance(response, (list, tuple)) and len(response) == 2 and all(isinstance(r, str) for r in response)
        ):
            got = f"a list of {len(response)}" if isinstance(response, (list, tuple)) else _type_name(response)
            where.fail(
                "response",
                f"must be a list of exactly two strings, got {got}",
                'give "response": [r0, r1] with "sort": [s0, s1]',
            )
        for j, text in enumerate(response):
            if not text.strip():
                where.fail("response", f"response {j} is empty", "give two non-empty responses")
        if not (
            isinstance(sort, (list, tuple))
            and len(sort) == 2
            and all(isinstance(s, (int, float)) and not isinstance(s, bool) and math.isfinite(s) for s in sort)
        ):
            where.fail(
                "sort", f"must be a list of two numbers, got {sort!r}", "give the scores of response[0] and response[1]"
            )
        if sort[0] == sort[1]:
            where.fail(
                "sort",
                f"both responses have the same sort value {sort[0]!r}, so neither is chosen",
                "give the better response the higher value, or drop the record from the file",
            )
        best = 0 if sort[0] > sort[1] else 1
        return PairRecord(prompt, response[best], response[1 - best], where.path, where.index)

    _require(rec, where, "pair", ("chosen", "rejected"), "TRL preference")
    if _present(rec, "prompt"):
        prompt = _trl_prompt(rec, where)
    else:  # implicit prompt: both are conversations sharing everything before the last message
        chosen_value, rejected_value = rec["chosen"], rec["rejected"]
        if not (isinstance(chosen_value, (list, tuple)) and isinstance(rejected_value, (list, tuple))):
            where.fail(
                "prompt",
                "missing required field 'prompt' (chosen/rejected are not conversations it could be taken from)",
                f"add 'prompt'; accepted formats: {FORMATS['pair']}",
            )
        chosen_msgs = _messages(chosen_value, "chosen", where)
        rejected_msgs = _messages(rejected_value, "rejected", where)
        if chosen_msgs[:-1] != rejected_msgs[:-1]:
            where.fail(
                "rejected",
                "without 'prompt', chosen and rejected must share every message before the last one",
                "give the conversation before the answers as 'prompt'",
            )
        prompt = chosen_msgs[:-1]
        _check_conversation(prompt, "chosen", where)
        prompt = _add_system(rec, prompt, "chosen", where)
    chosen = _answer_text(rec["chosen"], "chosen", where)
    rejected = _answer_text(rec["rejected"], "rejected", where)
    return PairRecord(prompt, chosen, rejected, where.path, where.index)


# ---- prompt ------------------------------------------------------------------------------------


def _reference(value: Any, field: str, where: _Where) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str):
        where.fail(field, f"must be a string (the reference answer), got {_type_name(value)}", "give the answer text")
    if not value.strip():
        where.fail(field, "the reference answer is empty", f"give the answer, or remove '{field}' (or set it to null)")
    return value


def _parse_prompt(rec: dict, where: _Where, tokens: tuple[str, str], placeholder: str) -> PromptRecord:
    fmt = _pick_format(rec, where, "prompt", ("src",), ("prompt",))
    extra = next((k for k in ("reference", "answer") if _present(rec, k)), None)
    if fmt == "trl":
        messages = _trl_prompt(rec, where)
        field = extra or ("tgt" if _present(rec, "tgt") else None)
        if field is not None and isinstance(rec[field], (list, tuple)):
            where.fail(field, "must be a string (the reference answer), got list", "give the answer text")
        reference = _reference(rec[field], field, where) if field else None
        return PromptRecord(messages, reference, where.path, where.index)

    src = _turns(rec["src"], "src", where)
    tgt = _turns(rec.get("tgt"), "tgt", where)
    reference = None
    if len(tgt) == len(src) and src:
        reference = _reference(tgt[-1], "tgt", where)
        tgt = tgt[:-1]
    elif len(tgt) != len(src) - 1 and src:
        where.fail(
            "tgt",
            f"src has {len(src)} turn(s) and tgt has {len(tgt)}; tgt must hold the {len(src) - 1} earlier "
            "assistant turn(s), optionally followed by the reference answer",
            "give len(src) - 1 history turns, or len(src) turns whose last one is the reference",
        )
    if reference is None and extra:
        reference = _reference(rec[extra], extra, where)
    messages = _system(rec, where) + _history(src, tgt, where)
    return PromptRecord(messages, reference, where.path, where.index)


# ---- sft ---------------------------------------------------------------------------------------


def _parse_sft(rec: dict, where: _Where, tokens: tuple[str, str], placeholder: str) -> SFTRecord:
    fmt = _pick_format(rec, where, "sft", ("src", "tgt"), ("messages",))
    if fmt == "paddle":
        _require(rec, where, "sft", ("src", "tgt"), "PaddleNLP SFT")
        src, tgt = _turns(rec["src"], "src", where), _turns(rec["tgt"], "tgt", where)
        if len(src) != len(tgt) or not src:
            where.fail(
                "tgt",
                f"src has {len(src)} turn(s) and tgt has {len(tgt)}; for SFT every user turn needs its answer "
                "(src[0], tgt[0], src[1], tgt[1], ...; the answers are what the model learns)",
                "give exactly one tgt turn per src turn",
            )
        for j, text in enumerate(tgt):
            if not text.strip():
                where.fail("tgt", f"turn {j} is empty", "give a non-empty answer for every user turn")
        messages = _system(rec, where) + _history(src, tgt[:-1], where)
        return SFTRecord(messages + [{"role": "assistant", "content": tgt[-1]}], where.path, where.index)

    messages = _add_system(rec, _messages(rec["messages"], "messages", where), "messages", where)
    for j, msg in enumerate(messages):
        if msg["role"] == "system" and j > 0:
            where.fail("messages", f"message {j} is a system message after the start", "put the system message first")
    turns = [m for m in messages if m["role"] != "system"]
    if not turns or turns[0]["role"] != "user":
        where.fail(
            "messages",
            "the conversation does not start with a user message" if turns else "there is no user message",
            "start with the user turn (after an optional system message)",
        )
    if turns[-1]["role"] != "assistant":
        where.fail(
            "messages",
            f"the conversation ends with a {turns[-1]['role']} message, which nothing answers",
            "end the conversation with the assistant answer to train on, or drop the last message",
        )
    return SFTRecord(messages, where.path, where.index)
