"""Conversations -> token segments -> ``Example``s with language-model readouts (SFT, DPO).

A conversation is rendered as segments in order: context (system/user text, and the template's
markup) and assistant turns. Rendering is segment by segment, so where each assistant turn starts
and ends is exact, whatever the tokenizer merges across a boundary would have been.

- ``use_chat_template``: the segments are found by rendering growing prefixes with the tokenizer's
  chat template. The context before assistant turn i is what ``template(messages[:i],
  add_generation_prompt=True)`` adds to the text so far; the turn itself is what
  ``template(messages[:i + 1])`` adds after that: the content and the template's end-of-turn text
  (TRL's convention for conversational data; no extra EOS). A template that rewrites earlier turns
  (one that drops reasoning from past answers, say) has no such prefixes and stops the run.
- plain text: as ``render_prompt``, context messages are their texts each followed by a newline
  with BOS at the start; an assistant turn is its text followed by EOS (TRL's convention for
  plain text). A single-turn prompt gives exactly ``render_prompt``'s ids.

Readouts follow ``llm.data.packing``: the output at the token *before* a target predicts it
(``readout_position = t - 1``, ``readout_target = ids[t]``). SFT trains on every assistant turn
of a multi-turn conversation, as PaddleNLP does with a chat template (``tokenize_rounds_example``
labels the answer of every round).
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from llm.data.encoding import EncodeConfig, OverlongCounter
from llm.data.packing import Example, causal_example, pair_coordinates, pair_example
from llm.utils.errors import UserError

CHOSEN, REJECTED, PROMPT = 0, 1, 2  # readout_part of LM readouts; PROMPT readouts only for ORPO's NLL term


@dataclass
class Segment:
    ids: list[int]
    is_answer: bool  # an assistant turn (a training target) or context


def render_conversation(
    messages: list[dict], tokenizer: PreTrainedTokenizerBase, use_chat_template: bool
) -> list[Segment]:
    """Token segments of ``messages`` (which end with an assistant turn), context and answers alternating."""
    if use_chat_template:
        return _chat_segments(messages, tokenizer)
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    segments: list[Segment] = []
    context: list[str] = []
    for msg in messages:
        if msg["role"] != "assistant":
            context.append(msg["content"] + "\n")
            continue
        # BOS (when the tokenizer adds one) only at the very start
        first = not segments
        segments.append(Segment(tokenizer("".join(context), add_special_tokens=first)["input_ids"], False))
        segments.append(Segment(tokenizer(msg["content"], add_special_tokens=False)["input_ids"] + eos, True))
        context = []
    return segments


def _chat_segments(messages: list[dict], tokenizer: PreTrainedTokenizerBase) -> list[Segment]:
    if tokenizer.chat_template is None:
        raise UserError("use_chat_template is true but the tokenizer has no chat_template: set it false")

    def render(msgs: list[dict], generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(msgs, add_generation_prompt=generation_prompt, tokenize=False)

    segments: list[Segment] = []
    done = ""
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        prompt, full = render(messages[:i], True), render(messages[: i + 1], False)
        if not (prompt.startswith(done) and full.startswith(prompt)):
            raise UserError(
                "the chat template does not render a conversation as growing prefixes (it rewrites earlier turns), "
                "so the assistant turns cannot be located: set use_chat_template false or use another template"
            )
        for text, is_answer in ((prompt[len(done) :], False), (full[len(prompt) :], True)):
            segments.append(Segment(tokenizer(text, add_special_tokens=False)["input_ids"], is_answer))
        done = full
    return segments


def _fit_context(ids: list[int], cfg: EncodeConfig) -> list[int] | None:
    """The context before the first answer, limited to ``max_prompt_len`` (kept from the right)."""
    if len(ids) <= cfg.max_prompt_len:
        return ids
    return ids[-cfg.max_prompt_len :] if cfg.overlong_policy == "truncate" else None


def encode_sft(
    record, tokenizer: PreTrainedTokenizerBase, cfg: EncodeConfig, record_index: int, counter: OverlongCounter
) -> Example | None:
    """One conversation -> causal example with a readout for every token of every assistant turn.

    Over-long: the first context is cut to ``max_prompt_len`` from the left, then the sequence to
    ``max_seq_len`` from the right (later turns lose their tail); ``skip`` drops the example instead.
    """
    segments = render_conversation(record.messages, tokenizer, cfg.use_chat_template)
    first = _fit_context(segments[0].ids, cfg)
    if first is None:
        counter["skipped"] += 1
        return None
    status = "ok" if len(first) == len(segments[0].ids) else "truncated"
    ids, targets = list(first), []
    for seg in segments[1:]:
        if seg.is_answer:
            targets += range(len(ids), len(ids) + len(seg.ids))
        ids += seg.ids
    if len(ids) > cfg.max_seq_len:
        if cfg.overlong_policy == "skip":
            counter["skipped"] += 1
            return None
        ids, targets, status = ids[: cfg.max_seq_len], [t for t in targets if t < cfg.max_seq_len], "truncated"
    if not targets:
        counter["skipped"] += 1
        return None
    counter[status] += 1
    return causal_example(ids, [t - 1 for t in targets], [ids[t] for t in targets], record=record_index)


def _share_room(chosen: list[int], rejected: list[int], room: int) -> tuple[list[int], list[int]]:
    """Cut two answers to fit ``room`` tokens together; the shorter one stays whole when it fits in half."""
    c_len = min(len(chosen), max(room // 2, room - len(rejected)))
    return chosen[:c_len], rejected[: min(len(rejected), room - c_len)]


def encode_pair_for_lm(
    record,
    tokenizer: PreTrainedTokenizerBase,
    cfg: EncodeConfig,
    record_index: int,
    counter: OverlongCounter,
    prompt_targets: bool = False,
) -> Example | None:
    """[prompt | chosen | rejected] with a readout for every answer token (part 0 chosen, 1 rejected).

    The first rejected token is read at the last *prompt* position (``pair_coordinates``).
    ``prompt_targets`` adds readouts for prompt tokens 1.. (part 2), for ORPO's NLL term.
    """
    prompt_msgs = record.prompt
    chosen_segs = render_conversation(
        prompt_msgs + [{"role": "assistant", "content": record.chosen}], tokenizer, cfg.use_chat_template
    )
    rejected_segs = render_conversation(
        prompt_msgs + [{"role": "assistant", "content": record.rejected}], tokenizer, cfg.use_chat_template
    )
    full_prompt = [t for seg in chosen_segs[:-1] for t in seg.ids]
    chosen, rejected = chosen_segs[-1].ids, rejected_segs[-1].ids
    prompt = _fit_context(full_prompt, cfg)
    if prompt is None:
        counter["skipped"] += 1
        return None
    status = "ok" if len(prompt) == len(full_prompt) else "truncated"
    room = cfg.max_seq_len - len(prompt)
    if len(chosen) + len(rejected) > room:
        if cfg.overlong_policy == "skip" or room < 2:
            counter["skipped"] += 1
            return None
        chosen, rejected = _share_room(chosen, rejected, room)
        status = "truncated"
    counter[status] += 1
    p, c, r = len(prompt), len(chosen), len(rejected)
    chosen_idx, rejected_idx = pair_coordinates(p, c, r)
    positions, targets, parts = [], [], []
    if prompt_targets:
        positions += range(p - 1)
        targets += prompt[1:]
        parts += [PROMPT] * (p - 1)
    for idx, answer, part in ((chosen_idx, chosen, CHOSEN), (rejected_idx, rejected, REJECTED)):
        positions += [idx[p - 1 + k] for k in range(len(answer))]
        targets += answer
        parts += [part] * len(answer)
    return pair_example(prompt, chosen, rejected, positions, targets, parts, record=record_index)
