"""Prompts for PPO: the prompt file's records tokenised with the actor's tokenizer, and the samples of a
rollout made from prompts and response token ids."""

from __future__ import annotations

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


def make_samples(prompts: list[Prompt], responses: list[list[int]], tok) -> Samples:
    """Samples from given responses (``len(responses) // len(prompts)`` consecutive per prompt)."""
    k = len(responses) // len(prompts)
    expanded = [p for p in prompts for _ in range(k)]
    ended = torch.tensor([bool(r) and r[-1] == tok.eos_token_id for r in responses])
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
        out.append(Prompt(ids, text, rec.reference))
    if too_long:
        rec, n = too_long[0]
        raise UserError(
            f"{rec.source}: record {rec.index}: the prompt has {n} tokens, more than actor_rollout.max_prompt_length="
            f"{max_prompt_length} ({len(too_long)} prompt(s) too long in all): raise max_prompt_length or shorten them"
        )
    return out
