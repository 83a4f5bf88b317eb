"""The generative PRM as a step scorer (``prm.kind: generative``; ``run_reward.py`` with ``prm_kind: generative``
trains it): for every step it writes a critique, then its verdict; the step's score is p(positive verdict).

One pass over a solution builds the training layout of ``llm.data.encode_genprm`` token by token: the prompt, then
for each step its ids (``step_ids``), the critique the model writes (greedy, or sampled at ``temperature``), one
token at a time with the KV cache, until it writes a reward token or has written ``max_tokens``; at that position
the step's score is ``softmax([logit(+), logit(-)])[0]``, the discriminative PRM's reading at its placeholder. The
verdict the model wrote (or, at the cap, the likelier of the two) and the separator follow, and the next step
reads the critiques and verdicts before it. With ``samples`` k > 1 the solution gets k independent passes and a
step's score is the mean of its k probabilities (GenPRM / ThinkPRM's averaged verifications). Each pass is seeded
by the seed, its solution's index in the call and the pass, so its critiques do not depend on the others.

``judge`` runs up to ``batch_size`` passes together (``judge_batch``): one left-padded forward over their first
pieces, then one forward per token for all of them, each pass feeding its own next token (its prompt, step,
verdict and separator ids, or the critique token it picked); a pass that is done feeds padding, masked out. The
scores are ``judge_pass``'s, one pass at a time, up to float rounding of the batched forward.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase

from llm.alignment.rm.scoring import DTYPES, register_step_scorer
from llm.data.encode_genprm import separator_ids, step_ids
from llm.data.encoding import single_token_id
from llm.settings.shared import reward_token_pair
from llm.utils.attention import standard_attention
from llm.utils.errors import UserError
from llm.utils.modeling import load_model, load_tokenizer

if TYPE_CHECKING:
    from llm.settings.search import PRMSection


@dataclass(frozen=True)
class CritiqueSettings:
    """How the critiques are written: ``samples`` passes per solution, at most ``max_tokens`` per critique, at
    ``temperature`` (0: greedy), seeded by ``seed``; ``batch_size`` passes generate together."""

    samples: int = 1
    max_tokens: int = 64
    temperature: float = 0.0
    seed: int = 0
    batch_size: int = 16


@dataclass
class Judgement:
    """One solution judged: the step scores (the mean over the passes) and, per pass, each step's critique text
    and verdict probability."""

    scores: list[float]
    critiques: list[list[str]]  # [pass][step]
    pass_scores: list[list[float]]  # [pass][step]


class _Cache:
    """A causal LM fed token ids a piece at a time with its KV cache; ``feed`` returns the last position's logits."""

    def __init__(self, model) -> None:
        self.model, self.past = model, None
        self.device = next(model.parameters()).device

    def feed(self, ids: list[int]) -> torch.Tensor:
        # after the first piece one token at a time: several new tokens over a cache would meet a causal mask
        # aligned to the top left by some attention kernels (SDPA's is_causal with fewer queries than keys)
        pieces = [ids] if self.past is None else [[t] for t in ids]
        for piece in pieces:
            out = self.model(input_ids=torch.tensor([piece], device=self.device), cache=self.past, use_cache=True)
            self.past = out.cache
        return out.logits[0, -1].float()


def _pick(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    if temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits / temperature, -1).cpu()
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.no_grad()
def judge_pass(
    model,
    prompt_ids: list[int],
    steps: list[list[int]],
    reward_ids: tuple[int, int],
    separator: list[int],
    max_tokens: int,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> tuple[list[float], list[list[int]]]:
    """One pass: p(positive verdict) of every step and the critique ids the model wrote (module docstring)."""
    cache = _Cache(model)
    pending = list(prompt_ids)
    scores: list[float] = []
    critiques: list[list[int]] = []
    pair = list(reward_ids)
    for ids in steps:
        logits = cache.feed(pending + ids)
        critique: list[int] = []
        while True:
            if len(critique) >= max_tokens:
                token = pair[int(logits[pair].argmax())]
                break
            token = _pick(logits, temperature, generator)
            if token in pair:
                break
            critique.append(token)
            logits = cache.feed([token])
        scores.append(float(torch.softmax(logits[pair], -1)[0]))
        critiques.append(critique)
        pending = [token] + separator
    return scores, critiques


@torch.no_grad()
def judge_batch(
    model,
    jobs: list[tuple[list[int], list[list[int]]]],
    reward_ids: tuple[int, int],
    separator: list[int],
    max_tokens: int,
    temperature: float = 0.0,
    generators: list[torch.Generator | None] | None = None,
    pad_id: int = 0,
) -> list[tuple[list[float], list[list[int]]]]:
    """``judge_pass`` for every job ``(prompt_ids, steps)`` at once (module docstring); ``generators[i]`` samples
    job i's critiques."""
    with standard_attention(model):
        return _judge_batch(model, jobs, reward_ids, separator, max_tokens, temperature, generators, pad_id)


def _judge_batch(model, jobs, reward_ids, separator, max_tokens, temperature, generators, pad_id):
    pair = list(reward_ids)
    device = next(model.parameters()).device
    results: list[tuple[list[float], list[list[int]]]] = [([], []) for _ in jobs]
    live = [i for i, (_, steps) in enumerate(jobs) if steps]
    if not live:
        return results
    gens = generators or [None] * len(jobs)
    first = [list(jobs[i][0]) + list(jobs[i][1][0]) for i in live]
    width = max(len(f) for f in first)
    ids = torch.tensor([[pad_id] * (width - len(f)) + f for f in first], device=device)
    mask = torch.tensor([[0] * (width - len(f)) + [1] * len(f) for f in first], device=device)
    out = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0), use_cache=True)
    cache, logits = out.cache, out.logits[:, -1].float()
    length = [len(f) for f in first]  # real tokens fed so far, per row
    step = [0] * len(live)
    queue: list[deque[int]] = [deque() for _ in live]
    critique: list[list[int]] = [[] for _ in live]
    done = [False] * len(live)
    while True:
        feed = []
        for r, i in enumerate(live):
            token = None
            if not done[r] and queue[r]:
                token = queue[r].popleft()
            elif not done[r]:  # a reading point: the critique goes on, or the verdict is read here
                steps, row = jobs[i][1], logits[r]
                if len(critique[r]) >= max_tokens:
                    token, verdict = pair[int(row[pair].argmax())], True
                else:
                    token = _pick(row, temperature, gens[i])
                    verdict = token in pair
                if verdict:
                    results[i][0].append(float(torch.softmax(row[pair], -1)[0]))
                    results[i][1].append(critique[r])
                    critique[r], step[r] = [], step[r] + 1
                    if step[r] == len(steps):
                        done[r], token = True, None
                    else:
                        queue[r].extend([token, *separator, *steps[step[r]]])
                        token = queue[r].popleft()
                else:
                    critique[r].append(token)
            feed.append(token)
        if all(done):
            return results
        new = torch.tensor([[pad_id if t is None else t] for t in feed], device=device)
        mask = torch.cat([mask, torch.tensor([[0 if t is None else 1] for t in feed], device=device)], 1)
        positions = torch.tensor([[n] for n in length], device=device)
        out = model(input_ids=new, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True)
        cache, logits = out.cache, out.logits[:, -1].float()
        length = [n + (t is not None) for n, t in zip(length, feed)]


