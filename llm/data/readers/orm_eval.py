"""ORM evaluation records (``kind="orm_eval"``): preference pairs and best-of-N candidates, record by record.

Schema (``kind``)
    ``"orm_eval"``: the dev split of an outcome reward model. A record with a pair's fields (``response``
    / ``sort`` or ``chosen`` / ``rejected``) is a preference pair (``kind="pair"``, a ``PairRecord``); a
    record with a solution's steps (``responses``, ``completions``, ``input``, or ProcessBench's
    ``problem`` / ``steps``) is a best-of-N candidate: any ``"prm"`` layout with ``answer`` and ``correct``
    (a ``PRMRecord``; its ``labels`` may be left out and are not used; ``group`` is required when the
    question is not separate, as in the Math-Shepherd layouts: the ``"prm"`` reader's rule, as for a PRM).
    A solution without ``answer`` / ``correct`` stops the run: an ORM gives one score per text, so there is
    nothing to compare it with, and ProcessBench's first-error label needs a score per step.
"""

from __future__ import annotations

from llm.data.readers.common import is_present
from llm.data.readers.pairs import parse_pair
from llm.data.readers.prm import parse_prm
from llm.data.readers.records import FORMATS, PairRecord, PRMRecord
from llm.data.readers.sources import RecordPlace

PAIR_FIELDS = ("response", "sort", "chosen", "rejected")
SOLUTION_FIELDS = ("responses", "completions", "input", "problem", "steps")


def parse_orm_eval(rec: dict, where: RecordPlace, tokens: tuple[str, str], placeholder: str) -> PairRecord | PRMRecord:
    pair = [k for k in PAIR_FIELDS if is_present(rec, k)]
    solution = [k for k in SOLUTION_FIELDS if is_present(rec, k)]
    if pair and solution:
        where.fail(
            None,
            f"mixes preference-pair fields ({', '.join(pair)}) with solution fields ({', '.join(solution)})",
            f"one record is either a pair or a best-of-N candidate: {FORMATS['orm_eval']}",
        )
    if pair:
        return parse_pair(rec, where, tokens, placeholder)
    if not solution:
        keys = ", ".join(repr(k) for k in rec) or "none"
        where.fail(None, f"missing required fields (the record has: {keys})", f"use {FORMATS['orm_eval']}")
    record = parse_prm(rec, where, tokens, placeholder)
    if record.correct is None:
        if record.first_error is not None:
            where.fail(
                "label",
                "this is a ProcessBench record (label: the earliest wrong step), and ProcessBench's metrics need a "
                "score per step, which an ORM (one score per text) does not give",
                "evaluate ProcessBench data with a PRM (process_reward: true); an ORM evaluates preference pairs "
                "and best-of-N candidates (a solution with 'answer' and 'correct')",
            )
        where.fail(
            "correct",
            "is missing: this solution is no best-of-N candidate (no 'answer' / 'correct'), and an ORM (one score "
            "per text) has nothing to compare a lone solution with",
            "add its final 'answer' and 'correct' (true/false), give preference pairs, or evaluate step labels "
            "with a PRM (process_reward: true)",
        )
    # a candidate without a separate question (the Math-Shepherd layouts) and without 'group' stopped in parse_prm
    return record
