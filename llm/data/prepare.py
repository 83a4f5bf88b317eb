"""Preparing one data split end to end (not the SFT -> RM -> PPO run of llm/run_pipeline.py): read and validate
records, encode them to ``Example``s, pack them into rows."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from llm.data.encoding import OverlongCounter, encode_all
from llm.data.packing import Example, PackedRow, PackStats, StreamedRows, pack
from llm.data.readers import load_dataset_records
from llm.settings.flat import DataArgument, TrainingArguments
from llm.utils.errors import UserError

logger = logging.getLogger(__name__)

Encoder = Callable[..., Example | None]  # encode(record, record_index=, counter=) -> Example or None (skipped)


@dataclass
class PackedData:
    rows: list[PackedRow] | StreamedRows
    records: list  # source records, indexed by Example.record (empty when streamed)
    stats: PackStats | None  # None when streamed
    overlong: OverlongCounter | None = None  # kept / truncated / skipped (streamed: filled by the first pass)


def cap_records(records: list, limit: int | None, path: str, field: str = "max_eval_samples") -> list:
    """The first ``limit`` records (all when None), for a quicker evaluation. A best-of-N group (candidates with
    ``correct`` sharing a ``group``) that the cut splits is left out whole: its metrics compare the first N
    candidates of every group for N up to the smallest group, so one group cut to its first candidates would
    shrink every group's curve to that size. The log says how many records are evaluated, and which groups
    were left out; a limit that keeps no record stops the run naming the field."""
    if limit is None or limit >= len(records):
        return records
    kept, rest = records[:limit], records[limit:]
    cut = ({_group(r) for r in rest} & {_group(r) for r in kept}) - {None}
    if cut:
        kept = [r for r in kept if _group(r) not in cut]
        logger.warning(
            "%s: %s=%d cuts %d best-of-N group(s) (%s): left out whole, so every evaluated group has all its "
            "candidates; raise %s to take them in",
            path,
            field,
            limit,
            len(cut),
            ", ".join(sorted(cut)[:5]) + (" ..." if len(cut) > 5 else ""),
            field,
        )
    if not kept:
        raise UserError(
            f"{path}: {field}={limit} keeps no dev record (the first {limit} are all candidates of best-of-N groups "
            f"that go on past them): raise {field} to the size of the first group at least, or leave it unset"
        )
    logger.info("%s: evaluating on %d of %d dev records (%s)", path, len(kept), len(records), field)
    return kept


def _group(record) -> str | None:
    """The best-of-N group of a candidate record; None for any other record."""
    return getattr(record, "group", None) if getattr(record, "correct", None) is not None else None


def load_packed(
    path: str,
    kind: str,
    encode: Encoder,
    data_args: DataArgument,
    batch_size: int,
    seed: int,
    probs: str | None = None,
    lazy: bool = False,
    max_records: int | None = None,
    **reader_kwargs,
) -> PackedData:
    """Read, validate, encode and pack one split; ``lazy``: a stream packed on the fly, in constant memory.
    ``data_args.map_keys`` renames the records' columns as they are read; ``max_records``: only the first ones
    (``cap_records``; the dev split's ``max_eval_samples``)."""

    def read(lazy_read: bool):
        return load_dataset_records(
            path, kind, probs=probs, seed=seed, lazy=lazy_read, map_keys=data_args.map_keys, **reader_kwargs
        )

    if lazy:
        first_pass, passes = OverlongCounter(), []

        def stream():
            counter = OverlongCounter() if passes else first_pass
            passes.append(counter)
            for i, record in enumerate(read(True)):
                example = counter.encode(encode, record, i)
                if example is not None:
                    yield example
            (logger.warning if counter["skipped"] else logger.info)(counter.report(f"{path} (one pass)"))

        logger.info(
            "%s: streamed (lazy), packed on the fly into rows of %d, no shuffling, read again from the start at "
            "its end until max_steps",
            path,
            data_args.max_seq_len,
        )
        rows = StreamedRows(stream, data_args.max_seq_len, data_args.pack, repeat=True, source=path)
        return PackedData(rows, [], None, first_pass)
    records = cap_records(list(read(False)), max_records, path)
    examples, counter = encode_all(records, encode, path)
    if not examples:
        skipped = f" ({counter['skipped']} skipped: {counter.named()})" if counter["skipped"] else ""
        raise UserError(f"{path}: no example fits max_seq_len={data_args.max_seq_len}{skipped}: raise max_seq_len")
    rows, stats = pack(examples, data_args.max_seq_len, data_args.pack, batch_size)
    logger.info("%s: %s", path, stats.summary(data_args.pack, data_args.max_seq_len))
    return PackedData(rows, records, stats, counter)


Split = Literal["train", "eval"]  # which split a SplitBuilder reads: the training data or the dev data
SplitBuilder = Callable[..., PackedData]  # build(path, split, batch_size=, probs=, lazy=, max_records=) -> PackedData


def train_and_dev(
    data_args: DataArgument, training_args: TrainingArguments, build: SplitBuilder
) -> tuple[PackedData | None, PackedData | None]:
    """The training split (streamed when ``lazy``, mixed by ``dataset_probs``) when training, and the dev
    split when evaluating, each built by ``build`` told which it is; a missing path stops the run naming the field."""
    train = dev = None
    if training_args.do_train:
        if not data_args.train_dataset_path:
            raise UserError("do_train is true but train_dataset_path is not set")
        train = build(
            data_args.train_dataset_path,
            "train",
            batch_size=training_args.per_device_train_batch_size,
            probs=data_args.dataset_probs,
            lazy=data_args.lazy,
        )
    if training_args.do_eval or training_args.eval_strategy != "no":
        if not data_args.dev_dataset_path:
            raise UserError("evaluation is on (do_eval or eval_strategy) but dev_dataset_path is not set")
        dev = build(
            data_args.dev_dataset_path,
            "eval",
            batch_size=training_args.per_device_eval_batch_size,
            max_records=data_args.max_eval_samples,
        )
    return train, dev


def overlong_results(train: PackedData | None, dev: PackedData | None) -> dict[str, int]:
    """``train_overlong_skipped`` / ``eval_overlong_skipped``: records skipped as too long in each split read
    by ``train_and_dev`` (streamed: in one pass), for ``all_results.json``."""
    splits = (("train", train), ("eval", dev))
    return {f"{name}_overlong_skipped": d.overlong["skipped"] for name, d in splits if d and d.overlong is not None}


def plan_summary(train: PackedData | None, data_args: DataArgument) -> str:
    if train is None:
        return "no training data"
    return train.stats.summary(data_args.pack, data_args.max_seq_len) if train.stats else "streamed data"
