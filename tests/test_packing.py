"""Packed == unpacked: per-example logits, losses and gradients, on Llama, Mistral and Qwen2.

The oracle is each example run alone through the stock model (no mask, no packing). The negative
controls show these tests catch the silently wrong transformers paths listed in llm/utils/attention.py.
"""

import json
import os

import pytest
import torch
import torch.nn.functional as F

from llm.data.packing import causal_example, collate, pack, pair_coordinates, pair_example, plan_rows
from llm.utils.attention import Block, PackedAttention, flex_block_mask
from tests.helpers import ROOT, tiny_model, twin

ARCHS = ["llama", "mistral", "qwen2"]


def random_ids(n, gen):
    return torch.randint(3, 600, (n,), generator=gen).tolist()


def make_examples(gen):
    causal = [causal_example(random_ids(n, gen), [], [], record=i) for i, n in enumerate([7, 19, 4, 12, 25, 9])]
    p, c, r = random_ids(6, gen), random_ids(5, gen), random_ids(8, gen)
    pair = pair_example(p, c, r, [], [], [], record=len(causal))
    return causal + [pair], (p, c, r)


def alone_logits(model, ids):
    return model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]


def per_example_packed(logits, rows):
    """Yield (record, segment logits) of each causal example / (record, chosen, rejected) views of pairs."""
    for r, row in enumerate(rows):
        i = 0
        blocks = row.blocks
        while i < len(blocks):
            b = blocks[i]
            if i + 1 < len(blocks) and len(blocks[i + 1].kv) == 2:
                yield r, ("pair", b, blocks[i + 1])
                i += 2
            else:
                yield r, ("causal", b, None)
                i += 1


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("strategy", [None, "sequential", "greedy"])
def test_packed_logits_equal_alone(arch, strategy):
    gen = torch.Generator().manual_seed(0)
    examples, (_p, _c, _r) = make_examples(gen)
    model = tiny_model(arch).eval()
    stock = twin(model, "sdpa").eval()
    rows, _ = pack(examples, 40, strategy)
    batch = collate(rows, pad_token_id=0)
    with torch.no_grad():
        packed = model(**batch.model_inputs()).logits
        worst = 0.0
        for row_i, (kind, b, b2) in per_example_packed(packed, rows):
            ids = rows[row_i].input_ids
            if kind == "causal":
                ref = alone_logits(stock, ids[b.q_start : b.q_end])
                worst = max(worst, (packed[row_i, b.q_start : b.q_end] - ref).abs().max().item())
            else:
                n_p = b2.kv[0][1] - b2.kv[0][0]
                chosen = alone_logits(stock, ids[b.q_start : b.q_end])
                rejected = alone_logits(stock, ids[b.q_start : b.q_start + n_p] + ids[b2.q_start : b2.q_end])
                worst = max(worst, (packed[row_i, b.q_start : b.q_end] - chosen).abs().max().item())
                worst = max(worst, (packed[row_i, b2.q_start : b2.q_end] - rejected[n_p:]).abs().max().item())
    assert worst <= 1e-5, worst


def lm_loss_packed(model, examples, strategy):
    """Summed next-token loss of every example read from packed rows (pairs: both answers)."""
    readout = []
    for ex in examples:
        n = len(ex)
        if len(ex.blocks) == 1:
            pos = list(range(n - 1))
            tgt = ex.input_ids[1:]
        else:
            p = ex.blocks[1].kv[0][1]
            c = ex.blocks[0].q_end - p
            r = n - p - c
            ci, ri = pair_coordinates(p, c, r)
            seq_c = [ex.input_ids[i] for i in ci]
            seq_r = [ex.input_ids[i] for i in ri]
            pos = [ci[t] for t in range(p - 1, p + c - 1)] + [ri[t] for t in range(p - 1, p + r - 1)]
            tgt = seq_c[p:] + seq_r[p:]
        ex.readout_position, ex.readout_target, ex.readout_part = pos, tgt, [0] * len(pos)
        readout.append(ex)
    rows, _ = pack(readout, 40, strategy)
    batch = collate(rows, pad_token_id=0)
    logits = model(**batch.model_inputs()).logits
    flat = logits.reshape(-1, logits.shape[-1])[batch.readout_index]
    return F.cross_entropy(flat, batch.readout_target, reduction="sum")


