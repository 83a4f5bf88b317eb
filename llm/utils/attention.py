"""One description of the packed attention mask, and the kernels that consume it.

A packed row holds several examples. Which query may see which key is described by a list of
``Block``s: queries ``[q_start, q_end)`` attend to the concatenation of the key ranges ``kv``,
causally aligned to the bottom-right (the last query sees every listed key, the first query sees
all keys except the last ``q_end - q_start - 1``). Two layouts occur:

Document-causal packing, two examples A (3 tokens) and B (2 tokens)::

    keys ->      A0 A1 A2 B0 B1      blocks: (0, 3, kv=[(0, 3)])
    A0           x                           (3, 5, kv=[(3, 5)])
    A1           x  x
    A2           x  x  x
    B0                    x          positions: 0 1 2 0 1
    B1                    x  x

Preference pair sharing its prompt, [P P | C C | R R] (prompt computed once)::

    keys ->      P0 P1 C0 C1 R0 R1   blocks: (0, 4, kv=[(0, 4)])
    P0           x                           (4, 6, kv=[(0, 2), (4, 6)])
    P1           x  x
    C0           x  x  x             positions: 0 1 2 3 2 3
    C1           x  x  x  x          (rejected restarts at the prompt length)
    R0           x  x        x
    R1           x  x        x  x

The same thing in FlashMask form: key column j is visible to query rows ``j <= i < st[j]``, with
``st`` = end of the example for prompt/rejected/plain columns and = start of the rejected part for
chosen columns (``flash_start_rows``).

Which transformers paths are exact for packed rows (measured with torch 2.13 / transformers 5.24 on CPU,
packed example against the same example alone): ``sdpa`` with a 4-D *boolean* mask and ``eager`` with a
4-D *additive float* mask are; ``eager`` with a boolean mask is silently wrong (error ~2.4); position ids
alone (``DataCollatorWithFlattening``) leak across examples unless ``use_cache=False`` and cannot share a
prompt between chosen and rejected; FlexAttention has no backward on CPU. Hence the kernels here:
- ``packed_sdpa``: registered in transformers' AttentionInterface; runs SDPA block by block.
  Exact on every device, fastest on CPU, no L x L mask. How a row splits into blocks (``sdpa_layout``:
  split sizes, key pieces, bottom-right masks) is derived once per batch and shared by all layers.
  ``readout_sdpa`` is the same attention at a few query positions only (the reward models' last layer).
- ``dense_mask``: a 4-D boolean mask (True = attend) for the stock ``sdpa`` implementation; the
  reference path in tests.
- FlexAttention ``BlockMask`` (``flex_block_mask``) and flash-attn varlen (document-causal only) on CUDA.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from llm.utils.errors import UserError

PACKED_SDPA = "packed_sdpa"


@dataclass(frozen=True)
class Block:
    """Queries ``[q_start, q_end)`` attend to the key ranges ``kv`` (concatenated), bottom-right causal."""

    q_start: int
    q_end: int
    kv: tuple[tuple[int, int], ...]

    def shifted(self, offset: int) -> Block:
        return Block(self.q_start + offset, self.q_end + offset, tuple((a + offset, b + offset) for a, b in self.kv))

    @property
    def is_document_causal(self) -> bool:
        return self.kv == ((self.q_start, self.q_end),)


@dataclass
class PackedAttention:
    """Per-row attention blocks of a padded batch of packed rows (rows are padded to ``seq_len``)."""

    blocks: list[list[Block]]
    seq_len: int
    # "sdpa": block-wise SDPA (any device); "flex": FlexAttention BlockMask (CUDA training);
    # "flash_varlen": flash-attn varlen (CUDA, document-causal rows; pairs fall back to "sdpa").
    kernel: str = "sdpa"
    cache: dict = field(default_factory=dict, repr=False, compare=False)  # per-batch masks, built once

    @property
    def is_document_causal(self) -> bool:
        return all(b.is_document_causal for row in self.blocks for b in row)

    def dense_mask(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Boolean mask ``(rows, 1, L, L)``, True = attend. Padding queries see only themselves (no NaN)."""
        rows, length = len(self.blocks), self.seq_len
        mask = torch.zeros(rows, 1, length, length, dtype=torch.bool)
        mask[:, 0].diagonal(dim1=-2, dim2=-1).fill_(True)
        for r, row in enumerate(self.blocks):
            for b in row:
                keys = torch.cat([torch.arange(s, e) for s, e in b.kv])
                q_len, k_len = b.q_end - b.q_start, len(keys)
                allowed = torch.ones(q_len, k_len, dtype=torch.bool).tril(k_len - q_len)
                mask[r, 0, b.q_start : b.q_end][:, keys] = allowed
        return mask.to(device)

    def flash_start_rows(self) -> torch.Tensor:
        """FlashMask form ``(rows, L)``: key j is seen by queries ``j <= i < st[j]``. Exact for the two layouts."""
        dense = self.dense_mask()[:, 0]
        length = self.seq_len
        rows = torch.arange(length)
        st = torch.empty(len(self.blocks), length, dtype=torch.long)
        for r in range(len(self.blocks)):
            for j in range(length):
                seen = rows[dense[r, :, j]]
                st[r, j] = seen.max() + 1 if len(seen) else j
                # FlashMask can only express a contiguous run of rows starting at the diagonal.
                assert len(seen) == 0 or (seen.min() == j and len(seen) == st[r, j] - j), "not FlashMask-expressible"
        return st

    def cu_seqlens(self, device: torch.device | str) -> tuple[torch.Tensor, int]:
        """flash-attn varlen metadata over the flattened batch (document-causal layouts only)."""
        assert self.is_document_causal
        bounds, longest = [0], 0
        for r, row in enumerate(self.blocks):
            for b in sorted(row, key=lambda b: b.q_start):
                bounds.append(r * self.seq_len + b.q_end)
                longest = max(longest, b.q_end - b.q_start)
        return torch.tensor(bounds, dtype=torch.int32, device=device), longest


