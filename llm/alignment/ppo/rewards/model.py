"""``reward.type: orm`` / ``prm``: a trained reward model read with the packed forward engine (engine.py).

- ``ORMReward``: the score head at the last response token, one outcome score per sample.
- ``PRMReward``: the response split into steps, scored by the discriminative PRM's step scorer
  (``llm.alignment.rm.scoring``: the placeholder after each step, ``P(+)`` read from the LM head's two reward
  tokens); ``prm_aggregation`` (``PRM_AGGREGATIONS``) turns them into a dense
  reward at each step's last response token, or one outcome score.

A reward model of another vocabulary than the actor's reads re-tokenised text (``retokenise``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, PreTrainedTokenizerBase

from llm.alignment.ppo.engine import forward_readouts
from llm.alignment.ppo.fsdp import head_linear
from llm.alignment.ppo.interfaces import RewardOutput, Samples
from llm.alignment.ppo.loading import load_frozen, offload_idle
from llm.alignment.ppo.rewards.base import RewardFunction, register_reward
from llm.alignment.rm.evaluation import AGGREGATIONS
from llm.alignment.rm.scoring import DiscriminativePRM
from llm.data.encoding import single_token_id
from llm.data.packing import causal_example
from llm.settings.registry import PRM_AGGREGATIONS

if TYPE_CHECKING:
    from llm.alignment.ppo.context import PPOContext
    from llm.alignment.ppo.loading import Place
    from llm.settings.ppo import PPOConfig

# prm_aggregation -> the outcome score of a sample's step scores (the evaluation's functions); "dense": none,
# a reward per step
PRM_AGGREGATIONS.add("dense", None)
for _name in ("min", "last", "mean"):
    PRM_AGGREGATIONS.add(_name, AGGREGATIONS[_name])


def same_vocabulary(a: PreTrainedTokenizerBase, b: PreTrainedTokenizerBase) -> bool:
    """Whether token ids of ``a`` mean the same in ``b`` (then a model of ``b`` can read ``a``'s ids)."""
    return a is b or a.get_vocab() == b.get_vocab()


def retokenise(samples: Samples, actor_tok: PreTrainedTokenizerBase, tok: PreTrainedTokenizerBase):
    """Token ids for a reward model: the actor's own when vocabularies agree, else re-tokenised text."""
    if same_vocabulary(actor_tok, tok):
        return samples.prompt_ids, samples.response_ids
    prompts = [tok(p)["input_ids"] for p in samples.prompts]
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    responses = [
        tok(r, add_special_tokens=False)["input_ids"] + eos * bool(samples.ended[i])
        for i, r in enumerate(samples.responses)
    ]
    return prompts, responses


@register_reward("orm", needs=("model_name_or_path",), has_model=True, value_head=True)
class ORMReward(RewardFunction):
    """Outcome reward model: score head at the last response token."""

    def __init__(self, model, tokenizer, actor_tokenizer, micro_batch_size: int) -> None:
        self.model, self.tokenizer, self.actor_tokenizer = model, tokenizer, actor_tokenizer
        self.micro_batch_size = micro_batch_size

    @classmethod
    def from_config(cls, c: PPOConfig, place: Place, run: PPOContext) -> ORMReward:
        r, tok = c.reward, run.reward_tokenizer
        model = load_frozen(
            c, AutoModelForSequenceClassification, r.model_name_or_path, r.init_from_config, tok, place, r.dtype,
            num_labels=1,
        )  # fmt: skip
        return offload_idle(c, cls(model, tok, run.tokenizer, c.micro("reward")), model, "reward", place, ("score",))

    @torch.no_grad()
    def score(self, samples: Samples) -> RewardOutput:
        prompts, responses = retokenise(samples, self.actor_tokenizer, self.tokenizer)
        examples = [
            causal_example(p + r, [len(p) + len(r) - 1], [0], record=i)
            for i, (p, r) in enumerate(zip(prompts, responses))
        ]
        scores = torch.zeros(len(samples))
        self.samples_seen += len(samples)
        head = lambda hidden: head_linear(self.model.score, hidden).squeeze(-1).float().cpu()
        pad = self.tokenizer.pad_token_id
        for batch, values in forward_readouts(self.model, examples, self.micro_batch_size, pad, False, head):
            scores[batch.records[batch.readout_example].cpu()] = values
        return RewardOutput(scores)


def split_steps(text: str, separator: str) -> list[tuple[int, int]]:
    """Character spans ``[start, end)`` of the non-empty steps of ``text``."""
    spans, start = [], 0
    for piece in text.split(separator):
        end = start + len(piece)
        if piece.strip():
            spans.append((start, end))
        start = end + len(separator)
    return spans


def response_steps(text: str, separator: str) -> tuple[list[str], list[tuple[int, int]]]:
    """The steps of a response as a PRM reads them (each stripped; a response without a non-empty step is one step,
    its stripped text or ``(empty)``) and their character spans (``split_steps``)."""
    spans = split_steps(text, separator)
    return [text[s:e].strip() for s, e in spans] or [text.strip() or "(empty)"], spans


def decoded_lengths(tokenizer, ids: list[int]) -> list[int]:
    """``len(tokenizer.decode(ids[: k + 1], skip_special_tokens=True))`` for every ``k``, in one pass.

    Incremental decoding with a cumulative length: each token's text is the growth of a short window's
    decode, the window starting at the token before the last complete point (so a leading-space rule or a
    byte-level merge sees its context); a window whose text ends in an incomplete character (U+FFFD, a
    byte-level token holding part of one) is not a complete point, and the next window starts before it.
    Each decode is over a few tokens: O(T) in all, instead of decoding every prefix (O(T^2))."""
    decode = lambda part: tokenizer.decode(part, skip_special_tokens=True)
    lengths = []
    # done: len(decode(ids[:start])); the window is ids[anchor:], base: len(decode(ids[anchor:start]))
    done, start, anchor, base = 0, 0, 0, 0
    for k in range(len(ids)):
        text = decode(ids[anchor : k + 1])
        lengths.append(done + len(text) - base)
        if not text.endswith("\ufffd"):  # a complete point: the next window starts at the last one
            done, start, last = lengths[-1], k + 1, start
            # ... unless that leaves the window nothing to show (skipped special tokens): a leading-space
            # rule (sentencepiece's) would then drop the next token's space
            base = len(decode(ids[last:start]))
            if base:
                anchor = last
            else:
                base = len(decode(ids[anchor:start]))
    return lengths


def char_to_token_end(tokenizer, response_ids: list[int], char_end: int, lengths: list[int] | None = None) -> int:
    """Index of the response token that completes the first ``char_end`` characters of its text: the first
    whose decoded prefix is that long (``lengths``: ``decoded_lengths`` of the response, computed once)."""
    lengths = decoded_lengths(tokenizer, response_ids) if lengths is None else lengths
    for k, n in enumerate(lengths):
        if n >= char_end:
            return k
    return len(response_ids) - 1


@register_reward("prm", needs=("model_name_or_path",), has_model=True)
class PRMReward(RewardFunction):
    """Process reward model: split the response into steps, insert the placeholder after each, read
    ``P(+)`` per step. ``dense``: each step score is a reward at the step's last response token;
    ``min`` / ``last`` / ``mean``: one outcome score."""

    def __init__(
        self,
        model,
        tokenizer,
        actor_tokenizer,
        separator: str,
        placeholder: str,
        reward_token_ids: tuple[int, int],
        placeholder_id: int,
        aggregation: str,
        micro_batch_size: int,
    ) -> None:
        self.model, self.tokenizer, self.actor_tokenizer = model, tokenizer, actor_tokenizer
        self.separator, self.aggregation = separator, aggregation
        self.scorer = DiscriminativePRM(
            model, tokenizer, placeholder, reward_token_ids, placeholder_id, micro_batch_size
        )

    @classmethod
    def from_config(cls, c: PPOConfig, place: Place, run: PPOContext) -> PRMReward:
        r, tok = c.reward, run.reward_tokenizer
        tokens = r.label_tokens
        ids = (
            single_token_id(tok, tokens[0], "reward.reward_tokens"),
            single_token_id(tok, tokens[1], "reward.reward_tokens"),
        )
        placeholder_id = single_token_id(tok, r.placeholder_token, "reward.placeholder_token")
        model = load_frozen(c, AutoModelForCausalLM, r.model_name_or_path, r.init_from_config, tok, place, r.dtype)
        prm = cls(
            model,
            tok,
            run.tokenizer,
            r.step_separator,
            r.placeholder_token,
            ids,
            placeholder_id,
            r.prm_aggregation,
            c.micro("reward"),
        )
        return offload_idle(c, prm, model, "reward", place, ("score",))

    def step_scores(self, samples: Samples) -> tuple[list[list[float]], list[list[tuple[int, int]]]]:
        """p(correct) of every step of every response (the step scorer's) and the steps' character spans."""
        split = [response_steps(r, self.separator) for r in samples.responses]
        self.samples_seen += len(samples)
        per_sample = self.scorer.score_steps(list(samples.prompts), [steps for steps, _ in split])
        return per_sample, [spans for _, spans in split]

    def score(self, samples: Samples) -> RewardOutput:
        per_sample, spans = self.step_scores(samples)
        agg = PRM_AGGREGATIONS[self.aggregation]
        if agg is not None:
            return RewardOutput(torch.tensor([agg(s) for s in per_sample]))
        T = max(len(r) for r in samples.response_ids)
        dense = torch.zeros(len(samples), T)
        for i, scores in enumerate(per_sample):
            ends = [e for _, e in spans[i]] or [len(samples.responses[i])]
            lengths = decoded_lengths(self.actor_tokenizer, samples.response_ids[i])
            for score, char_end in zip(scores, ends):
                dense[i, char_to_token_end(self.actor_tokenizer, samples.response_ids[i], char_end, lengths)] += score
        return RewardOutput(torch.zeros(len(samples)), dense)
