"""Sampling responses with Hugging Face ``generate``: left-padded prompts on stock SDPA with a KV cache,
responses cut at the first stop id (the tokenizer's EOS, or the run's ``stop_ids``), and (optionally) the sampled
tokens' log-probs from the generation's own logits."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from llm.alignment.ppo.fsdp import gathered_for_decoding, sharded
from llm.utils.attention import standard_attention


class SampledLogProbs:
    """During ``generate``: the log-prob at ``temperature`` of each sampled token, from the logits the
    generation computes anyway. A hook on the LM head keeps the last position's log-softmax of each
    forward; the next forward's input (the token just sampled, KV cache on) picks its entry; the last
    token is picked after ``generate`` returns. Holds one ``(B, V)`` row at a time, never ``(B, T, V)``.
    The raw head output is used, before any logits processor or sampling warper (top-k, top-p): the
    same distribution as the packed forward's log-probs."""

    def __init__(self, model: PreTrainedModel, temperature: float) -> None:
        self.temperature, self.pending, self.steps = temperature, None, []
        head = model.get_output_embeddings()
        self.handles = [
            head.register_forward_hook(self._head),
            model.register_forward_pre_hook(self._next_input, with_kwargs=True),
        ]

    def _head(self, module, args, out) -> None:
        self.pending = torch.log_softmax(out[:, -1].float() / self.temperature, -1)

    def _next_input(self, module, args, kwargs) -> None:
        if self.pending is not None:
            self._take(kwargs["input_ids"][:, -1:])

    def _take(self, tokens: torch.Tensor) -> None:
        self.steps.append(self.pending.gather(-1, tokens.to(self.pending.device)).squeeze(-1).cpu())
        self.pending = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()

    def finish(self, generated: torch.Tensor) -> torch.Tensor:
        """``(B, N)`` log-probs of the ``N`` generated tokens ``generated`` (FSDP2 ranks stepping on after
        they finished, ``synced_gpus``, record extra steps: only the first ``N`` are theirs)."""
        if self.pending is not None and generated.shape[1]:
            self._take(generated[:, -1:])
        steps = self.steps[: generated.shape[1]]
        return torch.stack(steps, 1) if steps else torch.zeros(generated.shape[0], 0)


@torch.no_grad()
def generate(
    model: PreTrainedModel,
    tok: PreTrainedTokenizerBase,
    temperature: float,
    prompt_ids: list[list[int]],
    *,
    num_samples: int,
    max_new_tokens: int,
    do_sample: bool,
    top_p: float,
    top_k: int,
    ignore_eos: bool = False,
    seed: int | None = None,
    with_log_probs: bool = False,
    gather_for_generation: bool = True,
    synced: bool | None = None,
    stop: str | None = None,
    stop_ids: Sequence[int] | None = None,
):
    """Responses (with EOS if generated, without padding), ``num_samples`` per prompt, consecutive;
    with ``with_log_probs`` also their tokens' log-probs ``(B, T)`` (right-padded with 0), taken
    from the generation's own logits (``SampledLogProbs``).

    ``seed`` reseeds torch's generator here, in the process that samples, so the responses do not
    depend on where the role runs. ``gather_for_generation``: in an FSDP2 group, full weights once per
    call (``gathered_for_decoding``) instead of at every decoding step. ``synced``: whether the ranks of the
    process group generate in step (a model sharded over them); None: when there is a group of several
    (``sharded()``); False: every rank holds a model of its own (``llm/run_label.py`` under torchrun).
    ``stop``: a text that also ends a response (transformers' ``stop_strings``: the response ends with the token
    that completes it, which may run past it; the PRM-guided search cuts there). ``stop_ids``: the token ids that
    end a response (``PPOContext.stop_ids``: the tokenizer's EOS and the model's generation-config EOS ids); None:
    the tokenizer's EOS only. A response keeps the stop id it ended with."""
    stops = [t for t in ([tok.eos_token_id] if stop_ids is None else stop_ids) if t is not None]
    synced = sharded() if synced is None else synced
    if seed is not None:
        torch.manual_seed(seed)
    width = max(len(p) for p in prompt_ids)
    ids = torch.full((len(prompt_ids), width), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompt_ids):  # left padding: generation continues from the last column
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    if not do_sample and num_samples > 1:  # greedy: HF returns one sequence per row, so repeat the rows
        ids, mask = ids.repeat_interleave(num_samples, 0), mask.repeat_interleave(num_samples, 0)
        num_samples = 1
    device = model.device
    was_training = model.training
    model.eval()
    recorder = SampledLogProbs(model, temperature) if with_log_probs else contextlib.nullcontext()
    # inference_mode: ~15% less per-op overhead than no_grad in the decoding loop on CPU. Not in an
    # FSDP2 group, whose all-gathered parameters must stay usable by the training forwards after.
    mode = contextlib.nullcontext() if synced else torch.inference_mode()
    gathered = gathered_for_decoding(model, gather_for_generation and synced)
    with standard_attention(model), recorder, mode, gathered:
        out = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=max_new_tokens,
            do_sample=do_sample,
            temperature=temperature if do_sample else None,
            top_p=top_p if do_sample else None,
            top_k=top_k if do_sample else None,
            num_return_sequences=num_samples,
            eos_token_id=None if ignore_eos or not stops else stops,
            pad_token_id=tok.pad_token_id,
            synced_gpus=synced,  # FSDP2 ranks step together until every rank has finished
            **({"stop_strings": [stop], "tokenizer": tok} if stop else {}),
        )
    model.train(was_training)
    responses = []
    for row in out[:, width:].tolist():
        if ignore_eos:
            responses.append(row)  # exactly max_new_tokens tokens, EOS included as an ordinary token
        elif ends := [t for t, token in enumerate(row) if token in stops]:
            responses.append(row[: ends[0] + 1])  # the first stop id ends it
        else:
            while row and row[-1] == tok.pad_token_id:
                row = row[:-1]
            responses.append(row)
    if not with_log_probs:
        return responses
    logprobs = recorder.finish(out[:, width:])
    T = max((len(r) for r in responses), default=0)
    keep = torch.arange(T)[None, :] < torch.tensor([len(r) for r in responses])[:, None]
    return responses, logprobs[:, :T] * keep