def _bottom_right_causal(q_len: int, k_len: int, device: torch.device) -> torch.Tensor:
    return torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril(k_len - q_len)


def _pieces_between(bounds: list[int], ranges: tuple[tuple[int, int], ...]) -> tuple[int, ...]:
    """Indices of the pieces (split at ``bounds``) that make up the concatenation of ``ranges``."""
    return tuple(k for s, e in ranges for k in range(bisect.bisect_left(bounds, s), bisect.bisect_left(bounds, e)))


def _split_sizes(bounds: list[int]) -> list[int]:
    return [b - a for a, b in itertools.pairwise(bounds)]


class _Step(NamedTuple):
    """One block of a row in query order (``q_pieces`` None: rows no block covers, output 0)."""

    q_start: int
    q_end: int
    q_pieces: tuple[int, ...] | None
    kv_pieces: tuple[int, ...]
    k_len: int
    causal: bool  # document-causal: SDPA's is_causal; else the bottom-right causal mask


@dataclass
class _RowLayout:
    """How block-wise SDPA runs one row, derived once per batch from its ``Block``s (the same in every layer).

    Queries are split at the block boundaries, keys and values at the key-range boundaries, each once:
    slicing per block instead makes each slice's backward zero-fill and add a whole ``(1, H, L, D)``
    gradient.
    """

    q_sizes: list[int]
    kv_sizes: list[int]
    steps: list[_Step]
    masks: dict = field(default_factory=dict)  # (q_len, k_len, device) -> bottom-right causal mask

    @classmethod
    def build(cls, row: list[Block], length: int) -> _RowLayout:
        ordered = sorted(row, key=lambda b: b.q_start)
        q_bounds = sorted({0, length, *(x for b in ordered for x in (b.q_start, b.q_end))})
        kv_bounds = sorted({0, length, *(x for b in ordered for r in b.kv for x in r)})
        steps, cursor = [], 0
        for b in ordered:
            if b.q_start > cursor:
                steps.append(_Step(cursor, b.q_start, None, (), 0, True))
            q = _pieces_between(q_bounds, ((b.q_start, b.q_end),))
            k_len = sum(e - s for s, e in b.kv)
            steps.append(_Step(b.q_start, b.q_end, q, _pieces_between(kv_bounds, b.kv), k_len, b.is_document_causal))
            cursor = b.q_end
        if cursor < length:
            steps.append(_Step(cursor, length, None, (), 0, True))
        return cls(_split_sizes(q_bounds), _split_sizes(kv_bounds), steps)

    def mask(self, q_len: int, k_len: int, device: torch.device) -> torch.Tensor:
        key = (q_len, k_len, device)
        if key not in self.masks:
            self.masks[key] = _bottom_right_causal(q_len, k_len, device)
        return self.masks[key]