def lm_loss_alone(model, examples):
    total = 0.0
    for ex in examples:
        if len(ex.blocks) == 1:
            seqs = [(ex.input_ids, 0)]
        else:
            p = ex.blocks[1].kv[0][1]
            c = ex.blocks[0].q_end - p
            seqs = [(ex.input_ids[: p + c], p - 1), (ex.input_ids[:p] + ex.input_ids[p + c :], p - 1)]
        for ids, start in seqs:
            logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
            total = total + F.cross_entropy(logits[start:-1], torch.tensor(ids[start + 1 :]), reduction="sum")
    return total


@pytest.mark.parametrize("arch", ARCHS)
def test_packed_loss_and_gradients_equal_alone(arch):
    gen = torch.Generator().manual_seed(1)
    examples, _ = make_examples(gen)
    model = tiny_model(arch)
    stock = twin(model, "sdpa")
    for strategy in ("sequential", "greedy"):
        model.zero_grad()
        stock.zero_grad()
        packed = lm_loss_packed(
            model, [causal_example(e.input_ids, [], []) if len(e.blocks) == 1 else e for e in examples], strategy
        )
        alone = lm_loss_alone(stock, examples)
        packed.backward()
        alone.backward()
        assert abs(packed.item() - alone.item()) <= 1e-5 * abs(alone.item()), (packed.item(), alone.item())
        grads = dict(stock.named_parameters())
        for name, param in model.named_parameters():
            ref = grads[name].grad
            rel = (param.grad - ref).norm() / ref.norm().clamp_min(1e-12)
            assert rel <= 1e-4, (strategy, name, rel.item())


def test_first_rejected_token_is_read_from_last_prompt_position():
    p, c, r = 3, 2, 4
    chosen_idx, rejected_idx = pair_coordinates(p, c, r)
    assert rejected_idx[p - 1] == p - 1  # not the last chosen token (index p + c - 1)
    assert rejected_idx[p] == p + c
    assert chosen_idx == list(range(p + c))


def test_stock_paths_that_leak_are_caught():
    """Negative control: position ids alone (default use_cache) leak across examples; a 2-D mask too."""
    gen = torch.Generator().manual_seed(2)
    examples, _ = make_examples(gen)
    model = tiny_model("llama").eval()
    stock = twin(model, "sdpa").eval()
    rows, _ = pack(examples[:3], 40, "sequential")
    batch = collate(rows, pad_token_id=0)
    b = rows[0].blocks[1]
    with torch.no_grad():
        ref = alone_logits(stock, rows[0].input_ids[b.q_start : b.q_end])
        leaky = stock(
            input_ids=batch.input_ids, position_ids=batch.position_ids, attention_mask=torch.ones_like(batch.input_ids)
        ).logits[0, b.q_start : b.q_end]
        ours = model(**batch.model_inputs()).logits[0, b.q_start : b.q_end]
    assert (leaky - ref).abs().max() > 1e-3  # the equality tests above would flag this path
    assert (ours - ref).abs().max() <= 1e-5


def test_dense_and_flex_masks_agree_with_blockwise():
    gen = torch.Generator().manual_seed(3)
    examples, _ = make_examples(gen)
    model = tiny_model("qwen2").eval()
    dense_model = twin(model, "sdpa").eval()
    flex_model = twin(model, "flex_attention").eval()
    rows, _ = pack(examples, 64, "greedy")
    batch = collate(rows, pad_token_id=0, pad_to=64)
    with torch.no_grad():
        ours = model(**batch.model_inputs()).logits
        dense = dense_model(
            input_ids=batch.input_ids,
            position_ids=batch.position_ids,
            attention_mask=batch.attention.dense_mask(),
            use_cache=False,
        ).logits
        flex = flex_model(
            input_ids=batch.input_ids,
            position_ids=batch.position_ids,
            attention_mask=flex_block_mask(batch.attention, "cpu"),
            use_cache=False,
        ).logits
    for r, row in enumerate(rows):
        n = len(row)
        assert (ours[r, :n] - dense[r, :n]).abs().max() <= 1e-5
        assert (ours[r, :n] - flex[r, :n]).abs().max() <= 1e-5


