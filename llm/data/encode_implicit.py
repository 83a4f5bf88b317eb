"""Implicit-PRM records -> packable ``Example``s: a solution with a readout at every response token (its step index as
the readout's part, its outcome as the readout's value), or a preference pair of solutions (DPO form).

The response layout is the one the step scorer reads (``llm.alignment.rm.implicit``): every step followed by a
newline, each step tokenised on its own (``implicit_response_ids``), so a step's tokens are known exactly and a
step's log-ratio does not depend on the steps after it. A record's outcome (``record_outcome``): its ``correct``
flag (best-of-N candidates), else ProcessBench's ``first_error == -1``, else whether every step is labelled with
the positive reward token (one negative step: wrong; unlabelled steps and no negative one: unknown).
"""

from __future__ import annotations

import math

from transformers import PreTrainedTokenizerBase

from llm.data.encoding import EncodeConfig, OverlongCounter, fit_prompt, render_prompt, start_ids
from llm.data.packing import Example, causal_example, pair_coordinates, pair_example

STEP_END = "\n"  # what follows every step of an implicit PRM's response
PAIR_CHOSEN, PAIR_REJECTED = -1, -2  # readout parts of a pair's answers (a solution's readouts: its step index >= 0)


def implicit_response_ids(tokenizer: PreTrainedTokenizerBase, steps: list[str]) -> tuple[list[int], list[int]]:
    """Token ids of ``"".join(step + STEP_END for step in steps)``, each step tokenised on its own, and the step index
    of every token."""
    ids: list[int] = []
    step_of: list[int] = []
    if not steps:
        return ids, step_of
    for k, piece in enumerate(tokenizer([s + STEP_END for s in steps], add_special_tokens=False)["input_ids"]):
        ids += piece
        step_of += [k] * len(piece)
    return ids, step_of


def text_steps(text: str) -> list[str]:
    """A pair answer's steps: its non-empty lines, stripped (the sample pairs write one step per line)."""
    return [line.strip() for line in text.split(STEP_END) if line.strip()] or [text.strip() or "(empty)"]


def record_outcome(record, reward_tokens: tuple[str, str]) -> float:
    """1.0 (right), 0.0 (wrong) or NaN (unknown) for a PRM record (see the module docstring)."""
    if record.correct is not None:
        return float(record.correct)
    if record.first_error is not None:
        return float(record.first_error == -1)
    if reward_tokens[1] in record.labels:
        return 0.0
    if all(label == reward_tokens[0] for label in record.labels):
        return 1.0
    return math.nan


def prompt_ids(record, tokenizer: PreTrainedTokenizerBase, cfg: EncodeConfig) -> list[int]:
    """The conversation before the answer (a record without a prompt: the tokenizer's BOS, if any)."""
    if record.prompt:
        return render_prompt(record.prompt, tokenizer, cfg.use_chat_template)
    return start_ids(tokenizer)


def solution_readouts(prompt: list[int], response: list[int], offset: int = 0) -> tuple[list[int], list[int]]:
    """Positions and targets reading every response token at the position before it (none before the first token
    of a sequence: without a prompt the first response token is not read); ``offset``: where the sequence starts."""
    p = len(prompt)
    first = 0 if p else 1
    return [offset + p - 1 + j for j in range(first, len(response))], response[first:]


def encode_implicit_solution(
    record,
    tokenizer: PreTrainedTokenizerBase,
    cfg: EncodeConfig,
    reward_tokens: tuple[str, str],
    record_index: int,
    counter: OverlongCounter,
) -> Example | None:
    """``[prompt | response]`` with a readout at every response token: target the token, part its step, value the
    record's outcome. Too long: the steps that do not fit are dropped whole (``truncate``) or the record skipped."""
    full_prompt = prompt_ids(record, tokenizer, cfg)
    prompt = fit_prompt(full_prompt, cfg)
    if prompt is None:
        counter["skipped"] += 1
        return None
    response, step_of = implicit_response_ids(tokenizer, list(record.steps))
    status = "ok" if len(prompt) == len(full_prompt) else "truncated"
    room = cfg.max_seq_len - len(prompt)
    if len(response) > room:
        fits = [k for k in range(len(record.steps)) if step_of.index(k) + step_of.count(k) <= room]
        if cfg.overlong_policy == "skip" or not fits:
            counter["skipped"] += 1
            return None
        end = step_of.index(fits[-1]) + step_of.count(fits[-1])
        response, step_of, status = response[:end], step_of[:end], "truncated"
    counter[status] += 1
    positions, targets = solution_readouts(prompt, response)
    parts = step_of[len(step_of) - len(targets) :]
    outcome = record_outcome(record, reward_tokens)
    return causal_example(prompt + response, positions, targets, parts, record_index, [outcome] * len(targets))


def encode_implicit_pair(
    record, tokenizer: PreTrainedTokenizerBase, cfg: EncodeConfig, record_index: int, counter: OverlongCounter
) -> Example | None:
    """A preference pair ``[prompt | chosen | rejected]`` (chosen: the correct solution) with a readout at every
    answer token, parts ``PAIR_CHOSEN`` / ``PAIR_REJECTED``; each answer split into steps at its lines and laid out
    as a solution (``implicit_response_ids``). Too long: skipped (``skip``) or both answers cut to share the room."""
    full_prompt = prompt_ids(record, tokenizer, cfg)
    prompt = fit_prompt(full_prompt, cfg)
    if prompt is None or not prompt:
        counter["skipped"] += 1
        return None
    chosen = implicit_response_ids(tokenizer, text_steps(record.chosen))[0]
    rejected = implicit_response_ids(tokenizer, text_steps(record.rejected))[0]
    status = "ok" if len(prompt) == len(full_prompt) else "truncated"
    room = cfg.max_seq_len - len(prompt)
    if len(chosen) + len(rejected) > room:
        if cfg.overlong_policy == "skip" or room < 2:
            counter["skipped"] += 1
            return None
        c_len = min(len(chosen), max(room // 2, room - len(rejected)))
        chosen, rejected, status = chosen[:c_len], rejected[: room - c_len], "truncated"
    counter[status] += 1
    p = len(prompt)
    chosen_idx, rejected_idx = pair_coordinates(p, len(chosen), len(rejected))
    positions, targets, parts = [], [], []
    for idx, answer, part in ((chosen_idx, chosen, PAIR_CHOSEN), (rejected_idx, rejected, PAIR_REJECTED)):
        positions += [idx[p - 1 + k] for k in range(len(answer))]
        targets += answer
        parts += [part] * len(answer)
    return pair_example(prompt, chosen, rejected, positions, targets, parts, record=record_index)
