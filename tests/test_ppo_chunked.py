"""PPO's log-probs, entropies and exact ("full") KL are computed on chunks of readouts (``lm.chunked``):
the numbers equal the unchunked formulas they replaced (kept here as ``unchunked``: the LM head on every
readout of a row at once, ``log_softmax``, the KL over ``(B, T, V)`` logits), gradients included, and no
tensor of more than one chunk x vocab elements is ever created, forward or backward (recorded by a
``TorchDispatchMode`` over every op)."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from llm.alignment.lm import chunked
from llm.alignment.ppo.algorithm import full_kl, token_stats
from llm.alignment.ppo.build import build_from_models
from llm.alignment.ppo.engine import per_token
from llm.alignment.ppo.fsdp import head_linear
from llm.alignment.ppo.objectives import policy_loss
from llm.alignment.ppo.prompts import Prompt
from llm.alignment.ppo.roles import PolicyModel
from llm.run_ppo import main
from llm.settings.load import parse_ppo_config
from tests.helpers import tiny_model, tokenizer
from tests.test_ppo_memory import fixed_samples
from tests.test_ppo_run import config, history

VOCAB = 648  # tiny_model's


def unchunked(role: PolicyModel, samples, idx, with_entropy=False, with_logits=False, entropy_grad=False):
    """The formulas before chunking (roles.py as of e52e75d): the head on all readouts of a row at once."""

    def head(hidden):
        return head_linear(role.model.get_output_embeddings(), hidden).float() / role.temperature

    def read(logits, batch):
        logp = torch.log_softmax(logits, -1)
        out = [logp.gather(-1, batch.readout_target[:, None]).squeeze(-1)]
        if with_entropy:
            with torch.set_grad_enabled(torch.is_grad_enabled() and entropy_grad):
                out.append(-(logp.exp() * logp).sum(-1))
        if with_logits:
            out.append(logits.detach())
        return out

    pad = role.tokenizer.pad_token_id
    return per_token(role.model, samples, idx, role.micro_batch_size, pad, True, head, read)


def policy(seed=0, temperature=0.7, micro=6, chunk=5) -> PolicyModel:
    role = PolicyModel(tiny_model(seed=seed), tokenizer(), temperature, micro)
    role.readout_chunk = chunk
    return role


def close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


# --- the math, on random inputs -------------------------------------------------------------------------------
@pytest.mark.parametrize("chunk", [1, 3, 7, 100])
def test_chunked_token_stats_equal_the_whole_block(chunk):
    """17 readouts (no chunk size here divides it): log-probs, entropies, KL and the gradients of a loss
    with an entropy bonus equal the one-block formulas (log_softmax over (N, V), ``full_kl``)."""
    gen = torch.Generator().manual_seed(0)
    n, h, v = 17, 8, 50
    hidden = torch.randn(n, h, generator=gen, requires_grad=True)
    ref_hidden = torch.randn(n, h, generator=gen)
    weight = torch.randn(v, h, generator=gen, requires_grad=True)
    bias = torch.randn(v, generator=gen, requires_grad=True)
    ref_weight = torch.randn(v, h, generator=gen)
    targets = torch.randint(0, v, (n,), generator=gen)
    t = 0.7

    def fn(hd, tg, rh, w, b):
        ref_logits = None if rh is None else torch.nn.functional.linear(rh, ref_weight) / t
        return token_stats(torch.nn.functional.linear(hd, w, b) / t, tg, True, True, ref_logits)

    logits = torch.nn.functional.linear(hidden, weight, bias) / t
    logp = torch.log_softmax(logits, -1)
    want_lp = logp.gather(-1, targets[:, None]).squeeze(-1)
    want_ent = -(logp.exp() * logp).sum(-1)
    want_kl = full_kl(logits.detach(), torch.nn.functional.linear(ref_hidden, ref_weight) / t)
    (want_lp.sum() - 0.3 * want_ent.sum()).backward()
    want_grads = [x.grad.clone() for x in (hidden, weight, bias)]
    for x in (hidden, weight, bias):
        x.grad = None

    lp, ent, kl = chunked(fn, (hidden, targets, ref_hidden), (weight, bias), chunk)
    close(lp, want_lp)
    close(ent, want_ent)
    close(kl, want_kl)
    assert not kl.requires_grad
    (lp.sum() - 0.3 * ent.sum()).backward()
    for x, want in zip((hidden, weight, bias), want_grads):
        close(x.grad, want)


def test_statistic_entropy_keeps_no_graph():
    """Without ``entropy_grad`` the entropy is a statistic: no gradient flows from it, the log-probs' does."""
    logits = torch.randn(4, 9, requires_grad=True)
    lp, ent, kl = token_stats(logits, torch.tensor([0, 3, 8, 1]), with_entropy=True)
    assert lp.requires_grad and not ent.requires_grad and kl is None