def test_flash_start_rows_of_pair_layout():
    # [P P | C C | R R]: prompt and rejected columns see rows up to the end (6), chosen up to rejected start (4).
    attn = PackedAttention([[Block(0, 4, ((0, 4),)), Block(4, 6, ((0, 2), (4, 6)))]], 6)
    assert attn.flash_start_rows().tolist() == [[6, 6, 4, 4, 6, 6]]


def test_packing_invariants():
    gen = torch.Generator().manual_seed(4)
    examples, _ = make_examples(gen)
    for ex in examples:  # a readout on every token, to check none leaves its example
        ex.readout_position = list(range(len(ex)))
        ex.readout_target = [0] * len(ex)
        ex.readout_part = [0] * len(ex)
    rows, stats = pack(examples, 40, "greedy")
    assert stats.examples == len(examples) and sum(len(r.records) for r in rows) == len(examples)
    batch = collate(rows, pad_token_id=0)
    mask = batch.attention.dense_mask()[:, 0]
    for r, row in enumerate(rows):
        owner = [-1] * batch.input_ids.shape[1]
        start = 0
        for e_idx, rec in enumerate(row.records):
            n = len(examples[rec])
            owner[start : start + n] = [e_idx] * n
            # positions restart at 0 for each example
            assert row.position_ids[start] == 0
            start += n
        owner_t = torch.tensor(owner)
        cross = (owner_t[:, None] != owner_t[None, :]) & (owner_t[:, None] >= 0)
        assert not (mask[r] & cross).any(), "a token attends across examples"
        for pos, ex_i in zip(row.readout_position, row.readout_example):
            assert owner[pos] == ex_i, "a readout crosses an example boundary"


def test_plan_rows_respects_capacity_and_keeps_every_example():
    lengths = [5, 17, 3, 30, 12, 8, 8, 22, 1]
    for strategy in (None, "sequential", "greedy"):
        plan = plan_rows(lengths, 32, strategy)
        assert sorted(i for row in plan for i in row) == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in row) <= 32 for row in plan)
    assert plan_rows([5, 30, 3], 32, "sequential") == [[0], [1], [2]]
    assert len(plan_rows([5, 30, 3], 32, "greedy")) == 2


