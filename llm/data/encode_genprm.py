"""A generative PRM's training text (``prm_kind: generative``): after every step, its critique and its verdict.

The layout, token by token (each piece tokenised alone, without special tokens, and concatenated, so that the
scorer, ``llm.alignment.rm.generative``, builds exactly these ids while it writes the critiques itself)::

    prompt | step 1 + "\\n" | critique 1 | verdict 1 | "\\n" | step 2 + "\\n" | critique 2 | verdict 2 | "\\n" | ...

``prompt`` is the PRM's (the rendered conversation, or the tokenizer's BOS when the question starts the first
step); the verdict is one token, the positive or negative reward token (``reward_tokens``). The loss covers the
critique tokens (readout part ``CRITIQUE``) and the verdict tokens (``VERDICT``) and nothing else: each is a
readout at the token before it, its target the token itself. A critique that holds a reward token would end
itself early when the model writes it (the scorer stops a critique at the first reward token), so such a record
is refused. Steps from the first unlabelled one on (ProcessBench after the first error) are not in the text.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from llm.data.encoding import EncodeConfig, OverlongCounter, fit_prompt, render_prompt, start_ids
from llm.data.packing import Example, causal_example
from llm.utils.errors import UserError

STEP_END = "\n"  # after a step's text, before its critique
STEP_SEPARATOR = "\n"  # after a verdict, before the next step
CRITIQUE, VERDICT = 0, 1  # readout_part of a critique token and of a verdict token


def step_ids(tokenizer: PreTrainedTokenizerBase, step: str) -> list[int]:
    return tokenizer(step + STEP_END, add_special_tokens=False)["input_ids"]


def separator_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    return tokenizer(STEP_SEPARATOR, add_special_tokens=False)["input_ids"]


def critique_ids(tokenizer: PreTrainedTokenizerBase, critique: str) -> list[int]:
    return tokenizer(critique, add_special_tokens=False)["input_ids"] if critique else []


def check_critique(ids: list[int], reward_ids: tuple[int, int], tokens: tuple[str, str], place: str, j: int) -> None:
    """A critique must not hold a verdict token: the model's critique ends at the first one it writes."""
    found = [t for t, i in zip(tokens, reward_ids) if i in ids]
    if found:
        raise UserError(
            f"{place}, field 'critiques': critique {j} holds the verdict token {found[0]!r} (one of reward_tokens), "
            "which would end the critique there when the model writes it. Fix: rephrase the critique without it "
            "(llm/run_critiques.py replaces such judge critiques by its template), or choose reward_tokens that "
            "the critiques do not use"
        )


def encode_genprm(
    record,
    tokenizer: PreTrainedTokenizerBase,
    cfg: EncodeConfig,
    reward_ids: tuple[int, int],
    reward_tokens: tuple[str, str],
    require_critiques: bool,
    record_index: int,
    counter: OverlongCounter,
) -> Example | None:
    """One solution with its critiques -> a causal example whose readouts are its critique and verdict tokens
    (target: the token; part: ``CRITIQUE`` or ``VERDICT``). A record without ``critiques`` (a dev record scored by
    generation only) gives an example without readouts, or stops the run when ``require_critiques`` (the training split). Too long: the
    text is cut after the last verdict that fits (``truncate``) or the record skipped."""
    place = f"{record.source}: record {record.index}"
    if record.critiques is None and require_critiques:
        raise UserError(
            f"{place}: has no 'critiques', which a generative PRM trains on (one per step). Fix: make them with "
            "llm/run_critiques.py (a judge model or a template), or set prm_kind discriminative"
        )
    full_prompt = (
        render_prompt(record.prompt, tokenizer, cfg.use_chat_template) if record.prompt else start_ids(tokenizer)
    )
    prompt = fit_prompt(full_prompt, cfg)
    if prompt is None:
        counter["skipped"] += 1
        return None
    if record.critiques is None:  # a dev record judged by generation only: in the split, with no loss item
        counter["ok"] += 1
        ids = (prompt or step_ids(tokenizer, record.steps[0]))[: cfg.max_seq_len]
        return causal_example(ids, [], [], record=record_index)
    ids, positions, targets, parts = list(prompt), [], [], []
    sep = separator_ids(tokenizer)
    ends: list[tuple[int, int]] = []  # per step: (len(ids), len(positions)) after its verdict
    for j, (step, critique, label) in enumerate(zip(record.steps, record.critiques, record.labels)):
        if label is None:
            break
        ids += step_ids(tokenizer, step)
        c = critique_ids(tokenizer, critique)
        check_critique(c, reward_ids, reward_tokens, place, j)
        for token, part in [(t, CRITIQUE) for t in c] + [(reward_ids[reward_tokens.index(label)], VERDICT)]:
            positions.append(len(ids) - 1)
            targets.append(token)
            parts.append(part)
            ids.append(token)
        ends.append((len(ids), len(positions)))
        ids += sep
    if not ends:  # the first step is unlabelled: nothing to train on
        if require_critiques:
            raise UserError(f"{place}, field 'labels': the first step has no label. Fix: label it, or drop the record")
        return None
    status = "ok" if len(prompt) == len(full_prompt) else "truncated"
    if len(ids) > cfg.max_seq_len:
        keep = [e for e in ends if e[0] <= cfg.max_seq_len]
        if cfg.overlong_policy == "skip" or not keep:
            counter["skipped"] += 1
            return None
        n_ids, n_readouts = keep[-1]
        ids, positions, targets, parts = ids[:n_ids], positions[:n_readouts], targets[:n_readouts], parts[:n_readouts]
        status = "truncated"
    counter[status] += 1
    return causal_example(ids, positions, targets, parts, record=record_index)