CPU_HALF_UPCAST_KEYS = 256  # keys at or below which a bf16/fp16 block on a CPU runs its attention in fp32


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float, **kw) -> torch.Tensor:
    """``F.scaled_dot_product_attention``; a bf16/fp16 block of at most ``CPU_HALF_UPCAST_KEYS`` keys on a CPU (no
    dropout) in fp32, cast back. torch's CPU flash kernel pays a fixed ~1 ms per call in its half-precision
    backward: at 48 keys (SmolLM2's 9 heads, GQA) a block's forward + backward took 1.38 ms in bf16 against 0.42 ms
    in fp32 including the casts, at 128 keys 3.81 against 2.33, at 512 27.2 against 28.7 (1 thread; bench/README
    "Short attention blocks in bf16 on a CPU"). fp32 is also the more exact of the two."""
    if dropout == 0.0 and q.device.type == "cpu" and q.dtype in HALF and k.shape[2] <= CPU_HALF_UPCAST_KEYS:
        return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), **kw).to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, **kw)


HALF = (torch.bfloat16, torch.float16)


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


def sdpa_layout(packed: PackedAttention) -> list[_RowLayout]:
    """The per-row layouts of ``packed``, built on first use and kept in ``packed.cache`` for the other
    layers of the same batch; rebuilt if ``blocks`` or ``seq_len`` changed since (never reused for others)."""
    snapshot = (packed.seq_len, tuple(tuple(row) for row in packed.blocks))
    cached = packed.cache.get("sdpa_layout")
    if cached is None or cached[0] != snapshot:
        cached = (snapshot, [_RowLayout.build(row, packed.seq_len) for row in packed.blocks])
        packed.cache["sdpa_layout"] = cached
    return cached[1]


def blockwise_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    packed: PackedAttention,
    scaling: float | None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """SDPA block by block. q ``(B, H, L, D)``, k/v ``(B, Hkv, L, D)`` -> ``(B, H, L, D)``; padding -> 0."""
    gqa = key.shape[1] != query.shape[1]
    if query.shape[2] != packed.seq_len:
        raise ValueError(f"packed attention for rows of {packed.seq_len} got {query.shape[2]} queries")
    out_rows = []
    for q_r, k_r, v_r, layout in zip(query.split(1, 0), key.split(1, 0), value.split(1, 0), sdpa_layout(packed)):
        qs = q_r.split(layout.q_sizes, dim=2)
        ks, vs = k_r.split(layout.kv_sizes, dim=2), v_r.split(layout.kv_sizes, dim=2)
        pieces = []
        for step in layout.steps:
            if step.q_pieces is None:
                pieces.append(q_r.new_zeros(1, q_r.shape[1], step.q_end - step.q_start, q_r.shape[3]))
                continue
            q = _cat([qs[i] for i in step.q_pieces])
            k, v = _cat([ks[i] for i in step.kv_pieces]), _cat([vs[i] for i in step.kv_pieces])
            causal = (
                {"is_causal": True} if step.causal else {"attn_mask": layout.mask(q.shape[2], step.k_len, q.device)}
            )
            pieces.append(_sdpa(q, k, v, dropout, scale=scaling, enable_gqa=gqa, **causal))
        out_rows.append(_cat(pieces))
    return torch.cat(out_rows, dim=0) if len(out_rows) > 1 else out_rows[0]


