"""The one forward loop of PPO: examples packed into rows, one forward per row, a head read at the
readout positions. The actor, reference, critic and the model rewards (ORM, PRM) all run it.

Every forward over prompt+response runs on packed rows (no padding waste) with the exact block-wise
attention. In an FSDP2 group every forward is a collective, so each rank runs as many forwards as the
rank with the most: spare rows repeat the first one, run the model and the head, and are dropped
(``micro_batches``; one all-reduce of the count). In one process: just the rows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from llm.alignment.lm import readout_hidden
from llm.alignment.ppo.interfaces import Samples
from llm.data.packing import causal_example, collate, pack
from llm.utils.distributed import most_over_ranks, with_spares


def token_readouts(samples: Samples, idx: list[int]) -> list:
    """Prompt+response of samples ``idx`` as examples; a readout at the token before each response token."""
    examples = []
    for k, i in enumerate(idx):
        p, r = samples.prompt_ids[i], samples.response_ids[i]
        positions = list(range(len(p) - 1, len(p) + len(r) - 1))
        examples.append(causal_example(p + r, positions, r, record=k))
    return examples


def readout_tokens(batch) -> tuple[torch.Tensor, torch.Tensor]:
    """``(N,)`` sample (its position in ``idx`` of ``token_readouts``) and response token of each readout."""
    example = batch.records[batch.readout_example]  # sample index of each readout
    # An example's readouts are contiguous and in token order: token index = rank within its run.
    _, counts = torch.unique_consecutive(batch.readout_example, return_counts=True)
    run_start = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    return example, torch.arange(len(example), device=example.device) - run_start


def scatter_tokens(values: torch.Tensor, batch, lengths: list[int], T: int) -> torch.Tensor:
    """Flat readout values ``(N, ...)`` (example order within rows) -> ``(B, T, ...)`` right-padded."""
    out = values.new_zeros(len(lengths), T, *values.shape[1:])
    out[readout_tokens(batch)] = values
    return out


def merge(parts: list[torch.Tensor]) -> torch.Tensor:
    """Micro-batch results, each ``(B, T, ...)`` and zero outside its own samples, as one tensor."""
    return sum(parts) if len(parts) > 1 else parts[0]


def micro_batches(examples: list, size: int, device) -> list[tuple[list, bool]]:
    """``examples`` packed into one row per forward, each with True for a spare. A row holds up to
    ``size`` x the longest example's tokens (greedy best fit): never more positions than ``size`` padded
    examples, and no padding between examples. In an FSDP2 group every rank makes as many forwards as
    the rank with the most (spares repeat the first row; drop their output). In one process: just the
    rows, no collective."""
    rows, _ = pack(examples, size * max(len(e) for e in examples), "greedy")
    batches = [[row] for row in rows]
    return list(with_spares(batches, most_over_ranks(len(batches), device), batches[0]))


def forward_readouts(
    model, examples: list, micro_batch_size: int, pad_token_id: int, causal_lm: bool, head: Callable
) -> Iterator[tuple]:
    """``(batch, head(hidden))`` per row of ``examples`` (``hidden``: the final hidden states at the
    readout positions). ``head`` runs on spare rows too (it may gather a sharded weight: a collective),
    whose results are not yielded. ``causal_lm``: a causal LM (else a sequence-classification model)."""
    for micro, spare in micro_batches(examples, micro_batch_size, model.device):
        batch = collate(micro, pad_token_id)
        batch = batch.to(model.device)
        out = head(readout_hidden(model, batch, causal_lm=causal_lm))
        if not spare:
            yield batch, out


def per_token(
    model,
    samples: Samples,
    idx: list[int],
    micro_batch_size: int,
    pad_token_id: int,
    causal_lm: bool,
    head: Callable,
    read: Callable,
) -> list[torch.Tensor]:
    """Token values of the responses of samples ``idx``: one ``(b, T, ...)`` tensor per value that
    ``read(head_output, batch)`` returns (a tuple of flat readout values), right-padded with zeros; on the
    model's device, differentiable unless the caller disables gradients."""
    lengths = [len(samples.response_ids[i]) for i in idx]
    T = max(lengths)
    parts: list[list[torch.Tensor]] = []
    for batch, out in forward_readouts(
        model, token_readouts(samples, idx), micro_batch_size, pad_token_id, causal_lm, head
    ):
        values = read(out, batch)
        parts = parts or [[] for _ in values]
        for part, value in zip(parts, values):
            part.append(scatter_tokens(value, batch, lengths, T))
    return [merge(part) for part in parts]
