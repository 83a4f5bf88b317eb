"""PRM records (``kind="prm"``): PaddleNLP, TRL stepwise, Math-Shepherd, ProcessBench, best-of-N candidates.

Schema (``kind``)
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
    Soft labels (PaddleNLP and TRL layouts): an optional ``soft_labels`` list, one number in [0, 1] or
    null per step (``llm/run_label.py`` writes the fraction of completions reaching the answer), which
    a PRM trained with ``soft_labels: true`` takes as its targets.
    Critiques (PaddleNLP and TRL layouts): an optional ``critiques`` list, one string per step (what a
    generative PRM writes before the step's verdict; ``llm/run_critiques.py`` makes them).
    Best-of-N candidates: any PRM layout with ``answer`` (the final answer) and ``correct`` (a boolean)
    is one candidate of its problem's group (``group`` when given, else its question: the prompt, or
    ProcessBench's ``problem``); such a record may leave out ``labels`` (its steps are then unlabelled).
    A candidate without a separate question (the Math-Shepherd layouts: ``input``/``label``, or
    ``src: [""]``) must give ``group``: its question is only the start of its first step, which also
    holds that step's own text, so no key taken from the record would put one problem's candidates
    together; reading stops naming the record and the field instead.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, NoReturn

from llm.data.readers.common import is_present, pick_format, require, type_name
from llm.data.readers.conversation import paddle_prompt, trl_prompt
from llm.data.readers.records import PRMRecord
from llm.data.readers.sources import RecordPlace


def solution_steps(value: Any, field: str, where: RecordPlace, placeholder: str) -> list[str]:
    """A solution's steps: a non-empty list of non-empty strings, none holding the placeholder."""
    if not isinstance(value, (list, tuple)) or not all(isinstance(s, str) for s in value):
        where.fail(
            field, f"must be a list of step strings, got {type_name(value)}", "give the solution as a list of steps"
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


def _labels(value: Any, where: RecordPlace, tokens: tuple[str, str], n_steps: int, steps_field: str) -> list[str]:
    allowed = f"{tokens[0]!r} (correct) or {tokens[1]!r} (wrong)"
    if not isinstance(value, (list, tuple)):
        where.fail("labels", f"must be a list with one label per step, got {type_name(value)}", f"use labels {allowed}")
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


def _shepherd_steps(
    rec: dict, where: RecordPlace, tokens: tuple[str, str], placeholder: str
) -> tuple[list[str], list[str]]:
    """Hugging Face Math-Shepherd row: steps are ``input`` split at the placeholder, each label is the
    reward token standing at that placeholder's place in ``label`` (elsewhere the two texts are equal)."""
    for field in ("input", "label"):
        if not isinstance(rec[field], str):
            where.fail(field, f"must be a string, got {type_name(rec[field])}", "give the solution text")
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


def parse_prm(rec: dict, where: RecordPlace, tokens: tuple[str, str], placeholder: str) -> PRMRecord:
    processbench = ("problem", "steps")
    # "label" marks Math-Shepherd's layout, unless ProcessBench's fields are there (its label is the first error)
    shepherd = ("input",) if any(is_present(rec, k) for k in processbench) else ("input", "label")
    fmt = pick_format(rec, where, "prm", ("src", "responses"), ("prompt", "completions"), shepherd, processbench)
    candidate = _candidate(rec, where)
    if fmt == "processbench":
        return _processbench(rec, where, tokens, placeholder, candidate)
    if fmt == "shepherd":
        require(rec, where, "prm", ("input", "label"), "Math-Shepherd")
        steps, labels = _shepherd_steps(rec, where, tokens, placeholder)
        _need_group(candidate, where, "Math-Shepherd layout: the question starts 'input'")
        return PRMRecord([], steps, labels, where.path, where.index, **candidate)
    unlabelled = candidate["correct"] is not None and not is_present(rec, "labels")
    if fmt == "paddle":
        require(rec, where, "prm", ("src", "responses") + (() if unlabelled else ("labels",)), "PaddleNLP PRM")
        prompt, steps_field = paddle_prompt(rec, where, allow_none=True), "responses"
    else:
        require(rec, where, "prm", ("prompt", "completions") + (() if unlabelled else ("labels",)), "TRL stepwise")
        prompt, steps_field = trl_prompt(rec, where), "completions"
    steps = solution_steps(rec[steps_field], steps_field, where, placeholder)
    labels = [None] * len(steps) if unlabelled else _labels(rec["labels"], where, tokens, len(steps), steps_field)
    soft = _soft_labels(rec["soft_labels"], where, len(steps), steps_field) if is_present(rec, "soft_labels") else None
    critiques = _critiques(rec["critiques"], where, len(steps), steps_field) if is_present(rec, "critiques") else None
    if not prompt:  # PaddleNLP's Math-Shepherd conversion (src: [""]): the question starts the first step
        _need_group(candidate, where, "'src' is empty: the question starts the first of 'responses'")
    elif candidate["correct"] is not None and candidate["group"] is None:
        candidate["group"] = json.dumps([m["content"] for m in prompt])
    return PRMRecord(prompt, steps, labels, where.path, where.index, soft_labels=soft, critiques=critiques, **candidate)


def _critiques(value: Any, where: RecordPlace, n_steps: int, steps_field: str) -> list[str]:
    """``critiques``: one string per step, the text a generative PRM writes before the step's verdict."""
    if not isinstance(value, (list, tuple)) or not all(isinstance(c, str) for c in value):
        where.fail(
            "critiques",
            f"must be a list of strings, one per step, got {type_name(value)}",
            "give one critique per step",
        )
    if len(value) != n_steps:
        where.fail(
            "critiques",
            f"has {len(value)} critique(s) but '{steps_field}' has {n_steps} step(s)",
            "give exactly one critique per step (make them with llm/run_critiques.py)",
        )
    return list(value)


def _soft_labels(value: Any, where: RecordPlace, n_steps: int, steps_field: str) -> list[float | None]:
    """``soft_labels``: one value in [0, 1] per step (the fraction of completions from the step's prefix that reach
    the answer, ``llm/run_label.py``), null where a step has none."""
    if not isinstance(value, (list, tuple)):
        where.fail("soft_labels", f"must be a list with one value per step, got {type_name(value)}", "give a list")
    if len(value) != n_steps:
        where.fail(
            "soft_labels",
            f"has {len(value)} value(s) but '{steps_field}' has {n_steps} step(s)",
            "give exactly one soft label (or null) per step",
        )
    for j, v in enumerate(value):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1):
            where.fail(
                "soft_labels",
                f"value {j} is {v!r}, not a number in [0, 1]",
                "give each step's fraction of right completions, in [0, 1], or null",
            )
    return [None if v is None else float(v) for v in value]