def test_greedy_pad_ratio_on_bundled_data_under_5_percent():
    from llm.data.encode_reward import prm_response_text
    from tests.helpers import tokenizer

    tok = tokenizer()
    lengths = []
    with open(os.path.join(ROOT, "llm", "data", "sample", "prm_train.jsonl"), encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            lengths.append(
                len(tok(rec["src"][0] + "\n")["input_ids"])
                + len(tok(prm_response_text(rec["responses"], "ки"), add_special_tokens=False)["input_ids"])
            )
    examples = [causal_example([1] * n, [], []) for n in lengths]
    _, greedy = pack(examples, 1024, "greedy")
    _, padded = pack(examples, 1024, None, batch_size=8)
    print(f"pad ratio: greedy {greedy.pad_ratio:.2%}, padded batches of 8 {padded.pad_ratio:.2%}")
    assert greedy.pad_ratio < 0.05
    assert padded.pad_ratio > greedy.pad_ratio


def test_flex_kernel_forward_equals_blockwise_on_cpu():
    # FlexAttention trains only on CUDA; its forward runs on CPU, which checks the BlockMask path.
    gen = torch.Generator().manual_seed(5)
    examples, _ = make_examples(gen)
    model = tiny_model("mistral").eval()
    rows, _ = pack(examples, 64, "greedy")
    with torch.no_grad():
        ours = model(**collate(rows, pad_token_id=0, pad_to=64).model_inputs()).logits
        flex = model(**collate(rows, pad_token_id=0, pad_to=64, kernel="flex").model_inputs()).logits
    for r, row in enumerate(rows):
        assert (ours[r, : len(row)] - flex[r, : len(row)]).abs().max() <= 1e-5


def test_streamed_rows_equal_eager_packing():
    from llm.data.packing import StreamedRows

    gen = torch.Generator().manual_seed(6)
    examples = [
        causal_example(random_ids(int(n), gen), [0], [1], record=i)
        for i, n in enumerate(torch.randint(3, 30, (50,), generator=gen))
    ]
    eager, _ = pack(examples, 64, "sequential")
    streamed = list(StreamedRows(lambda: iter(examples), 64, "sequential", buffer=1000))
    assert [r.input_ids for r in streamed] == [r.input_ids for r in eager]
    # A small buffer still keeps every example exactly once.
    small = list(StreamedRows(lambda: iter(examples), 64, "greedy", buffer=7))
    assert sorted(rec for r in small for rec in r.records) == list(range(50))


@pytest.mark.parametrize("granularity", ["full_attn", "core_attn"])
def test_recompute_granularity_keeps_gradients_and_recomputes(granularity, monkeypatch):
    """recompute_granularity below a whole layer: same loss and gradients as no recompute, and backward
    really runs the attention block (full_attn) or only the attention kernel (core_attn) a second time."""
    from llm.utils import attention
    from llm.utils.modeling import enable_recompute

    gen = torch.Generator().manual_seed(3)
    examples = [causal_example(e.input_ids, [], []) for e in make_examples(gen)[0][:-1]]
    plain = tiny_model("llama")
    recomputed = twin(plain, "packed_sdpa")
    enable_recompute(recomputed, granularity)
    calls = {"kernel": 0, "q_proj": 0}
    kernel = attention.blockwise_sdpa

    def counting_kernel(*args, **kwargs):
        calls["kernel"] += 1
        return kernel(*args, **kwargs)

    monkeypatch.setattr(attention, "blockwise_sdpa", counting_kernel)
    for layer in recomputed.model.layers:
        layer.self_attn.q_proj.register_forward_hook(lambda *_: calls.__setitem__("q_proj", calls["q_proj"] + 1))
    a = lm_loss_packed(plain, examples, "greedy")
    a.backward()
    calls.update(kernel=0, q_proj=0)
    b = lm_loss_packed(recomputed, examples, "greedy")
    layers = len(recomputed.model.layers)
    assert calls == {"kernel": layers, "q_proj": layers}  # forward: once per layer
    b.backward()
    # backward: the kernel again in every layer; the projections too only with full_attn
    assert calls == {"kernel": 2 * layers, "q_proj": (2 if granularity == "full_attn" else 1) * layers}
    assert b.item() == pytest.approx(a.item(), rel=1e-6)
    grads = dict(plain.named_parameters())
    for name, param in recomputed.named_parameters():
        torch.testing.assert_close(param.grad, grads[name].grad, rtol=1e-5, atol=1e-6, msg=name)


def _covered(packed):
    """(rows, L) bool: positions some block's queries cover (the rest is padding, output 0)."""
    covered = torch.zeros(len(packed.blocks), packed.seq_len, dtype=torch.bool)
    for r, row in enumerate(packed.blocks):
        for b in row:
            covered[r, b.q_start : b.q_end] = True
    return covered


def _dense_sdpa(q, k, v, packed):
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=packed.dense_mask(), enable_gqa=True)
    return out * _covered(packed)[:, None, :, None]


