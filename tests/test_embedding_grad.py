"""``reuse_embedding_gradient``: the input embedding's gradient lands in a buffer kept across steps, bit-identical to
autograd's own (tied and untied weights, padding id, repeated tokens, fp32 and bf16, accumulation over
micro-batches), and the same buffer is reused step after step."""

import copy

import pytest
import torch

from llm.utils.embedding_grad import reuse_embedding_gradient


class Tiny(torch.nn.Module):
    """An embedding, a layer, and an LM head tied to the embedding or not."""

    def __init__(self, tied: bool, dtype: torch.dtype):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = torch.nn.Embedding(50, 8, padding_idx=0)
        self.mid = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 50, bias=False)
        for p in self.parameters():
            p.data = torch.randn(p.shape, generator=g)
        if tied:
            self.head.weight = self.emb.weight
        self.to(dtype)

    def get_input_embeddings(self):
        return self.emb

    def forward(self, ids):
        return self.head(torch.tanh(self.mid(self.emb(ids))))


def loss_of(model, ids):
    return model(ids).float().log_softmax(-1)[..., 1].sum()


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_equal_autograds_over_steps_and_micro_batches(tied, dtype):
    base = Tiny(tied, dtype)
    ours = copy.deepcopy(base)
    assert reuse_embedding_gradient(ours)
    gen = torch.Generator().manual_seed(1)
    buffers = []
    for _step in range(3):
        for model in (base, ours):
            model.zero_grad(set_to_none=True)
        for _micro in range(2):  # the second backward accumulates
            ids = torch.randint(0, 6, (3, 7), generator=gen)  # few ids: repeated tokens, padding id 0 among them
            for model in (base, ours):
                loss_of(model, ids).backward()
        for (name, p), q in zip(base.named_parameters(), ours.parameters()):
            assert torch.equal(p.grad, q.grad), name
        assert base.emb.weight.grad[0].abs().sum() == 0 or tied  # the padding row gets nothing from the lookup
        buffers.append(ours.emb._grad_buffer)
    assert buffers[0] is buffers[1] is buffers[2]  # one buffer, kept


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_scatter_sums_as_autograds_embedding_backward(dtype):
    """Many repeated ids over a larger table: the order and precision of the sums match autograd's."""
    from llm.utils.embedding_grad import _rows, _scatter

    for seed in range(6):
        g = torch.Generator().manual_seed(seed)
        weight = torch.randn(1000, 64, generator=g).to(dtype).requires_grad_(True)
        ids = torch.randint(0, 30 if seed % 2 else 1000, (4, 300), generator=g)
        grad = torch.randn(4, 300, 64, generator=g).to(dtype)
        torch.nn.functional.embedding(ids, weight, padding_idx=1).backward(grad)
        flat, rows = _rows(ids, grad, 1)
        assert torch.equal(_scatter(torch.zeros_like(weight), flat, rows), weight.grad), seed


def test_first_backward_writes_the_buffer_as_the_gradient():
    model = Tiny(tied=False, dtype=torch.float32)
    reuse_embedding_gradient(model)
    ids = torch.tensor([[3, 3, 0, 5]])
    loss_of(model, ids).backward()
    assert model.emb.weight.grad is model.emb._grad_buffer
    touched = model.emb.weight.grad.abs().sum(-1).nonzero().flatten().tolist()
    assert touched == [3, 5]  # rows of the ids seen, not the padding id's


def test_frozen_or_unusual_embeddings_are_left_alone():
    frozen = Tiny(tied=False, dtype=torch.float32)
    frozen.emb.weight.requires_grad_(False)
    assert not reuse_embedding_gradient(frozen)
    normed = Tiny(tied=False, dtype=torch.float32)
    normed.emb.max_norm = 1.0
    assert not reuse_embedding_gradient(normed)
    assert not reuse_embedding_gradient(torch.nn.Linear(2, 2))
    on_meta = Tiny(tied=False, dtype=torch.float32).to("meta")  # any device but the CPU: autograd's own backward
    assert not reuse_embedding_gradient(on_meta)


def test_no_grad_lookups_and_a_deep_copy_still_work():
    model = Tiny(tied=True, dtype=torch.float32)
    reuse_embedding_gradient(model)
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        before = model(ids)
    twin = copy.deepcopy(model)  # the async rollout copies the actor
    assert torch.equal(twin(ids), before)
    loss_of(twin, ids).backward()
    assert twin.emb.weight.grad is twin.emb._grad_buffer
    assert model.emb.weight.grad is None
