"""Records -> packable ``Example``s, with the over-long policy applied and counted."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from llm.data.packing import Example, causal_example, pair_example
from llm.utils.errors import UserError

logger = logging.getLogger(__name__)


def single_token_id(
    tokenizer: PreTrainedTokenizerBase,
    token: str,
    field: str,
    fix: str = "choose a token from the vocabulary or add it to the tokenizer",
) -> int:
    """Id of ``token`` encoded alone; stops the run if the tokenizer splits it.

    For the reward tokens this is the id Math-Shepherd reads out (``tokenizer.encode("+ -")[1:]``):
    sentencepiece encodes a text with its leading "▁", so "+" alone is "▁+" (Mistral 648), as in "+ -".
    """
    ids = tokenizer.encode(token, add_special_tokens=False)
    if len(ids) != 1:
        pieces = tokenizer.convert_ids_to_tokens(ids)
        raise UserError(
            f"{field}: {token!r} must be exactly one token, but the tokenizer splits it into {len(ids)}: {pieces}; "
            f"{fix}"
        )
    return ids[0]


# Placeholders worth suggesting, in order: Math-Shepherd's own, then rare symbols that many vocabularies hold whole.
PLACEHOLDER_CANDIDATES = ("ки", "§", "†", "¶", "∎", "→")


def usable_placeholder(tokenizer: PreTrainedTokenizerBase, text: str) -> bool:
    """``text`` works as the PRM placeholder of this tokenizer: one token encoded alone, and still that token
    at the start of the next step's text, ``"<placeholder>\n<step>"`` (what ``prm_response_ids`` checks)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        return False
    return tokenizer.encode(f"{text}\nStep", add_special_tokens=False)[:1] == ids


def placeholder_token_id(tokenizer: PreTrainedTokenizerBase, placeholder: str, field: str) -> int:
    """Id of the PRM step placeholder, which must be one token when encoded alone. When it is not, the message
    suggests a placeholder that is one token in *this* tokenizer (the first of ``PLACEHOLDER_CANDIDATES`` that
    passes ``usable_placeholder``), besides adding it with ``add_placeholder_token``."""
    fix = (
        "set add_placeholder_token: true to add it to the tokenizer as a new special token (the model gets a new "
        "embedding row, learnt in training)"
    )
    found = next((c for c in PLACEHOLDER_CANDIDATES if c != placeholder and usable_placeholder(tokenizer, c)), None)
    if found is not None:
        fix += f", or choose a placeholder that is one token of this tokenizer, e.g. {field}: {found!r}"
    else:
        fix += f" (none of {', '.join(map(repr, PLACEHOLDER_CANDIDATES))} is one token of this tokenizer)"
    return single_token_id(tokenizer, placeholder, field, fix=fix)


def add_placeholder_token(tokenizer: PreTrainedTokenizerBase, placeholder: str) -> bool:
    """``add_placeholder_token``: make the placeholder one token by adding it as a special token.
    True when it was added (the model's embeddings must then cover ``len(tokenizer)`` ids)."""
    if len(tokenizer.encode(placeholder, add_special_tokens=False)) == 1:
        logger.info("placeholder_token %r is already one token of the tokenizer: nothing added", placeholder)
        return False
    tokenizer.add_special_tokens({"extra_special_tokens": [placeholder]}, replace_extra_special_tokens=False)
    logger.info(
        "placeholder_token %r added to the tokenizer as special token id %d (len(tokenizer) = %d)",
        placeholder,
        placeholder_token_id(tokenizer, placeholder, "placeholder_token"),
        len(tokenizer),
    )
    return True


def start_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """What the tokenizer puts before a text: [BOS], or nothing (Qwen)."""
    ids = tokenizer("")["input_ids"]
    return ids[:1] if ids and ids[0] == tokenizer.bos_token_id else []