def readout_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    packed: PackedAttention,
    positions: list[int],
    scaling: float | None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """Attention at a few query positions only: the rows ``positions`` of ``blockwise_sdpa``'s output.

    ``positions``: flat ``row * L + position`` indices, ascending, each inside a block; q ``(1, H, N, D)``
    holds their queries in that order, k/v ``(B, Hkv, L, D)`` every key. -> ``(1, H, N, D)``. One SDPA
    call per block holding readouts, against that block's keys only.
    """
    length, gqa = packed.seq_len, key.shape[1] != query.shape[1]
    layouts = sdpa_layout(packed)
    groups = []  # (row, step, positions within the row) per block holding readouts, in order
    for r, layout in enumerate(layouts):
        lo, hi = bisect.bisect_left(positions, r * length), bisect.bisect_left(positions, (r + 1) * length)
        starts = [s.q_start for s in layout.steps]
        while lo < hi:
            step = layout.steps[bisect.bisect_right(starts, positions[lo] - r * length) - 1]
            if step.q_pieces is None:
                raise ValueError(f"position {positions[lo] - r * length} of row {r} is in no attention block")
            end = bisect.bisect_left(positions, r * length + step.q_end, lo, hi)
            groups.append((r, step, [p - r * length for p in positions[lo:end]]))
            lo = end
    keys, values = key.split(1, 0), value.split(1, 0)
    row_pieces, outs = {}, []
    for q, (r, step, at) in zip(query.split([len(g[2]) for g in groups], dim=2), groups):
        if r not in row_pieces:
            row_pieces[r] = (keys[r].split(layouts[r].kv_sizes, dim=2), values[r].split(layouts[r].kv_sizes, dim=2))
        ks, vs = row_pieces[r]
        k, v = _cat([ks[i] for i in step.kv_pieces]), _cat([vs[i] for i in step.kv_pieces])
        # bottom-right causal: the query at p sees the first k_len - (q_end - p) + 1 keys of the block
        seen = torch.tensor([step.k_len - step.q_end + p + 1 for p in at])
        mask = None if int(seen.min()) == step.k_len else (torch.arange(step.k_len) < seen[:, None]).to(q.device)
        outs.append(_sdpa(q, k, v, dropout, attn_mask=mask, scale=scaling, enable_gqa=gqa))
    return _cat(outs)


def flash_varlen(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, packed: PackedAttention, scaling: float | None
) -> torch.Tensor:  # pragma: no cover - needs CUDA and flash-attn
    from flash_attn import flash_attn_varlen_func

    rows, heads, length, dim = query.shape
    cu, longest = packed.cu_seqlens(query.device)
    q = query.transpose(1, 2).reshape(rows * length, heads, dim)
    k = key.transpose(1, 2).reshape(rows * length, key.shape[1], dim)
    v = value.transpose(1, 2).reshape(rows * length, value.shape[1], dim)
    out = flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, softmax_scale=scaling, causal=True)
    return out.reshape(rows, length, heads, dim).transpose(1, 2)


def flex(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, packed: PackedAttention, scaling: float | None
) -> torch.Tensor:
    """FlexAttention with a BlockMask built once per batch (compiled on CUDA, eager elsewhere)."""
    from torch.nn.attention.flex_attention import flex_attention

    if "block_mask" not in packed.cache:
        packed.cache["block_mask"] = flex_block_mask(packed, query.device)
    fn = _compiled_flex() if query.is_cuda else flex_attention
    return fn(
        query,
        key,
        value,
        block_mask=packed.cache["block_mask"],
        scale=scaling,
        enable_gqa=key.shape[1] != query.shape[1],
    )


