"""Reward-model records -> packable ``Example``s: a PRM solution with a readout at every step's placeholder
(``encode_prm``), an ORM pair with readouts at each answer's last token (``encode_pair_for_scores``)."""

from __future__ import annotations

import math

from transformers import PreTrainedTokenizerBase

from llm.data.encoding import EncodeConfig, OverlongCounter, fit_prompt, render_prompt, start_ids
from llm.data.packing import Example, causal_example, pair_example
from llm.utils.errors import UserError

PRM_JOIN = " {placeholder}\n"


def prm_response_text(steps: list[str], placeholder: str) -> str:
    """PaddleNLP / Math-Shepherd layout: every step ends with the placeholder."""
    return PRM_JOIN.format(placeholder=placeholder).join(steps) + f" {placeholder}"


def prm_response_ids(
    tokenizer: PreTrainedTokenizerBase, steps: list[str], placeholder: str, placeholder_id: int
) -> tuple[list[int], list[int]]:
    """Token ids of ``prm_response_text(steps)``, built step by step, and the index of each step's placeholder.

    Each step's text is tokenised and ``placeholder_id`` appended (as TRL's PRMTrainer appends separator
    ids), so every step gets exactly one mark whatever the tokenizer does with the text around it:

    - byte-level BPE (Qwen2, Llama-3): " ки" would be "Ġк", "и"; the space stays with the step's text and
      the bare "ки" token follows;
    - sentencepiece (Mistral, Llama-2): " ки" is one token "▁ки" (Mistral 12902), so the step is cut
      before the space. A later step is tokenised as it stands in the joined text, right after the
      placeholder (alone, sentencepiece would prepend "▁" to it), and that leading placeholder token is
      dropped: the ids are those of encoding the joined text at once, Math-Shepherd's published input.
    """
    takes_space = tokenizer(f"{placeholder} {placeholder}", add_special_tokens=False)["input_ids"] == [
        placeholder_id,
        placeholder_id,
    ]
    end = "" if takes_space else " "
    texts = [steps[0] + end] + [f"{placeholder}\n{step}{end}" for step in steps[1:]]
    ids: list[int] = []
    marks: list[int] = []
    for k, piece in enumerate(tokenizer(texts, add_special_tokens=False)["input_ids"]):
        if k:
            if piece[:1] != [placeholder_id]:
                raise UserError(
                    f"placeholder_token {placeholder!r}: the tokenizer merges it with the newline after it "
                    f"({tokenizer.convert_ids_to_tokens(piece[:3])}): choose a placeholder that stays one token"
                )
            piece = piece[1:]
        ids += piece
        marks.append(len(ids))
        ids.append(placeholder_id)
    return ids, marks


UNLABELLED = -1  # the readout target of a step without a label (ProcessBench after the first error, best-of-N)
POSITIVE = 0  # the readout target of a step labelled with the positive reward token (1: the negative one)


def encode_prm(
    record,
    tokenizer: PreTrainedTokenizerBase,
    cfg: EncodeConfig,
    placeholder_id: int,
    placeholder: str,
    reward_tokens: tuple[str, str],
    record_index: int,
    counter: OverlongCounter,
) -> Example | None:
    """One solution -> causal example with a readout at every placeholder (target 0 '+', 1 '-'; value: the step's
    soft label, NaN where it has none).

    A record without a separate prompt (Math-Shepherd layouts, the question starts the first step) is
    ``[BOS] + ids(" ки\n".join(steps) + " ки")``, Math-Shepherd's ``tokenizer.encode(f"{question} {output}")``.
    Truncation cuts the response right after the last placeholder that fits, dropping the later
    steps *with* their labels, so no label ever moves onto another step.
    """
    if record.prompt:
        full_prompt = render_prompt(record.prompt, tokenizer, cfg.use_chat_template)
    else:
        full_prompt = start_ids(tokenizer)
    prompt = fit_prompt(full_prompt, cfg)
    response, marks = prm_response_ids(tokenizer, record.steps, placeholder, placeholder_id)
    # 0 = the positive token, 1 = the negative one, UNLABELLED (-1): scored, in no loss or step metric
    targets = [UNLABELLED if label is None else reward_tokens.index(label) for label in record.labels]
    values = [math.nan if v is None else v for v in record.soft_labels] if record.soft_labels is not None else []
    status = "ok"
    if prompt is None:
        counter["skipped"] += 1
        return None
    room = cfg.max_seq_len - len(prompt)
    if len(response) > room:
        keep = [k for k, m in enumerate(marks) if m < room]
        if cfg.overlong_policy == "skip" or not keep:
            counter["skipped"] += 1
            return None
        last = keep[-1]
        response, marks, targets = response[: marks[last] + 1], marks[: last + 1], targets[: last + 1]
        values = values[: last + 1]
        status = "truncated"
    elif len(prompt) < len(full_prompt):
        status = "truncated"
    counter[status] += 1
    offset = len(prompt)
    return causal_example(
        prompt + response, [offset + m for m in marks], targets, record=record_index, readout_value=values
    )


def encode_pair_for_scores(
    record,
    tokenizer: PreTrainedTokenizerBase,
    cfg: EncodeConfig,
    record_index: int,
    counter: OverlongCounter,
) -> Example | None:
    """[prompt | chosen + eos | rejected + eos]; readouts at the last chosen and last rejected token."""
    full_prompt = render_prompt(record.prompt, tokenizer, cfg.use_chat_template)
    prompt = fit_prompt(full_prompt, cfg)
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    chosen = tokenizer(record.chosen, add_special_tokens=False)["input_ids"] + eos
    rejected = tokenizer(record.rejected, add_special_tokens=False)["input_ids"] + eos
    if prompt is None:
        counter["skipped"] += 1
        return None
    room = cfg.max_seq_len - len(prompt)
    status = "ok" if len(prompt) == len(full_prompt) else "truncated"
    if len(chosen) + len(rejected) > room:
        if cfg.overlong_policy == "skip" or room < 2:
            counter["skipped"] += 1
            return None
        # Share the room: the shorter answer is kept whole when it fits in half.
        c_len = min(len(chosen), max(room // 2, room - len(rejected)))
        r_len = min(len(rejected), room - c_len)
        chosen, rejected = chosen[:c_len], rejected[:r_len]
        status = "truncated"
    counter[status] += 1
    p, c, r = len(prompt), len(chosen), len(rejected)
    return pair_example(prompt, chosen, rejected, [p + c - 1, p + c + r - 1], [0, 0], [0, 1], record=record_index)