# --- the roles: equal to the unchunked formulas -----------------------------------------------------------------
@pytest.mark.parametrize("chunk", [1, 4, 10**9])
def test_log_probs_and_entropies_equal_unchunked(chunk):
    role = policy(chunk=chunk)
    samples = fixed_samples(n=6)
    idx = list(range(len(samples)))
    with torch.no_grad():
        want_lp, want_ent = unchunked(role, samples, idx, with_entropy=True)
        lp, ent = role._log_probs(samples, idx, with_entropy=True)
        close(role.log_probs(samples), want_lp)
    close(lp, want_lp)
    close(ent, want_ent)


@pytest.mark.parametrize("entropy_coeff", [0.0, 0.05])
def test_policy_loss_gradients_equal_unchunked(entropy_coeff):
    """The actor's update loss (clipped policy loss minus the entropy bonus) backward: the same gradient on
    every parameter, chunked (4 readouts, which divides no row's count) and not."""
    samples = fixed_samples(n=6)
    idx = [0, 2, 3, 5]
    grads = []
    for chunked_run in (False, True):
        role = policy(chunk=4)
        if chunked_run:
            logp, ent = role._log_probs(samples, idx, with_entropy=True, entropy_grad=bool(entropy_coeff))
        else:
            logp, ent = unchunked(role, samples, idx, with_entropy=True, entropy_grad=bool(entropy_coeff))
        assert ent.requires_grad == bool(entropy_coeff)
        T = logp.shape[1]
        m = samples.response_mask()[idx, :T]
        gen = torch.Generator().manual_seed(1)
        old = logp.detach() + 0.1 * torch.randn(logp.shape, generator=gen)
        adv = torch.randn(logp.shape, generator=gen)
        out = policy_loss(logp, old, adv, m, 0.2, 0.2, normaliser=m.sum())
        loss = out.loss - entropy_coeff * (ent * m).sum() / m.sum()
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in role.model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and "lm_head.weight" in grads[0]
    for name in grads[0]:
        close(grads[1][name], grads[0][name])


def test_full_kl_equals_the_kl_over_whole_logits():
    """The actor's KL from the reference's hidden states and LM head equals ``full_kl`` over the (B, T, V)
    temperature-scaled logits of both (what the trainer computed before); and the trainer's score phase
    gives it, masked."""
    samples = fixed_samples(n=6)
    idx = list(range(len(samples)))
    actor, ref = policy(seed=0, chunk=3), policy(seed=1, chunk=5)
    with torch.no_grad():
        (_, actor_logits), (_, ref_logits) = (unchunked(r, samples, idx, with_logits=True) for r in (actor, ref))
    want = full_kl(actor_logits, ref_logits)
    actor.take_reference_head(ref.lm_head())
    ref_lp, ref_hidden = ref.log_probs(samples, with_hidden=True)
    assert ref_hidden.shape == (*want.shape, actor.model.config.hidden_size)
    lp, kl = actor.log_probs(samples, ref_hidden=ref_hidden)
    mask = samples.response_mask()
    close(kl * mask, want * mask)
    close(lp, actor.log_probs(samples))
    close(ref_lp, ref.log_probs(samples))


