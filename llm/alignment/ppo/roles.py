"""The four PPO roles behind small interfaces.

- ``PolicyModel`` (actor, reference): ``generate`` and per-token ``log_probs`` of responses.
- ``ValueModel`` (critic): per-token ``values``.
- ``RewardFunction`` (ORM, PRM, rule, HTTP): ``score(samples) -> RewardOutput``.
Trainable roles (actor, critic) also own their optimizer: ``TrainableRole.step``.

Every forward over prompt+response runs on packed rows (no padding waste) with the exact
block-wise attention; token tensors come back as ``(B, T)`` right-padded over response tokens.
The algorithm (trainer.py) only talks to these interfaces, so a role can later live in another
process or machine without touching it.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import math
import urllib.error
import urllib.request
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from llm.alignment.lm import readout_hidden
from llm.alignment.rm.loss import step_scores
from llm.data.packing import causal_example, collate, pack
from llm.data.tokenize import prm_response_text
from llm.utils.attention import PACKED_SDPA
from llm.utils.errors import UserError


@dataclass
class Samples:
    """One rollout: token ids and texts per sample (``num_samples_per_step`` consecutive per prompt)."""

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]  # up to and including EOS when one was generated
    prompts: list[str]
    responses: list[str]
    references: list[str | None]
    ended: torch.Tensor  # (B,) bool: the response ended with EOS

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def select(self, idx: list[int]) -> Samples:
        return Samples(
            [self.prompt_ids[i] for i in idx],
            [self.response_ids[i] for i in idx],
            [self.prompts[i] for i in idx],
            [self.responses[i] for i in idx],
            [self.references[i] for i in idx],
            self.ended[idx],
        )

    def response_mask(self) -> torch.Tensor:
        T = max((len(r) for r in self.response_ids), default=0)
        lengths = torch.tensor([len(r) for r in self.response_ids])
        return (torch.arange(T)[None, :] < lengths[:, None]).float()


def _token_readouts(samples: Samples, idx: list[int], max_len: int):
    """Pack prompt+response of samples ``idx``; a readout at the token before each response token."""
    examples = []
    for k, i in enumerate(idx):
        p, r = samples.prompt_ids[i], samples.response_ids[i]
        positions = list(range(len(p) - 1, len(p) + len(r) - 1))
        examples.append(causal_example(p + r, positions, r, record=k))
    rows, _ = pack(examples, max_len, "greedy")
    return rows


def scatter_tokens(values: torch.Tensor, batch, lengths: list[int], T: int) -> torch.Tensor:
    """Flat readout values (example order within rows) -> (B, T) right-padded."""
    out = values.new_zeros(len(lengths), T)
    example = batch.records[batch.readout_example]  # sample index of each readout
    # An example's readouts are contiguous and in token order: token index = rank within its run.
    _, counts = torch.unique_consecutive(batch.readout_example, return_counts=True)
    run_start = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    token = torch.arange(len(example), device=example.device) - run_start
    out[example, token] = values
    return out


@contextlib.contextmanager
def standard_attention(model: PreTrainedModel):
    """``generate`` pads prompts and uses a KV cache: run it on stock SDPA, then switch back."""
    model.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        model.set_attn_implementation(PACKED_SDPA)


class PolicyModel:
    """A causal LM as actor or reference: sampling and per-token log-probs at ``temperature``."""

    def __init__(
        self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, temperature: float, micro_batch_size: int
    ) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.temperature, self.micro_batch_size = temperature, micro_batch_size

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: list[list[int]],
        *,
        num_samples: int,
        max_new_tokens: int,
        do_sample: bool,
        top_p: float,
        top_k: int,
        ignore_eos: bool = False,
    ) -> list[list[int]]:
        """Responses (with EOS if generated, without padding), ``num_samples`` per prompt, consecutive."""
        tok = self.tokenizer
        width = max(len(p) for p in prompt_ids)
        ids = torch.full((len(prompt_ids), width), tok.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompt_ids):  # left padding: generation continues from the last column
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        device = self.model.device
        was_training = self.model.training
        self.model.eval()
        with standard_attention(self.model):
            out = self.model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=max_new_tokens,
                do_sample=do_sample,
                temperature=self.temperature if do_sample else None,
                top_p=top_p if do_sample else None,
                top_k=top_k if do_sample else None,
                num_return_sequences=num_samples,
                eos_token_id=None if ignore_eos else tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
            )
        self.model.train(was_training)
        responses = []
        for row in out[:, width:].tolist():
            if ignore_eos:
                responses.append(row)  # exactly max_new_tokens tokens, EOS included as an ordinary token
            elif tok.eos_token_id in row:
                responses.append(row[: row.index(tok.eos_token_id) + 1])
            else:
                while row and row[-1] == tok.pad_token_id:
                    row = row[:-1]
                responses.append(row)
        return responses

    def log_probs(
        self,
        samples: Samples,
        idx: list[int] | None = None,
        grad: bool = False,
        with_entropy: bool = False,
        with_logits: bool = False,
    ):
        """Per-token log-probs ``(b, T)`` of the responses of samples ``idx`` (and entropies / logits)."""
        idx = list(range(len(samples))) if idx is None else idx
        lengths = [len(samples.response_ids[i]) for i in idx]
        T = max(lengths)
        max_len = max(len(samples.prompt_ids[i]) + len(samples.response_ids[i]) for i in idx)
        rows = _token_readouts(samples, idx, max_len)
        head = self.model.get_output_embeddings()
        outs, ents, all_logits = [], [], []
        context = contextlib.nullcontext() if grad else torch.no_grad()
        with context:
            for start in range(0, len(rows), self.micro_batch_size):
                batch = collate(rows[start : start + self.micro_batch_size], self.tokenizer.pad_token_id)
                batch = batch.to(self.model.device)
                hidden = readout_hidden(self.model, batch, causal_lm=True)
                logits = head(hidden).float() / self.temperature
                logp = torch.log_softmax(logits, -1)
                token_logp = logp.gather(-1, batch.readout_target[:, None]).squeeze(-1)
                outs.append(scatter_tokens(token_logp, batch, lengths, T))
                if with_entropy:
                    ents.append(scatter_tokens((-(logp.exp() * logp).sum(-1)), batch, lengths, T))
                if with_logits:
                    all_logits.append((batch, logits.detach()))
        result = sum(outs) if len(outs) > 1 else outs[0]
        extra = []
        if with_entropy:
            extra.append(sum(ents) if len(ents) > 1 else ents[0])
        if with_logits:
            extra.append(all_logits)
        return (result, *extra) if extra else result


class ValueModel:
    """Critic: a sequence-classification model whose score head is read at every response token."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, micro_batch_size: int) -> None:
        self.model, self.tokenizer, self.micro_batch_size = model, tokenizer, micro_batch_size

    def values(self, samples: Samples, idx: list[int] | None = None, grad: bool = False) -> torch.Tensor:
        idx = list(range(len(samples))) if idx is None else idx
        lengths = [len(samples.response_ids[i]) for i in idx]
        T = max(lengths)
        max_len = max(len(samples.prompt_ids[i]) + len(samples.response_ids[i]) for i in idx)
        rows = _token_readouts(samples, idx, max_len)
        outs = []
        context = contextlib.nullcontext() if grad else torch.no_grad()
        with context:
            for start in range(0, len(rows), self.micro_batch_size):
                batch = collate(rows[start : start + self.micro_batch_size], self.tokenizer.pad_token_id)
                batch = batch.to(self.model.device)
                hidden = readout_hidden(self.model, batch, causal_lm=False)
                outs.append(scatter_tokens(self.model.score(hidden).squeeze(-1).float(), batch, lengths, T))
        return sum(outs) if len(outs) > 1 else outs[0]


