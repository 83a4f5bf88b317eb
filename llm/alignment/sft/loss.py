"""SFT loss as pure functions: token-level negative log-likelihood, perplexity.

The trainer sums the per-token losses and divides by the *global* number of target tokens of the
optimizer step (``AlignmentTrainer``), so every response token weighs the same whatever example,
micro-batch or rank it is in: the mean NLL over all target tokens, as Hugging Face's
``num_items_in_batch`` normalisation and torchtitan do. The log-probs come in fp32 whatever the model's
precision (``llm.alignment.lm.readout_log_probs`` upcasts the logits before the log-softmax).
"""

from __future__ import annotations

import math

import torch


def token_nll(target_log_probs: torch.Tensor) -> torch.Tensor:
    """Per-token loss ``-log p(y_t | y_<t, x)``: ``(N,)`` -> ``(N,)``."""
    return -target_log_probs


def perplexity(nll_sum: float, tokens: int) -> float:
    """``exp(total NLL / tokens)``, the exponentiated token-mean loss; ``inf`` past float range."""
    mean = nll_sum / max(tokens, 1)
    return math.exp(mean) if mean < 709.0 else math.inf