def test_score_phase_full_kl_equals_unchunked(tmp_path):
    c = parse_ppo_config([config(tmp_path, algorithm={"kl_penalty": "full"})])
    tok = tokenizer()
    samples = fixed_samples(n=6)
    prompts = [Prompt(p, "", None) for p in samples.prompt_ids]
    models = [tiny_model(seed=0), tiny_model(seed=1), tiny_model(seed=2, auto_class=_seq_cls(), num_labels=1)]
    models.append(tiny_model(seed=3, auto_class=_seq_cls(), num_labels=1))
    trainer = build_from_models(c, prompts, tok, *models)
    trainer.actor.readout_chunk = trainer.ref.readout_chunk = 3
    scored = trainer.score(samples)
    idx = list(range(len(samples)))
    with torch.no_grad():
        (lp, actor_logits), (ref_lp, ref_logits) = (
            unchunked(r, samples, idx, with_logits=True) for r in (trainer.actor, trainer.ref)
        )
    close(scored.kl, full_kl(actor_logits, ref_logits) * scored.mask)
    close(scored.logprobs, lp)
    close(scored.ref_logprobs, ref_lp)


def _seq_cls():
    from transformers import AutoModelForSequenceClassification

    return AutoModelForSequenceClassification


def test_full_kl_run_does_not_depend_on_the_chunk(tmp_path, monkeypatch):
    """A whole run with kl_penalty full (KL in the reward), an entropy bonus and temperature 0.7: the same
    history with 3 readouts per chunk (training.readout_chunk) as with one block per row (what the unchunked
    code computed)."""
    runs, used = [], []
    original = PolicyModel._log_probs

    def recording(self, *args, **kwargs):
        used.append(self.readout_chunk)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(PolicyModel, "_log_probs", recording)
    for chunk in (10**9, 3):
        out = tmp_path / f"out{chunk}"
        cfg = config(
            tmp_path,
            algorithm={"kl_penalty": "full", "kl_ctrl": {"type": "fixed", "kl_coef": 0.2}},
            actor_rollout={"entropy_coeff": 0.01, "temperature": 0.7},
            training={"output_dir": str(out), "readout_chunk": chunk},
        )
        main([cfg])
        runs.append(history(out))
        assert set(used) == {chunk}  # actor and reference read the config's chunk size
        used.clear()
    assert len(runs[0]) == 2 and runs[0][-1]["kl"] > 0  # step 1: the actor is still the reference
    for a, b in zip(*runs):
        for key in ("kl", "entropy", "policy_loss", "score", "reward", "value_loss", "approx_kl"):
            assert a[key] == pytest.approx(b[key], abs=1e-5), key


# --- memory: no tensor larger than one chunk x vocab -----------------------------------------------------------
class VocabBlocks(TorchDispatchMode):
    """Every op's outputs with a vocab-sized dimension (the LM head's weight and its gradient ``(V, H)``
    excepted), in rows of ``V`` elements: the largest one (``rows``) and the most alive at once
    (``peak``: each counted from its creation until it is freed)."""

    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.vocab, self.hidden = vocab, hidden
        self.rows = self.live = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if not isinstance(t, torch.Tensor) or self.vocab not in t.shape or t._is_view():
                continue
            if sorted(t.shape) == sorted((self.vocab, self.hidden)):
                continue
            rows = t.numel() // self.vocab
            self.rows, self.live = max(self.rows, rows), self.live + rows
            self.peak = max(self.peak, self.live)
            weakref.finalize(t, self._freed, rows)
        return out

    def _freed(self, rows: int) -> None:
        self.live -= rows


def vocab_blocks(chunk: int, n: int) -> tuple[VocabBlocks, VocabBlocks, int]:
    """The vocab blocks of scoring (reference hidden states, the actor's log-probs and exact KL) and of the
    update's forward + backward (entropy bonus on) over ``n`` samples packed into one row; and its readouts."""
    samples = fixed_samples(n=n)
    actor, ref = policy(seed=0, chunk=chunk, micro=n), policy(seed=1, chunk=chunk, micro=n)
    actor.take_reference_head(ref.lm_head())
    hidden = actor.model.config.hidden_size
    with VocabBlocks(VOCAB, hidden) as scoring:
        _, ref_hidden = ref.log_probs(samples, with_hidden=True)
        actor.log_probs(samples, ref_hidden=ref_hidden)
    with VocabBlocks(VOCAB, hidden) as update:
        logp, ent = actor._log_probs(samples, list(range(n)), with_entropy=True, entropy_grad=True)
        m = samples.response_mask()[:, : logp.shape[1]]
        loss = policy_loss(logp, logp.detach(), torch.ones_like(logp), m, 0.2, 0.2).loss - 0.1 * (ent * m).sum()
        loss.backward()
    return scoring, update, sum(len(r) for r in samples.response_ids)


