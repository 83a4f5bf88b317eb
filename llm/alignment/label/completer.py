"""The models that write solutions and complete solution prefixes, on PPO's generation engines (Hugging Face
``generate``, ``llm.alignment.ppo.generation``; vLLM, ``llm.alignment.ppo.vllm_rollout``).

A ``Completer`` takes prefixes (a prompt and the steps written so far) and returns ``n`` completions of each; the
policy writing whole solutions is a completer of empty prefixes. The prefix is the rendered prompt followed by the
steps joined with the step separator (and one more separator: the completion starts the next step).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from llm.data.encoding import render_prompt
from llm.data.readers import Message
from llm.utils.errors import UserError


@dataclass(frozen=True)
class Prefix:
    prompt: list[Message]
    steps: list[str]


@dataclass(frozen=True)
class Completion:
    text: str
    finished: bool  # ended by the model (a stop id: EOS or a generation-config EOS id); False: cut at max_new_tokens


class Completer(Protocol):
    def complete(self, prefixes: list[Prefix], n: int, seed: int) -> list[list[Completion]]:
        """``n`` completions of each prefix, in order; ``seed`` makes them reproducible."""
        ...


def prefix_text(steps: list[str], separator: str) -> str:
    """The assistant text a completion continues: the steps, each followed by the separator."""
    return "".join(step + separator for step in steps)


def split_steps(text: str, separator: str) -> list[str]:
    """A written solution's steps: the text split at the separator, each stripped, empty pieces dropped."""
    return [piece.strip() for piece in text.split(separator) if piece.strip()]


@dataclass(frozen=True)
class Sampling:
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    batch_rows: int  # most sequences per generate call
    do_sample: bool = True  # False: greedy (the judge)


class ModelCompleter:
    """A causal LM (``engine``: a ``generate(prompt_ids, *, num_samples, max_new_tokens, do_sample, top_p, top_k,
    seed)`` callable) completing prefixes. Calls of more than ``batch_rows`` sequences are split, each part with its
    own seed (``seed`` + part), so the completions depend on the seed and the split only."""

    def __init__(
        self,
        generate: Callable[..., Any],
        tokenizer,
        sampling: Sampling,
        chat: bool,
        separator: str,
        stop_ids: tuple[int, ...] | None = None,
    ):
        """``stop_ids``: the ids that end a completion (``modeling.model_stop_ids``: the tokenizer's EOS and the
        model's generation-config EOS ids), passed to ``generate``; None: the tokenizer's EOS."""
        self.generate, self.tok, self.s, self.chat, self.separator = generate, tokenizer, sampling, chat, separator
        self.stop_ids = (tokenizer.eos_token_id,) if stop_ids is None else stop_ids

    def prefix_ids(self, prefix: Prefix) -> list[int]:
        ids = render_prompt(prefix.prompt, self.tok, self.chat)
        text = prefix_text(prefix.steps, self.separator)
        return ids + (self.tok(text, add_special_tokens=False)["input_ids"] if text else [])

    def complete(self, prefixes: list[Prefix], n: int, seed: int) -> list[list[Completion]]:
        ids = [self.prefix_ids(p) for p in prefixes]
        per_call = max(1, self.s.batch_rows // n)  # prefixes per generate call
        responses: list[list[int]] = []
        for part, start in enumerate(range(0, len(ids), per_call)):
            responses += self.generate(
                ids[start : start + per_call],
                num_samples=n,
                max_new_tokens=self.s.max_new_tokens,
                do_sample=self.s.do_sample,
                top_p=self.s.top_p,
                top_k=self.s.top_k,
                seed=seed + part,
                stop_ids=self.stop_ids,
            )
        stops = self.stop_ids
        out = [Completion(self.tok.decode(r, skip_special_tokens=True), bool(r) and r[-1] in stops) for r in responses]
        return [out[i * n : (i + 1) * n] for i in range(len(prefixes))]


def hf_engine(model, tokenizer, temperature: float) -> Callable[..., Any]:
    """Hugging Face ``generate`` (PPO's: left-padded prompts, KV cache, responses cut at the first stop id)."""
    from llm.alignment.ppo.generation import generate

    def run(prompt_ids, **kwargs):  # each process has a whole model of its own: no generating in step
        return generate(model, tokenizer, temperature, prompt_ids, synced=False, **kwargs)

    return run


def vllm_engine(model, tokenizer, temperature: float, max_model_len: int, seed: int, memory: float, rows: int):
    """A vLLM engine with the model's weights (PPO's rollout engine: one seed per request, so a completion does not
    depend on what vLLM batches with it)."""
    from llm.alignment.ppo.vllm_rollout import VLLMRollout

    engine = VLLMRollout(
        model,
        tokenizer,
        temperature,
        max_model_len=max_model_len,
        seed=seed,
        sync_timeout=3600.0,
        gpu_memory_utilization=memory,
        max_num_seqs=rows,
        sleep=False,
        where="engine vllm of llm/run_label.py",
    )
    engine.load_weights(model.state_dict())
    return engine.generate


class StuckCompleter(UserError):
    """A generation did not finish in time. Its thread is still inside the model, where it cannot be stopped, so
    the process ends without running the interpreter's shutdown (``llm/run_label.py``): a thread still inside
    torch at shutdown aborts the process (SIGABRT) instead of letting it exit with status 2."""


def within(seconds: float, work: Callable[[], Any], what: Callable[[], str]) -> Any:
    """``work()`` run in a helper thread, waited for ``seconds`` at most; past that ``StuckCompleter`` says
    ``what()`` did not finish."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = work()
        except BaseException as err:  # noqa: BLE001 - handed to the waiting thread
            box["error"] = err

    thread = threading.Thread(target=target, name="label-completer", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise StuckCompleter(what())
    if "error" in box:
        raise box["error"]
    return box["value"]