def _need_group(candidate: dict, where: RecordPlace, layout: str) -> None:
    """A best-of-N candidate without a separate question must name its problem in ``group``."""
    if candidate["correct"] is None or candidate["group"] is not None:
        return
    where.fail(
        "group",
        f"is missing, and this best-of-N candidate has no separate question ({layout}, in one step with that "
        "step's own text), so which problem it answers cannot be told from the record",
        "add a 'group' field naming its problem to every candidate (the same for all candidates of one problem)",
    )


_SUBSET_ID = re.compile(r"^(.+)-\d+$")


def _optional_text(rec: dict, field: str, where: RecordPlace) -> str | None:
    if not is_present(rec, field):
        return None
    value = rec[field]
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        where.fail(field, f"must be a string or a number, got {type_name(value)}", f"give {field} as a string")
    return str(value)


def _candidate(rec: dict, where: RecordPlace) -> dict:
    """The best-of-N fields (``group``, ``answer``, ``correct``) and ``generator``; answer and correct come together."""
    out = {
        "group": _optional_text(rec, "group", where),
        "answer": _optional_text(rec, "answer", where),
        "generator": _optional_text(rec, "generator", where),
        "correct": None,
    }
    # ProcessBench's final_answer_correct is the correctness of a candidate that gives its answer
    flag = "correct" if is_present(rec, "correct") or out["answer"] is None else "final_answer_correct"
    if is_present(rec, flag):
        if not isinstance(rec[flag], bool):
            where.fail(flag, f"must be true or false, got {type_name(rec[flag])}", "give a JSON boolean")
        out["correct"] = rec[flag]
    if (out["answer"] is None) != (out["correct"] is None):
        have, need = ("answer", "correct") if out["answer"] is not None else ("correct", "answer")
        where.fail(need, f"is missing while '{have}' is given", "a best-of-N candidate needs both answer and correct")
    if out["correct"] is not None and out["group"] is not None and not out["group"].strip():
        where.fail("group", "is empty", "name the candidate's problem (the same for all candidates of one problem)")
    return out


def _processbench(
    rec: dict, where: RecordPlace, tokens: tuple[str, str], placeholder: str, candidate: dict
) -> PRMRecord:
    require(rec, where, "prm", ("problem", "steps", "label"), "ProcessBench")
    if not isinstance(rec["problem"], str) or not rec["problem"].strip():
        where.fail("problem", "must be a non-empty string", "give the problem text")
    steps = solution_steps(rec["steps"], "steps", where, placeholder)
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