def resolve_chat_template(
    setting: bool | None, tokenizer: PreTrainedTokenizerBase, field: str = "use_chat_template"
) -> bool:
    """Whether prompts are rendered with the tokenizer's chat template: ``setting`` when the config gives it, else
    (None, the default) exactly when the tokenizer has a template, so an instruct model is fed the format it was
    tuned on rather than plain text. Called once where a script loads its tokenizer; the choice is logged, and
    true without a template stops the run here, naming ``field``."""
    has_template = getattr(tokenizer, "chat_template", None) is not None
    if setting is None:
        why = (
            f"the tokenizer has a chat template; set {field} false for plain text"
            if has_template
            else "the tokenizer has no chat template"
        )
        choice = has_template
    else:
        if setting and not has_template:
            raise UserError(
                f"{field} is true but the tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat_template: "
                f"set {field} false, or leave it unset (it then follows the tokenizer)"
            )
        why, choice = "set in the config", setting
    logger.info("%s: %s (%s)", field, "on" if choice else "off", why)
    return choice


def render_prompt(messages: list[dict], tokenizer: PreTrainedTokenizerBase, use_chat_template: bool) -> list[int]:
    """Token ids of the conversation before the answer (with BOS when the tokenizer adds one)."""
    if use_chat_template:
        if tokenizer.chat_template is None:
            raise UserError("use_chat_template is true but the tokenizer has no chat_template: set it false")
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    text = "\n".join(m["content"] for m in messages) + "\n"
    return tokenizer(text)["input_ids"]


@dataclass
class EncodeConfig:
    max_seq_len: int
    max_prompt_len: int
    overlong_policy: str = "truncate"  # or "skip"
    use_chat_template: bool = False


class OverlongCounter(Counter):
    """Examples kept whole, truncated and skipped; the first ``NAMED`` skipped records by file and number."""

    NAMED = 5

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.skipped_records: list[tuple[str, int]] = []

    def encode(self, encode, record, record_index: int, **kwargs):
        """``encode(record, ...)``, naming the record if it was skipped."""
        before = self["skipped"]
        example = encode(record, record_index=record_index, counter=self, **kwargs)
        if self["skipped"] > before and len(self.skipped_records) < self.NAMED:
            where = (getattr(record, "source", None) or "?", getattr(record, "index", record_index))
            self.skipped_records.append(where)
        return example

    def named(self) -> str:
        """The skipped records named so far, grouped by file: ``a.jsonl records 3, 7; b.jsonl record 0``."""
        files: dict[str, list[int]] = {}
        for source, index in self.skipped_records:
            files.setdefault(source, []).append(index)
        parts = [f"{src} record{'s' if len(ix) > 1 else ''} {', '.join(map(str, ix))}" for src, ix in files.items()]
        more = self["skipped"] - len(self.skipped_records)
        return "; ".join(parts) + (f" and {more} more" if more > 0 else "")

    def report(self, what: str) -> str:
        text = f"{what}: {self['ok']} kept whole, {self['truncated']} truncated, {self['skipped']} skipped as too long"
        if self["skipped"]:
            text += f" ({self.named()}; raise max_seq_len / max_prompt_len, or overlong_policy truncate, to keep them)"
        return text


def fit_prompt(prompt: list[int], cfg: EncodeConfig) -> list[int] | None:
    """``prompt`` if it fits ``max_prompt_len``; else its end (``truncate``) or None (``skip``)."""
    if len(prompt) <= cfg.max_prompt_len:
        return prompt
    return prompt[-cfg.max_prompt_len :] if cfg.overlong_policy == "truncate" else None


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
    """One solution -> causal example with a readout at every placeholder (target 0 '+', 1 '-').

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
        status = "truncated"
    elif len(prompt) < len(full_prompt):
        status = "truncated"
    counter[status] += 1
    offset = len(prompt)
    return causal_example(prompt + response, [offset + m for m in marks], targets, record=record_index)


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


def encode_all(records: Iterable, encode, what: str, **kwargs) -> tuple[list[Example], OverlongCounter]:
    counter = OverlongCounter()
    examples = []
    for i, record in enumerate(records):
        ex = counter.encode(encode, record, i, **kwargs)
        if ex is not None:
            examples.append(ex)
    (logger.warning if counter["skipped"] else logger.info)(counter.report(what))
    return examples, counter