class GenerativePRM:
    """A causal LM trained with ``prm_kind: generative``: ``judge`` writes the critiques and reads the verdicts."""

    def __init__(
        self, model, tokenizer: PreTrainedTokenizerBase, reward_token_ids: tuple[int, int], settings: CritiqueSettings
    ) -> None:
        self.model, self.tokenizer, self.settings = model, tokenizer, settings
        self.reward_token_ids = tuple(reward_token_ids)

    @classmethod
    def from_settings(cls, s: PRMSection, seed: int) -> GenerativePRM:
        tok = load_tokenizer(s.tokenizer_name_or_path or s.model_name_or_path)
        model = load_model(
            AutoModelForCausalLM,
            s.model_name_or_path,
            init_from_config=s.init_from_config,
            seed=seed,
            dtype=DTYPES[s.dtype],
            pad_token_id=tok.pad_token_id,
        )
        model = (model.to("cuda") if torch.cuda.is_available() else model).eval()
        tokens = reward_token_pair(s.reward_tokens, "prm.reward_tokens")
        ids = reward_ids(tok, tokens, model, "prm.reward_tokens")
        settings = CritiqueSettings(
            s.critique_samples, s.max_critique_tokens, s.critique_temperature, seed, s.micro_batch_size
        )
        return cls(model, tok, ids, settings)

    def judge(self, prompt_ids: list[list[int]], steps: list[list[str]]) -> list[Judgement]:
        """Every solution judged (``prompt_ids[i]``: the ids before solution i, as the PRM was trained on)."""
        s, tok = self.settings, self.tokenizer
        separator = separator_ids(tok)
        jobs = [
            (i, k, prompt, [step_ids(tok, step) for step in solution])
            for i, (prompt, solution) in enumerate(zip(prompt_ids, steps))
            for k in range(s.samples)
        ]
        passes = []
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        for start in range(0, len(jobs), max(1, s.batch_size)):
            chunk = jobs[start : start + max(1, s.batch_size)]
            generators = [pass_generator(s, i, k) for i, k, _, _ in chunk]
            passes += judge_batch(
                self.model,
                [(prompt, ids) for _, _, prompt, ids in chunk],
                self.reward_token_ids,
                separator,
                s.max_tokens,
                s.temperature,
                generators,
                pad,
            )
        out = []
        for i, solution in enumerate(steps):
            mine = passes[i * s.samples : (i + 1) * s.samples]
            scores = [sum(p[0][k] for p in mine) / len(mine) for k in range(len(solution))]
            texts = [[tok.decode(c, skip_special_tokens=True) for c in p[1]] for p in mine]
            out.append(Judgement(scores, texts, [p[0] for p in mine]))
        return out

    def score_steps(self, problems: list[str], steps: list[list[str]]) -> list[list[float]]:
        if len(problems) != len(steps):
            raise ValueError(f"score_steps: {len(problems)} problems and {len(steps)} solutions; give one per problem")
        prompts = [self.tokenizer(problem)["input_ids"] for problem in problems]
        return [j.scores for j in self.judge(prompts, [list(s) for s in steps])]


register_step_scorer("generative")(GenerativePRM)


def pass_generator(s: CritiqueSettings, solution: int, k: int) -> torch.Generator | None:
    """Pass ``k`` of solution ``solution``'s sampling stream (None when greedy)."""
    return torch.Generator().manual_seed((s.seed * 1_000_003 + solution) * 1_009 + k) if s.temperature > 0 else None


def reward_ids(tokenizer: PreTrainedTokenizerBase, tokens: tuple[str, str], model, field: str) -> tuple[int, int]:
    """The verdict tokens' ids: each one token of the tokenizer, inside the model's vocabulary."""
    ids = tuple(single_token_id(tokenizer, t, field) for t in tokens)
    vocab = model.get_output_embeddings().weight.shape[0]
    if max(ids) >= vocab:
        raise UserError(f"{field} ids {ids} are outside the model's vocabulary ({vocab}): give the PRM's own tokenizer")
    return ids