def test_sdpa_layout_is_built_once_per_batch_and_never_reused(monkeypatch):
    """The block layout (splits, masks) is derived once per batch and shared by every layer; it gives what a
    fresh description gives and the dense mask gives, and another batch or changed blocks never reuse it."""
    from llm.utils import attention

    builds = []
    build = attention._RowLayout.build
    monkeypatch.setattr(
        attention._RowLayout, "build", classmethod(lambda cls, row, n: builds.append(n) or build(row, n))
    )
    gen = torch.Generator().manual_seed(4)
    examples, _ = make_examples(gen)

    def batch(order, strategy):
        rows, _ = pack([examples[i] for i in order], 40, strategy)
        packed = collate(rows, pad_token_id=0, pad_to=48).attention
        qkv = [torch.randn(len(rows), h, 48, 8, generator=gen) for h in (4, 2, 2)]  # grouped-query heads
        return packed, qkv

    a, (q, k, v) = batch(range(len(examples)), "greedy")
    first = attention.blockwise_sdpa(q, k, v, a, None)
    second = attention.blockwise_sdpa(2 * q, k, v, a, None)  # the next layer of the same batch
    assert len(builds) == len(a.blocks)  # built once, for the first layer
    assert len(a.blocks[0]) > 1 and any(not b.is_document_causal for row in a.blocks for b in row)
    uncached = attention.blockwise_sdpa(2 * q, k, v, PackedAttention(a.blocks, a.seq_len), None)
    torch.testing.assert_close(second, uncached, rtol=0, atol=0)
    torch.testing.assert_close(first, _dense_sdpa(q, k, v, a), rtol=1e-5, atol=1e-6)

    b, (q2, k2, v2) = batch(range(len(examples) - 1, -1, -1), "sequential")  # another batch, another layout
    n = len(builds)
    torch.testing.assert_close(
        attention.blockwise_sdpa(q2, k2, v2, b, None), _dense_sdpa(q2, k2, v2, b), rtol=1e-5, atol=1e-6
    )
    assert len(builds) == n + len(b.blocks)
    # The same description object with other blocks (a reused object) is rebuilt, not served stale.
    a.blocks = [list(row) for row in b.blocks]
    torch.testing.assert_close(
        attention.blockwise_sdpa(q2, k2, v2, a, None), _dense_sdpa(q2, k2, v2, b), rtol=1e-5, atol=1e-6
    )
    with pytest.raises(ValueError, match="rows of 48"):
        attention.blockwise_sdpa(q2[:, :, :40], k2[:, :, :40], v2[:, :, :40], a, None)


def test_readout_sdpa_equals_blockwise_at_those_rows():
    """Attention at a few query positions (the reward readouts) == those rows of the full block-wise
    attention, in value and in the gradients of queries, keys and values; pair blocks included."""
    from llm.utils.attention import blockwise_sdpa, readout_sdpa

    gen = torch.Generator().manual_seed(5)
    examples, _ = make_examples(gen)
    rows, _ = pack(examples, 40, "greedy")
    packed = collate(rows, pad_token_id=0, pad_to=44).attention
    n_rows, length = len(rows), 44
    covered = _covered(packed).flatten().nonzero().flatten()
    positions = sorted(covered[torch.randperm(len(covered), generator=gen)[:25]].tolist())
    pair_rejected = [
        r * length + p
        for r, row in enumerate(packed.blocks)
        for b in row
        if len(b.kv) == 2
        for p in (b.q_start, b.q_end - 1)
    ]
    positions = sorted(set(positions) | set(pair_rejected))
    q = torch.randn(n_rows, 4, length, 8, generator=gen, requires_grad=True)
    k, v = (torch.randn(n_rows, 2, length, 8, generator=gen, requires_grad=True) for _ in range(2))
    weights = torch.randn(4, len(positions), 8, generator=gen)

    def flat(x):  # (R, H, L, D) -> (H, R * L, D)
        return x.transpose(0, 1).reshape(x.shape[1], -1, x.shape[3])

    full = flat(blockwise_sdpa(q, k, v, packed, 0.3))[:, positions]
    grads_full = torch.autograd.grad((full * weights).sum(), (q, k, v))
    sparse = readout_sdpa(flat(q)[None, :, positions], k, v, packed, positions, 0.3)[0]
    grads_sparse = torch.autograd.grad((sparse * weights).sum(), (q, k, v))
    torch.testing.assert_close(sparse, full, rtol=1e-5, atol=1e-6)
    for g_sparse, g_full in zip(grads_sparse, grads_full):
        torch.testing.assert_close(g_sparse, g_full, rtol=1e-5, atol=1e-6)
    padding = (~_covered(packed)).flatten().nonzero().flatten()[:1].tolist()
    with pytest.raises(ValueError, match="in no attention block"):
        readout_sdpa(flat(q)[None, :, padding], k, v, packed, padding, 0.3)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("head", ["causal_lm", "score"])
