"""Language-model readouts shared by SFT and DPO: log p(target) at the readout positions of a packed batch.

The vocabulary projection is applied only at readout positions, never at every position of every
row: the model runs with ``output_hidden_states=True, logits_to_keep=1`` (``readout_hidden``), and
the LM head is applied to the gathered hidden states ``chunk_size`` readouts at a time. Under autograd
each chunk is checkpointed, so backward also holds one ``(chunk, vocab)`` block of logits at a time.
``chunked`` is that loop for any per-readout head math (PPO's log-probs, entropies and exact KL use it too).

Precision (``llm.utils.precision``): the hidden states are cast to the head weight's dtype for the
matmul (under the trainers' bf16/fp16 autocast it runs in half precision, O1 and O2 alike), and the
logits are upcast to fp32 before the log-softmax: log-probs are fp32.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from llm.data.packing import PackedBatch
from llm.settings.flat import TrainingArguments
from llm.utils.attention import PACKED_SDPA
from llm.utils.errors import UserError
from llm.utils.modeling import load_model


def readout_hidden(model: torch.nn.Module, batch: PackedBatch, causal_lm: bool) -> torch.Tensor:
    """Final hidden states ``(N, H)`` at the batch's readout positions.

    Goes through the (possibly DDP-wrapped) model's own forward so gradient sync hooks run;
    ``logits_to_keep=1`` stops a causal LM from computing vocabulary logits at every position.
    """
    extra = {"logits_to_keep": 1} if causal_lm else {}
    out = model(**batch.model_inputs(), output_hidden_states=True, **extra)
    hidden = out.hidden_states[-1]
    return hidden.reshape(-1, hidden.shape[-1])[batch.readout_index]


def full_weight(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """A head's weight or bias as one plain tensor. Under tensor parallelism the LM head is split over the
    vocabulary (a DTensor); readouts are few, so gathering it (differentiably) costs what one rank holds
    without tensor parallelism, and the head math below stays one implementation."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


READOUT_CHUNK = 1024  # readouts per LM-head block: 1024 x 128k vocab x 4 bytes = 512 MB of fp32 logits


def _chunk_log_probs(
    hidden: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    # accelerate returns the forward's outputs in fp32; O2's head weight is bf16/fp16
    logits = F.linear(hidden.to(weight.dtype), weight, bias).float()
    log_probs = logits.gather(-1, targets[:, None]).squeeze(-1) - logits.logsumexp(-1)
    return log_probs, logits.argmax(-1) == targets


def readout_log_probs(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    chunk_size: int = READOUT_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``log_softmax(hidden @ weight.T + bias)[target]`` per readout, in fp32, and whether the target is the
    most likely token (greedy token accuracy; ties go to the lowest id, as ``argmax`` breaks them).

    Shapes: ``hidden`` ``(N, H)``, ``targets`` ``(N,)``, ``weight`` ``(V, H)`` -> ``(N,)`` float, ``(N,)`` bool.
    """
    return chunked(_chunk_log_probs, (hidden, targets), (weight, bias), chunk_size)


def chunked(fn: Callable[..., tuple], per_readout: tuple, shared: tuple, chunk_size: int = READOUT_CHUNK) -> tuple:
    """``fn(*per_readout, *shared)`` on ``chunk_size`` readouts at a time: ``per_readout`` are ``(N, ...)``
    tensors (or None) sliced along the first dimension, ``shared`` go whole to every call (head weights,
    settings), and ``fn`` returns a tuple of ``(n, ...)`` tensors (or None), concatenated over the chunks.
    With gradients enabled each chunk is checkpointed (its ``(chunk, vocab)`` intermediates are recomputed in
    backward instead of kept), so forward and backward hold one chunk's blocks at a time; up to one chunk of
    readouts is one plain call."""
    if per_readout[0].shape[0] <= chunk_size:
        return fn(*per_readout, *shared)
    parts = []
    for start in range(0, per_readout[0].shape[0], chunk_size):
        part = [None if x is None else x[start : start + chunk_size] for x in per_readout]
        if torch.is_grad_enabled():
            # recompute this block's logits in backward instead of keeping every block alive
            parts.append(checkpoint(fn, *part, *shared, use_reentrant=False))
        else:
            parts.append(fn(*part, *shared))
    return tuple(None if first is None else torch.cat([p[i] for p in parts]) for i, first in enumerate(parts[0]))


def token_log_probs(
    model: torch.nn.Module, head: torch.nn.Linear, batch: PackedBatch, chunk_size: int = READOUT_CHUNK
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(N,)`` log-probability of each readout target and ``(N,)`` whether it is the argmax token; ``model``
    may be DDP-wrapped, ``head`` is its LM head."""
    hidden = readout_hidden(model, batch, causal_lm=True)
    return readout_log_probs(hidden, batch.readout_target, full_weight(head.weight), full_weight(head.bias), chunk_size)


def per_example_sums(values: torch.Tensor, batch: PackedBatch, mask: torch.Tensor | None = None) -> torch.Tensor:
    """``(E,)`` sum of per-readout ``values`` over each example's readouts (those where ``mask`` is true)."""
    example = batch.readout_example
    if mask is not None:
        values, example = values[mask], example[mask]
    out = torch.zeros(batch.num_examples, dtype=values.dtype, device=values.device)
    return out.index_add(0, example, values)


def weights_dtype(training_args: TrainingArguments) -> torch.dtype:
    """fp32 weights, or half-precision ones with ``fp16_opt_level`` O2 (``llm.utils.precision``)."""
    if training_args.fp16_opt_level != "O2":
        return torch.float32
    if training_args.fp16:
        return torch.float16
    return torch.bfloat16


def load_causal_lm(
    path: str,
    training_args: TrainingArguments,
    tokenizer: PreTrainedTokenizerBase,
    init_from_config: bool,
    recompute: str | None = None,
    quantization_config=None,
) -> PreTrainedModel:
    """A causal LM with the packed attention kernel; stops if the tokenizer has ids the model cannot embed.
    ``recompute``: attention-level activation checkpointing (``llm.utils.modeling.enable_recompute``);
    ``quantization_config``: QLoRA's 4-bit base (``llm.utils.lora.quantization_config``)."""
    model = load_model(
        AutoModelForCausalLM,
        path,
        init_from_config=init_from_config,
        seed=training_args.seed,
        dtype=weights_dtype(training_args),
        pad_token_id=tokenizer.pad_token_id,
        layout=training_args.layout,
        recompute=recompute,
        quantization_config=quantization_config,
    )
    vocab = model.get_output_embeddings().weight.shape[0]
    if len(tokenizer) > vocab:
        raise UserError(
            f"the tokenizer has {len(tokenizer)} tokens but {path} has a vocabulary of {vocab}: "
            "tokenizer_name_or_path and model_name_or_path do not belong together"
        )
    return model


def check_packed_attention(model: PreTrainedModel, trainer_name: str) -> None:
    if model.config._attn_implementation != PACKED_SDPA:
        raise ValueError(f"{trainer_name} needs the model loaded with attn_implementation='{PACKED_SDPA}'")
