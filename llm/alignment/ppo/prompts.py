"""Prompts for PPO: the prompt file's records tokenised with the actor's tokenizer, the run's seeded stream of
them (``PromptStream``), and the samples of a rollout made from prompts and response token ids."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from llm.alignment.ppo.interfaces import Samples
from llm.data.encoding import render_prompt
from llm.data.readers import PromptRecord
from llm.utils.errors import UserError


@dataclass
class Prompt:
    ids: list[int]
    text: str
    reference: str | None
    messages: list[dict] | None = None  # the conversation the ids render (multi-turn episodes render it again)
    record: dict | None = None  # the prompt record's fields as read (an environment's task)


def prompt_stream(n_prompts: int, position: int, count: int, seed: int, shuffle: bool) -> list[int]:
    """Prompts ``position .. position + count - 1`` of the run's stream: pass ``e`` over the ``n_prompts``
    prompts is a permutation seeded with ``seed + e`` (file order without ``shuffle``, MindSpeed's no_shuffle),
    so any stretch of it depends only on its position."""
    out: list[int] = []
    while len(out) < count:
        epoch, offset = divmod(position, n_prompts)
        order = list(range(n_prompts))
        if shuffle:
            random.Random(seed + epoch).shuffle(order)
        take = min(count - len(out), n_prompts - offset)
        out += order[offset : offset + take]
        position += take
    return out


class PromptStream:
    """Which prompts each step's rollout answers: ``batch_size`` (``data.rollout_batch_size``) a step from one
    seeded stream (``prompt_stream``). The extra rounds of DAPO's dynamic sampling draw the next ones
    (``draw_more``), counted in ``extra_prompts``, which the checkpoint keeps: the prompts of a step depend only
    on its number and the extra prompts drawn before it, so a resumed run draws those of an uninterrupted one."""

    def __init__(self, n_prompts: int, batch_size: int, seed: int, shuffle: bool) -> None:
        self.n_prompts, self.batch_size, self.seed, self.shuffle = n_prompts, batch_size, seed, shuffle
        self.extra_prompts = 0

    def indices(self, step: int) -> list[int]:
        """The prompts of ``step`` (0-based); after ``draw_more``, those of the step's next round."""
        position = step * self.batch_size + self.extra_prompts
        return prompt_stream(self.n_prompts, position, self.batch_size, self.seed, self.shuffle)

    def draw_more(self) -> None:
        """The stream moves on by one batch within the step (an extra generation round)."""
        self.extra_prompts += self.batch_size

    def state(self) -> dict:
        return {"extra_prompts": self.extra_prompts}

    def load_state(self, state: dict) -> None:
        """From ``trainer_state.json``'s ``dapo`` entry; a checkpoint written before dynamic sampling drew none."""
        try:
            self.extra_prompts = int(state.get("extra_prompts", 0))
        except (AttributeError, TypeError, ValueError) as err:
            raise UserError(
                f"trainer_state.json: dapo.extra_prompts is not a count ({err}); the checkpoint is damaged"
            ) from None


def make_samples(
    prompts: list[Prompt], responses: list[list[int]], tok, stop_ids: tuple[int, ...] | None = None
) -> Samples:
    """Samples from given responses (``len(responses) // len(prompts)`` consecutive per prompt); a response
    ``ended`` when its last token is one of ``stop_ids`` (the run's, ``PPOContext.stop_ids``; None: the
    tokenizer's EOS)."""
    k = len(responses) // len(prompts)
    expanded = [p for p in prompts for _ in range(k)]
    stops = (tok.eos_token_id,) if stop_ids is None else stop_ids
    ended = torch.tensor([bool(r) and r[-1] in stops for r in responses])
    responses = [r if r else [tok.eos_token_id] for r in responses]  # an empty response still gets a token
    return Samples(
        prompt_ids=[p.ids for p in expanded],
        response_ids=responses,
        prompts=[p.text for p in expanded],
        responses=[tok.decode(r, skip_special_tokens=True) for r in responses],
        references=[p.reference for p in expanded],
        ended=ended,
    )


def prompts_from_records(
    records: list[PromptRecord], tokenizer, max_prompt_length: int, use_chat_template: bool
) -> list[Prompt]:
    """Tokenise prompts; a prompt over ``max_prompt_length`` stops the run naming it (never cut silently)."""
    out, too_long = [], []
    for rec in records:
        ids = render_prompt(rec.prompt, tokenizer, use_chat_template)
        if len(ids) > max_prompt_length:
            too_long.append((rec, len(ids)))
            continue
        text = tokenizer.decode(ids, skip_special_tokens=True)
        out.append(Prompt(ids, text, rec.reference, rec.prompt, rec.fields))
    if too_long:
        rec, n = too_long[0]
        raise UserError(
            f"{rec.source}: record {rec.index}: the prompt has {n} tokens, more than actor_rollout.max_prompt_length="
            f"{max_prompt_length} ({len(too_long)} prompt(s) too long in all): raise max_prompt_length or shorten them"
        )
    return out
