"""Packing ("zero padding"): typed examples -> rows of at most ``max_seq_len`` -> padded batches.

An ``Example`` is one tokenised unit (a PRM solution, a preference pair as [prompt | chosen |
rejected], an SFT conversation). Besides tokens and positions it carries *readouts*: the token
positions where the loss reads the model's output, what each is compared with and which part of
the example it belongs to. Meaning per algorithm:

=========  =======================  ====================================  ====================
algorithm  readout_position         readout_target                        readout_part
=========  =======================  ====================================  ====================
PRM        each placeholder token   step label class (0 = '+', 1 = '-')   0
           (``readout_value``: the step's soft label in [0, 1], NaN where it has none)
ORM        last chosen / rejected   unused (0)                            0 chosen, 1 rejected
LM (SFT,   token before a target    the target token id                   0 chosen, 1 rejected
DPO)
=========  =======================  ====================================  ====================

``readout_value`` is a float per readout, NaN unless the algorithm uses it (a PRM trained on soft labels).
Packing only offsets positions; readouts never cross an example (they stay inside its blocks).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from llm.utils.attention import Block, PackedAttention
from llm.utils.errors import UserError


@dataclass
class Example:
    input_ids: list[int]
    position_ids: list[int]
    blocks: list[Block]
    readout_position: list[int] = field(default_factory=list)
    readout_target: list[int] = field(default_factory=list)
    readout_part: list[int] = field(default_factory=list)
    record: int = -1  # index of the source record, for per-example outputs
    readout_value: list[float] = field(default_factory=list)  # empty: NaN at every readout

    def __len__(self) -> int:
        return len(self.input_ids)


def causal_example(
    input_ids: list[int],
    readout_position: list[int],
    readout_target: list[int],
    readout_part: list[int] | None = None,
    record: int = -1,
    readout_value: list[float] | None = None,
) -> Example:
    """A single causal sequence (PRM solution, SFT conversation)."""
    n = len(input_ids)
    return Example(
        input_ids=list(input_ids),
        position_ids=list(range(n)),
        blocks=[Block(0, n, ((0, n),))],
        readout_position=list(readout_position),
        readout_target=list(readout_target),
        readout_part=list(readout_part) if readout_part is not None else [0] * len(readout_position),
        record=record,
        readout_value=list(readout_value or []),
    )


def pair_example(
    prompt: list[int],
    chosen: list[int],
    rejected: list[int],
    readout_position: list[int],
    readout_target: list[int],
    readout_part: list[int],
    record: int = -1,
) -> Example:
    """[prompt | chosen | rejected]; rejected positions restart at len(prompt) and never see chosen.

    Readout positions are given in this layout's coordinates (see ``pair_coordinates``).
    """
    p, c, r = len(prompt), len(chosen), len(rejected)
    return Example(
        input_ids=list(prompt) + list(chosen) + list(rejected),
        position_ids=list(range(p + c)) + list(range(p, p + r)),
        blocks=[Block(0, p + c, ((0, p + c),)), Block(p + c, p + c + r, ((0, p), (p + c, p + c + r)))],
        readout_position=list(readout_position),
        readout_target=list(readout_target),
        readout_part=list(readout_part),
        record=record,
    )


def pair_coordinates(p: int, c: int, r: int) -> tuple[list[int], list[int]]:
    """Index, in the pair layout, of each token of the *virtual* sequences prompt+chosen and prompt+rejected.

    ``chosen_idx[t]`` / ``rejected_idx[t]`` is where token t of the prompt+answer sequence lives. The
    output predicting rejected token 0 is read at the last *prompt* position, not at the last chosen
    token: ``rejected_idx[p - 1] == p - 1``.
    """
    chosen_idx = list(range(p + c))
    rejected_idx = list(range(p)) + list(range(p + c, p + c + r))
    return chosen_idx, rejected_idx


@dataclass
class PackedRow:
    input_ids: list[int]
    position_ids: list[int]
    blocks: list[Block]
    readout_position: list[int]
    readout_target: list[int]
    readout_part: list[int]
    readout_example: list[int]  # index of the example within the row
    records: list[int]
    readout_value: list[float] = field(default_factory=list)  # one per readout (NaN: none)

    def __len__(self) -> int:
        return len(self.input_ids)


def plan_rows(lengths: Sequence[int], max_len: int, strategy: str | None) -> list[list[int]]:
    """Group example indices into rows of total length <= max_len.

    None: one example per row. 'sequential': fill rows in data order. 'greedy': best-fit
    decreasing bin packing (longest first, each into the fullest row it still fits), which
    brings the pad ratio from tens of percent to a few.
    """
    if any(n > max_len for n in lengths):
        raise ValueError("plan_rows: an example is longer than max_len; apply the overlong policy first")
    if strategy is None:
        return [[i] for i in range(len(lengths))]
    if strategy == "sequential":
        rows: list[list[int]] = []
        used = max_len + 1
        for i, n in enumerate(lengths):
            if used + n > max_len:
                rows.append([])
                used = 0
            rows[-1].append(i)
            used += n
        return rows
    if strategy == "greedy":
        rows = []
        free: list[tuple[int, int]] = []  # sorted (remaining capacity, row id)
        for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
            n = lengths[i]
            k = bisect.bisect_left(free, (n, -1))
            if k == len(free):
                rows.append([i])
                bisect.insort(free, (max_len - n, len(rows) - 1))
            else:
                room, row = free.pop(k)
                rows[row].append(i)
                bisect.insort(free, (room - n, row))
        return [sorted(r) for r in rows]
    raise ValueError(f"unknown packing strategy {strategy!r}")


def build_row(examples: Sequence[Example]) -> PackedRow:
    row = PackedRow([], [], [], [], [], [], [], [])
    for e_idx, ex in enumerate(examples):
        offset = len(row.input_ids)
        row.input_ids += ex.input_ids
        row.position_ids += ex.position_ids
        row.blocks += [b.shifted(offset) for b in ex.blocks]
        row.readout_position += [p + offset for p in ex.readout_position]
        row.readout_target += ex.readout_target
        row.readout_part += ex.readout_part
        row.readout_example += [e_idx] * len(ex.readout_position)
        row.readout_value += ex.readout_value or [math.nan] * len(ex.readout_position)
        row.records.append(ex.record)
    return row


@dataclass
class PackStats:
    examples: int
    rows: int
    real_tokens: int
    capacity: int  # rows * row length used for the pad ratio

    @property
    def pad_ratio(self) -> float:
        return 1.0 - self.real_tokens / self.capacity if self.capacity else 0.0

    def summary(self, strategy: str | None, max_len: int) -> str:
        return (
            f"packing={strategy or 'none'} max_seq_len={max_len}: {self.examples} examples -> {self.rows} rows, "
            f"{self.real_tokens} real tokens fill {1 - self.pad_ratio:.1%} of rows x max_seq_len (the steps' "
            "pad_ratio is the padding computed: each batch's rows padded to its longest)"
        )


def pack(
    examples: Sequence[Example], max_len: int, strategy: str | None, batch_size: int = 1
) -> tuple[list[PackedRow], PackStats]:
    """Pack examples into rows. The pad ratio assumes batches of ``batch_size`` consecutive rows
    padded to their longest row (packed rows count as full ``max_len``)."""
    plan = plan_rows([len(e) for e in examples], max_len, strategy)
    rows = [build_row([examples[i] for i in idx]) for idx in plan]
    real = sum(len(r) for r in rows)
    if strategy is None:
        capacity = sum(
            max(len(r) for r in rows[i : i + batch_size]) * len(rows[i : i + batch_size])
            for i in range(0, len(rows), batch_size)
        )
    else:
        capacity = len(rows) * max_len
    return rows, PackStats(len(examples), len(rows), real, capacity)


@dataclass
class PackedBatch:
    """A padded batch of packed rows. Readout tensors index the flattened ``(rows * seq_len)`` outputs."""

    input_ids: torch.Tensor  # (R, L)
    position_ids: torch.Tensor  # (R, L)
    attention: PackedAttention
    readout_index: torch.Tensor  # (N,) flat index row * L + position
    readout_target: torch.Tensor  # (N,)
    readout_part: torch.Tensor  # (N,)
    readout_example: torch.Tensor  # (N,) example index within the batch
    records: torch.Tensor  # (E,) source record of each example
    num_real_tokens: int
    readout_value: torch.Tensor | None = None  # (N,) float: a PRM step's soft label, NaN where none

    @property
    def num_examples(self) -> int:
        return int(self.records.numel())

    def to(self, device: torch.device | str) -> PackedBatch:
        tensors = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in self.__dict__.items()}
        return PackedBatch(**tensors)

    def model_inputs(self) -> dict:
        """Keyword arguments for a Hugging Face decoder using the ``packed_sdpa`` attention."""
        return {
            "input_ids": self.input_ids,
            "position_ids": self.position_ids,
            "packed_attention": self.attention,
            "use_cache": False,  # with a cache transformers leaks attention across packed examples
        }


def collate(
    rows: Sequence[PackedRow], pad_token_id: int, pad_to: int | None = None, kernel: str = "sdpa"
) -> PackedBatch:
    """Stack rows, right-padded to the longest row (or ``pad_to``); ``kernel`` see PackedAttention."""
    length = max(len(r) for r in rows) if pad_to is None else pad_to
    n_rows = len(rows)
    input_ids = torch.full((n_rows, length), pad_token_id, dtype=torch.long)
    position_ids = torch.zeros((n_rows, length), dtype=torch.long)
    index, target, part, example, records, value = [], [], [], [], [], []
    for r, row in enumerate(rows):
        input_ids[r, : len(row)] = torch.tensor(row.input_ids, dtype=torch.long)
        position_ids[r, : len(row)] = torch.tensor(row.position_ids, dtype=torch.long)
        index += [r * length + p for p in row.readout_position]
        target += row.readout_target
        part += row.readout_part
        example += [len(records) + e for e in row.readout_example]
        value += row.readout_value or [math.nan] * len(row.readout_position)
        records += row.records
    as_long = lambda x: torch.tensor(x, dtype=torch.long)
    return PackedBatch(
        input_ids=input_ids,
        position_ids=position_ids,
        attention=PackedAttention([list(r.blocks) for r in rows], length, kernel),
        readout_index=as_long(index),
        readout_target=as_long(target),
        readout_part=as_long(part),
        readout_example=as_long(example),
        records=as_long(records),
        num_real_tokens=sum(len(r) for r in rows),
        readout_value=torch.tensor(value, dtype=torch.float32),
    )


class StreamedRows(torch.utils.data.IterableDataset):
    """Rows packed on the fly from a stream of examples (``lazy``): constant memory, no shuffling.

    Examples are packed ``buffer`` at a time with ``strategy``; the stream is deterministic, so a
    resumed run that skips the first N batches sees exactly the rows an uninterrupted run saw.

    With ``repeat`` the stream starts again from its first example when it ends, without end: training
    runs to ``max_steps`` (which lazy runs must set) with the optimizer-step groups running on across
    the seam. Left to transformers, each pass would be an "epoch" whose unfinished accumulation is
    dropped, and a file packing into fewer rows than ``gradient_accumulation_steps`` would be re-read
    forever without a single step. A pass that yields no row stops the run.
    """

    def __init__(
        self,
        examples: Callable[[], Iterator[Example]],
        max_len: int,
        strategy: str | None,
        buffer: int = 1024,
        repeat: bool = False,
        source: str = "the data",
    ) -> None:
        self.examples, self.max_len, self.strategy, self.buffer = examples, max_len, strategy, buffer
        self.repeat, self.source = repeat, source

    def __iter__(self) -> Iterator[PackedRow]:
        while True:
            rows = 0
            for row in self.one_pass():
                rows += 1
                yield row
            if not self.repeat:
                return
            if rows == 0:
                raise UserError(f"{self.source}: the stream holds no example that fits max_seq_len={self.max_len}")

    def one_pass(self) -> Iterator[PackedRow]:
        """The rows of one read of the stream."""
        pending: list[Example] = []
        for ex in self.examples():
            pending.append(ex)
            if len(pending) >= self.buffer:
                yield from pack(pending, self.max_len, self.strategy)[0]
                pending = []
        if pending:
            yield from pack(pending, self.max_len, self.strategy)[0]
