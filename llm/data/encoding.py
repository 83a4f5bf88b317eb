"""What every encoder shares: single-token checks (reward tokens, the placeholder), the chat-template choice, prompt
rendering and fitting, and the over-long policy applied and counted (``encode_all``). The encoders themselves:
``encode_reward`` (PRM and ORM/pairs for score heads), ``encode_lm`` (SFT and DPO)."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from llm.data.packing import Example
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
    return tokenizer(plain_prompt_text(messages))["input_ids"]


def plain_prompt_text(messages: list[dict]) -> str:
    """The text of a conversation before the answer without a chat template: the messages' contents, one a line,
    and a newline after the last (the answer starts on a line of its own). Another trainer given the bare
    prompt (TRL's string prompts) samples from another context: after a bare "...?" SmolLM2 ended the turn at
    once in 20 of 64 completions, after "...?\\n" in none (bench/README.md, "GRPO: completion lengths at step 0")."""
    return "\n".join(m["content"] for m in messages) + "\n"


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


def encode_all(records: Iterable, encode, what: str, **kwargs) -> tuple[list[Example], OverlongCounter]:
    counter = OverlongCounter()
    examples = []
    for i, record in enumerate(records):
        ex = counter.encode(encode, record, i, **kwargs)
        if ex is not None:
            examples.append(ex)
    (logger.warning if counter["skipped"] else logger.info)(counter.report(what))
    return examples, counter