def test_last_layer_at_readouts_equals_full_layer(arch, head):
    """The reward trainers' last decoder layer run at the readout positions only gives the full model's
    hidden states there and the same gradients; without ``readout_index`` the model is unchanged."""
    import copy
    import functools

    from transformers import AutoModelForSequenceClassification

    from llm.alignment.lm import readout_hidden
    from llm.alignment.rm import readout

    gen = torch.Generator().manual_seed(6)
    examples, (p, c, r) = make_examples(gen)
    for ex in examples[:-1]:
        ex.readout_position = sorted(torch.randperm(len(ex), generator=gen)[:3].tolist())
    n_p, n_c, n_r = len(p), len(c), len(r)
    examples[-1].readout_position = [n_p + n_c - 1, n_p + n_c + n_r - 1]  # ORM: last chosen, last rejected
    rows, _ = pack(examples, 40, "greedy")
    batch = collate(rows, pad_token_id=0)
    kwargs = {} if head == "causal_lm" else {"auto_class": AutoModelForSequenceClassification, "num_labels": 1}
    full = tiny_model(arch, **kwargs)
    sparse = twin(full, "packed_sdpa")
    assert readout.install(sparse) and readout.install(sparse)  # idempotent
    causal = head == "causal_lm"
    h_full = readout_hidden(full, batch, causal)
    h_sparse = readout_hidden(functools.partial(sparse, readout_index=batch.readout_index), batch, causal)
    torch.testing.assert_close(h_sparse, h_full, rtol=1e-5, atol=1e-5)
    weights = torch.randn(h_full.shape, generator=gen)
    (h_full * weights).sum().backward()
    (h_sparse * weights).sum().backward()
    grads = dict(full.named_parameters())
    for name, param in sparse.named_parameters():
        ref = grads[name].grad
        if ref is None:
            assert param.grad is None or not param.grad.any(), name
            continue
        rel = (param.grad - ref).norm() / ref.norm().clamp_min(1e-12)
        assert rel <= 1e-4, (name, rel.item())
    with torch.no_grad():  # no readout_index: the stock layer
        assert torch.equal(sparse(**batch.model_inputs()).logits, full(**batch.model_inputs()).logits)
    copied = copy.deepcopy(sparse)
    last = copied.base_model.layers[-1]
    assert last.forward.args[0] is last  # a copy runs its own layer, not the original's


def test_last_layer_at_readouts_only_for_llama_shaped_layers():
    from llm.alignment.rm import readout

    assert not readout.install(tiny_model("qwen3"))  # q/k norms: keeps the full layer


def test_repeated_stream_starts_again_and_an_empty_one_stops():
    from itertools import islice

    from llm.data.packing import StreamedRows
    from llm.utils.errors import UserError

    examples = [causal_example(list(range(1, n + 1)), [n - 1], [0], record=i) for i, n in enumerate((5, 7, 3))]
    once = list(StreamedRows(lambda: iter(examples), 8, None))
    assert len(once) == 3  # one example per row without packing
    cycled = list(islice(StreamedRows(lambda: iter(examples), 8, None, repeat=True), 7))
    # pass 1, pass 2, then the first row of pass 3: rows in file order, the seam invisible
    assert [r.input_ids for r in cycled] == [r.input_ids for r in (once * 3)[:7]]
    with pytest.raises(UserError, match="nothing.jsonl: the stream holds no example that fits max_seq_len=8"):
        next(iter(StreamedRows(lambda: iter([]), 8, None, repeat=True, source="nothing.jsonl")))