_COMPILED: dict = {}


def _compiled_flex():  # pragma: no cover - CUDA only
    if "flex" not in _COMPILED:
        from torch.nn.attention.flex_attention import flex_attention

        _COMPILED["flex"] = torch.compile(flex_attention, dynamic=True)
    return _COMPILED["flex"]


def kernel_for(use_flash_attention: bool, flash_mask: bool) -> str:
    """Which kernel the packed rows use: the CPU path is always exact block-wise SDPA."""
    if torch.cuda.is_available():
        if flash_mask:
            return "flex"
        if use_flash_attention:
            return "flash_varlen"
    return "sdpa"


def packed_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    packed_attention: PackedAttention | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function. Without ``packed_attention`` it is plain SDPA (generation, eval).

    A module with ``recompute_core_attention`` set (``recompute_granularity: core_attn``) keeps no
    activations of the attention kernel itself: backward runs the kernel again.
    """
    if packed_attention is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    check_window(packed_attention, kwargs.get("sliding_window"))
    dropout = dropout if module.training else 0.0
    if getattr(module, RECOMPUTE_CORE_ATTENTION, False) and torch.is_grad_enabled():
        out = checkpoint(_packed_kernel, query, key, value, packed_attention, scaling, dropout, use_reentrant=False)
    else:
        out = _packed_kernel(query, key, value, packed_attention, scaling, dropout)
    return out.transpose(1, 2).contiguous(), None


RECOMPUTE_CORE_ATTENTION = "recompute_core_attention"


def check_window(packed: PackedAttention, window: int | None) -> None:
    """The packed kernels attend to every earlier token of an example; a model with a sliding attention window
    (Mistral-7B v0.1: 4096) sees only the last ``window`` ones. Equal up to the window, different past it: an
    example that long stops the run instead of being computed unlike the model's own attention."""
    if not window:
        return
    longest = packed.cache.get("longest_span")
    if longest is None:
        longest = max((sum(e - s for s, e in b.kv) for row in packed.blocks for b in row), default=0)
        packed.cache["longest_span"] = longest
    if longest > window:
        raise UserError(
            f"the model attends within a sliding window of {window} tokens (its config's sliding_window) and an "
            f"example here spans {longest}; the packed attention kernels have no window: set max_seq_len "
            f"<= {window}"
        )


def _packed_kernel(query, key, value, packed_attention: PackedAttention, scaling, dropout: float) -> torch.Tensor:
    if packed_attention.kernel == "flash_varlen" and packed_attention.is_document_causal:
        return flash_varlen(query, key, value, packed_attention, scaling)
    if packed_attention.kernel == "flex":
        return flex(query, key, value, packed_attention, scaling)
    return blockwise_sdpa(query, key, value, packed_attention, scaling, dropout)


AttentionInterface.register(PACKED_SDPA, packed_sdpa_attention)


@contextlib.contextmanager
def standard_attention(model):
    """Padded batches over a KV cache (``generate``, a generative PRM's critiques) on stock SDPA, then back. With
    ``packed_sdpa`` transformers builds no mask at all (a registered attention without a mask function gets
    none), so a left-padded row would attend to its padding; a model on another implementation is left as it is."""
    if getattr(getattr(model, "config", None), "_attn_implementation", None) != PACKED_SDPA:
        yield
        return
    model.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        model.set_attn_implementation(PACKED_SDPA)


def flex_block_mask(packed: PackedAttention, device: torch.device | str):
    """FlexAttention ``BlockMask`` for the same description (CUDA training; forward also works on CPU)."""
    from torch.nn.attention.flex_attention import create_block_mask

    dense = packed.dense_mask(device)[:, 0]

    def mask_mod(b, h, q_idx, kv_idx):
        return dense[b, q_idx, kv_idx]

    return create_block_mask(
        mask_mod, B=len(packed.blocks), H=None, Q_LEN=packed.seq_len, KV_LEN=packed.seq_len, device=device
    )
