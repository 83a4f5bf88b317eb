"""Several data sets as one: concatenated, or interleaved by probabilities like Hugging Face; lazy mode.

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

Lazy mode
    ``lazy=True`` returns an iterator that reads and validates as it goes, in constant memory.
    It does not shuffle: records come in file order (interleaved as above when mixing), and
    eager reading returns exactly the same sequence.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from llm.data.readers.reading import check_kind, check_placeholder, check_reward_tokens, iter_validated
from llm.data.readers.records import Record
from llm.data.readers.sources import check_map_keys, detect_format
from llm.utils.errors import UserError


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
    ``map_keys`` renames the columns of every file's records (see :mod:`llm.data.readers.sources`).
    """
    kind = check_kind(kind)
    tokens = check_reward_tokens(reward_tokens)
    placeholder = check_placeholder(placeholder)
    names = check_map_keys(map_keys, kind)
    path_list = _split_paths(paths)
    weights = _parse_probs(probs, path_list) if probs is not None else None
    formats = [detect_format(p) for p in path_list]

    def opener(i: int) -> Callable[[], Iterator[Record]]:
        return lambda: iter_validated(path_list[i], formats[i], kind, tokens, placeholder, names)

    if lazy:
        if weights is None:
            return _chain([opener(i) for i in range(len(path_list))])
        return _interleave([opener(i) for i in range(len(path_list))], weights, seed)

    if weights is None:
        return [rec for i in range(len(path_list)) for rec in opener(i)()]
    loaded = [list(opener(i)()) if weights[i] > 0 else [] for i in range(len(path_list))]
    return list(_interleave([_list_opener(recs) for recs in loaded], weights, seed))


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