def test_readout_fast_path_goes_by_structure_not_class_name(caplog):
    """A Qwen3 layer (q/k norms in its attention) keeps the full computation, with a warning naming why; a
    Llama-shaped layer under a name no list holds gets the fast path and the same numbers."""
    import functools

    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from llm.alignment.lm import readout_hidden
    from llm.alignment.rm import readout

    qwen3 = tiny_model("qwen3", head_dim=16)
    with caplog.at_level("WARNING", logger="llm.alignment.rm.readout"):
        assert not readout.install(qwen3)
    assert "k_norm" in caplog.text and "Qwen3DecoderLayer" in caplog.text
    assert readout.mismatch(qwen3.model.layers[-1]) is not None

    class HouseDecoderLayer(LlamaDecoderLayer):
        pass

    full = tiny_model("llama")
    sparse = twin(full, "packed_sdpa")
    sparse.model.layers[-1].__class__ = HouseDecoderLayer
    assert readout.mismatch(sparse.model.layers[-1]) is None and readout.install(sparse)
    gen = torch.Generator().manual_seed(7)
    examples, _ = make_examples(gen)
    for ex in examples:
        ex.readout_position = sorted(torch.randperm(len(ex), generator=gen)[:3].tolist())
    batch = collate(pack(examples, 40, "greedy")[0], pad_token_id=0)
    h_full = readout_hidden(full, batch, True)
    h_sparse = readout_hidden(functools.partial(sparse, readout_index=batch.readout_index), batch, True)
    torch.testing.assert_close(h_sparse, h_full, rtol=1e-5, atol=1e-5)


def test_sliding_window_model_longer_than_its_window_is_refused_and_shorter_is_exact():
    """Mistral with sliding_window 32: packed examples of at most 32 tokens equal each one alone through the
    stock model (which applies the window); a 33-token example stops with a message (the kernels have none)."""
    from llm.utils.errors import UserError

    gen = torch.Generator().manual_seed(8)
    model = tiny_model("mistral", sliding_window=32)
    stock = twin(model, "sdpa")
    short = [causal_example(random_ids(n, gen), [], [], record=i) for i, n in enumerate([32, 20, 9])]
    rows, _ = pack(short, 64, "greedy")
    batch = collate(rows, pad_token_id=0)
    logits = model(**batch.model_inputs()).logits
    for r, row in enumerate(rows):
        for b in row.blocks:
            ids = batch.input_ids[r, b.q_start : b.q_end].tolist()
            torch.testing.assert_close(logits[r, b.q_start : b.q_end], alone_logits(stock, ids), rtol=1e-4, atol=1e-4)
    long = [causal_example(random_ids(33, gen), [], [], record=0)]
    batch = collate(pack(long, 64, "greedy")[0], pad_token_id=0)
    with pytest.raises(UserError, match="sliding window of 32 tokens .* spans 33"):
        model(**batch.model_inputs())


@pytest.mark.parametrize("keys", [48, 300])
def test_short_half_precision_blocks_attend_in_fp32_on_cpu(keys):
    """bf16 blocks of at most CPU_HALF_UPCAST_KEYS keys run in fp32 (torch's CPU flash backward in bf16 costs ~1 ms
    a call more): the fp32 result rounded, closer to the exact attention than the bf16 kernel's; longer blocks keep
    the bf16 kernel, bit for bit."""
    from llm.utils.attention import CPU_HALF_UPCAST_KEYS, blockwise_sdpa

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, keys, 16, generator=gen).to(torch.bfloat16) for h in (6, 2, 2))
    packed = PackedAttention([[Block(0, keys, ((0, keys),))]], keys)
    q.requires_grad_(True)
    out = blockwise_sdpa(q, k, v, packed, None)
    out.float().square().sum().backward()
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True, enable_gqa=True)
    kernel = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert out.dtype == q.grad.dtype == torch.bfloat16
    if keys <= CPU_HALF_UPCAST_KEYS:
        upcast = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, enable_gqa=True)
        assert torch.equal(out, upcast.to(torch.bfloat16))
        assert (out.double() - exact).abs().mean() < (kernel.double() - exact).abs().mean()
    else:
        assert torch.equal(out, kernel)