class TrainableRole:
    """Owns a model's optimizer and LR schedule; ``step`` applies accumulated gradients."""

    def __init__(
        self,
        model: PreTrainedModel,
        lr: float,
        weight_decay: float,
        betas: tuple[float, float],
        eps: float,
        max_grad_norm: float,
        warmup_steps: int,
    ) -> None:
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda n: min(1.0, (n + 1) / warmup_steps) if warmup_steps else 1.0
        )
        self.max_grad_norm = max_grad_norm

    def step(self) -> float:
        norm = 0.0
        if self.max_grad_norm and self.max_grad_norm > 0:
            norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm))
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])


# --- rewards ------------------------------------------------------------------------------------------
@dataclass
class RewardOutput:
    scores: torch.Tensor  # (B,) outcome score added at the last response token
    dense: torch.Tensor | None = None  # (B, T) extra per-token rewards (PRM steps), or None


class RewardFunction:
    def score(self, samples: Samples) -> RewardOutput:
        raise NotImplementedError


def _check_score(value, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise UserError(
            f"{where} returned {value!r}; a reward must be a finite number (a bad sample is never "
            "silently turned into a zero reward)"
        )
    return float(value)


class RuleReward(RewardFunction):
    """``module:function(prompt, response, reference) -> float``."""

    def __init__(self, spec: str) -> None:
        module_name, _, fn_name = spec.partition(":")
        try:
            self.fn = getattr(importlib.import_module(module_name), fn_name)
        except (ImportError, AttributeError, ValueError) as err:
            raise UserError(f"reward.rule {spec!r}: cannot import ({err}); use 'package.module:function'") from None
        self.spec = spec

    def score(self, samples: Samples) -> RewardOutput:
        out = []
        for i in range(len(samples)):
            try:
                value = self.fn(samples.prompts[i], samples.responses[i], samples.references[i])
            except Exception as err:  # noqa: BLE001 - any user-code failure is reported with its sample
                raise UserError(
                    f"reward.rule {self.spec} raised {type(err).__name__}: {err} on sample {i} "
                    f"(prompt {samples.prompts[i][:80]!r}, response {samples.responses[i][:80]!r})"
                ) from None
            out.append(_check_score(value, f"reward.rule {self.spec} on sample {i}"))
        return RewardOutput(torch.tensor(out))


class HttpReward(RewardFunction):
    """POST ``{"prompts", "responses", "references"}`` as JSON; expects ``{"scores": [float, ...]}``."""

    def __init__(self, url: str, timeout: float) -> None:
        self.url, self.timeout = url, timeout

    def score(self, samples: Samples) -> RewardOutput:
        body = json.dumps(
            {"prompts": samples.prompts, "responses": samples.responses, "references": samples.references}
        ).encode()
        request = urllib.request.Request(self.url, data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as resp:
                payload = json.loads(resp.read().decode())
        except (urllib.error.URLError, TimeoutError, OSError) as err:
            reason = getattr(err, "reason", err)
            raise UserError(
                f"reward server {self.url} failed: {reason} (timeout {self.timeout}s); check that it "
                "is up, or raise reward.timeout"
            ) from None
        except json.JSONDecodeError:
            raise UserError(f"reward server {self.url} did not answer JSON") from None
        scores = payload.get("scores") if isinstance(payload, dict) else None
        if not isinstance(scores, list) or len(scores) != len(samples):
            raise UserError(f'reward server {self.url} must answer {{"scores": [...]}} with {len(samples)} numbers')
        return RewardOutput(torch.tensor([_check_score(s, f"reward server sample {i}") for i, s in enumerate(scores)]))


def _retokenise(samples: Samples, actor_tok: PreTrainedTokenizerBase, tok: PreTrainedTokenizerBase):
    """Token ids for a reward model: the actor's own when vocabularies agree, else re-tokenised text."""
    if actor_tok.get_vocab() == tok.get_vocab():
        return samples.prompt_ids, samples.response_ids
    prompts = [tok(p)["input_ids"] for p in samples.prompts]
    responses = [
        tok(r, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] * bool(samples.ended[i])
        for i, r in enumerate(samples.responses)
    ]
    return prompts, responses


class ORMReward(RewardFunction):
    """Outcome reward model: score head at the last response token."""

    def __init__(self, model, tokenizer, actor_tokenizer, micro_batch_size: int) -> None:
        self.model, self.tokenizer, self.actor_tokenizer = model, tokenizer, actor_tokenizer
        self.micro_batch_size = micro_batch_size

    @torch.no_grad()
    def score(self, samples: Samples) -> RewardOutput:
        prompts, responses = _retokenise(samples, self.actor_tokenizer, self.tokenizer)
        examples = [
            causal_example(p + r, [len(p) + len(r) - 1], [0], record=i)
            for i, (p, r) in enumerate(zip(prompts, responses))
        ]
        rows, _ = pack(examples, max(len(e) for e in examples), "greedy")
        scores = torch.zeros(len(samples))
        for start in range(0, len(rows), self.micro_batch_size):
            batch = collate(rows[start : start + self.micro_batch_size], self.tokenizer.pad_token_id)
            batch = batch.to(self.model.device)
            hidden = readout_hidden(self.model, batch, causal_lm=False)
            scores[batch.records[batch.readout_example].cpu()] = self.model.score(hidden).squeeze(-1).float().cpu()
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


def char_to_token_end(tokenizer, response_ids: list[int], char_end: int) -> int:
    """Index of the response token that completes the first ``char_end`` characters of its text."""
    for k in range(len(response_ids)):
        if len(tokenizer.decode(response_ids[: k + 1], skip_special_tokens=True)) >= char_end:
            return k
    return len(response_ids) - 1


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
        self.separator, self.placeholder, self.placeholder_id = separator, placeholder, placeholder_id
        self.reward_token_ids, self.aggregation = list(reward_token_ids), aggregation
        self.micro_batch_size = micro_batch_size

    @torch.no_grad()
    def step_scores(self, samples: Samples) -> tuple[list[list[float]], list[list[tuple[int, int]]]]:
        spans = [split_steps(r, self.separator) for r in samples.responses]
        examples = []
        for i, (prompt, text) in enumerate(zip(samples.prompts, samples.responses)):
            steps = [text[s:e].strip() for s, e in spans[i]] or [text.strip() or "(empty)"]
            p = self.tokenizer(prompt)["input_ids"]
            r = self.tokenizer(prm_response_text(steps, self.placeholder), add_special_tokens=False)["input_ids"]
            marks = [len(p) + k for k, t in enumerate(r) if t == self.placeholder_id]
            examples.append(causal_example(p + r, marks, [0] * len(marks), record=i))
        rows, _ = pack(examples, max(len(e) for e in examples), "greedy")
        per_sample: list[list[float]] = [[] for _ in range(len(samples))]
        head = self.model.get_output_embeddings()
        for start in range(0, len(rows), self.micro_batch_size):
            batch = collate(rows[start : start + self.micro_batch_size], self.tokenizer.pad_token_id)
            batch = batch.to(self.model.device)
            hidden = readout_hidden(self.model, batch, causal_lm=True)
            logits = F.linear(hidden, head.weight[self.reward_token_ids])
            probs = step_scores(logits).cpu().tolist()
            for e, prob in zip(batch.records[batch.readout_example].tolist(), probs):
                per_sample[e].append(prob)
        return per_sample, spans

    def score(self, samples: Samples) -> RewardOutput:
        per_sample, spans = self.step_scores(samples)
        if self.aggregation != "dense":
            agg = {"min": min, "last": lambda xs: xs[-1], "mean": lambda xs: sum(xs) / len(xs)}[self.aggregation]
            return RewardOutput(torch.tensor([agg(s) for s in per_sample]))
        T = max(len(r) for r in samples.response_ids)
        dense = torch.zeros(len(samples), T)
        for i, scores in enumerate(per_sample):
            ends = [e for _, e in spans[i]] or [len(samples.responses[i])]
            for score, char_end in zip(scores, ends):
                dense[i, char_to_token_end(self.actor_tokenizer, samples.response_ids[i], char_end)] += score
        return RewardOutput(torch.zeros(len(samples)), dense)