def test_no_block_larger_than_one_chunk_is_alive():
    """Chunks of 2 readouts: no tensor with a vocab dimension has more than 2 rows, and the most alive at once
    is a few such blocks (one chunk's logits, log-probs, probabilities, gradients), the same for 27 readouts
    as for 48: checkpointing keeps no chunk's blocks for backward. One block per row (chunk 10**9, the
    unchunked code's size) holds every readout, several times over: the check tells the two apart."""
    small, large = vocab_blocks(2, 6), vocab_blocks(2, 12)
    assert small[2] == 27 and large[2] == 48
    for phase in (0, 1):
        assert 1 <= large[phase].rows <= 2
        assert large[phase].peak == small[phase].peak <= 10 * 2 < small[2]
    whole = vocab_blocks(10**9, 6)
    for phase in (0, 1):
        assert whole[phase].rows == 27 and whole[phase].peak >= 4 * 27
    samples = fixed_samples(n=6)
    actor = policy(micro=6)
    with torch.no_grad(), VocabBlocks(VOCAB, actor.model.config.hidden_size) as old:
        unchunked(actor, samples, list(range(6)), with_logits=True)  # the (B, T, V) logits once kept for the KL
    assert old.rows >= 27


# --- Ray: the reference's hidden states and head across processes, an FSDP2 group splitting them ----------------
def test_full_kl_on_ray_with_fsdp2_groups_equals_one_process(tmp_path):
    """kl_penalty full with the actor and reference sharded over a 2-rank FSDP2 group (gloo) and a critic
    and reward in their own worker: the reference's head is gathered once and held by every actor rank, its
    (B, T, H) hidden states go through the driver and are split with the samples (9: 5 + 4 per rank), and
    the step equals the same step in one process."""
    import os

    from tests.test_ppo_ray import ORM_REWARD, assert_same_step, fixed_responses, two_steps

    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    import ray

    path = config(
        tmp_path,
        reward=ORM_REWARD,
        algorithm={"kl_penalty": "full", "kl_ctrl": {"type": "fixed", "kl_coef": 0.2}},
        data={"rollout_batch_size": 3},
        actor_rollout={"num_samples_per_step": 3, "ppo_mini_batch_size": 9, "temperature": 0.7},
        critic={"critic_mini_batch_size": 9},
        training={"micro_batch_size": 2},
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each Ray worker
    try:
        with two_steps(path, samples=9) as local:
            pass
    finally:
        torch.set_num_threads(threads)
    flags = ["--resource_pool.use_ray", "true", "--resource_pool.colocate"]
    flags += ['[["actor_rollout", "ref"], ["critic", "reward"]]', "--resource_pool.rollout", "0.5"]
    flags += ["--resource_pool.actor_rollout", "2", "--resource_pool.ref", "2"]
    flags += ["--resource_pool.critic", "0.5", "--resource_pool.reward", "0.5"]
    ray.init(num_cpus=3, include_dashboard=False, object_store_memory=200 * 1024**2)
    try:
        with two_steps(path, *flags, samples=9) as remote:
            assert len(remote["roles"]["actor_rollout"].pids) == 2
    finally:
        ray.shutdown()
    first = local["steps"][0]
    assert first["exp"].scored.samples.response_ids == fixed_responses(9)
    assert first["exp"].scored.kl.abs().sum() == 0  # step 1: the actor is the reference
    assert_same_step(first, remote["steps"][0])
    assert local["steps"][1]["exp"].scored.kl.abs().sum() > 0
    assert_same_step(local["steps"][1], remote["steps"][1], atol=2e-6)
