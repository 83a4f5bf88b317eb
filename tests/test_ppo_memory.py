"""PPO memory savers: AdamW state on the host, activation checkpointing, bf16 frozen roles, and frozen
roles offloaded when idle. This machine has no GPU: where a saver moves nothing on the CPU, the tests
run its copy logic directly (host masters, spied moves) and the builders' CPU path is checked to be the
identity; ``test_offload_moves_parameters_on_cuda`` runs only where CUDA is."""

import copy
import logging
import os

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from llm.alignment.ppo.build import Place, PPOContext, build_actor, build_critic, build_ref, build_reward
from llm.alignment.ppo.checkpoint import OPTIMIZER_FILE
from llm.alignment.ppo.interfaces import PolicyBatch, Samples, ValueBatch
from llm.alignment.ppo.offload import HOST, HostAdamW, OffloadedTrainableRole, offload_when_idle
from llm.alignment.ppo.optim import TrainableRole
from llm.alignment.ppo.rewards import ORMReward
from llm.alignment.ppo.roles import ActorRole, CriticRole, PolicyModel
from llm.alignment.ppo.update import PolicyUpdate, ValueUpdate
from llm.settings.load import parse_ppo_config
from llm.utils.errors import UserError
from tests.helpers import tiny_model, tokenizer
from tests.test_ppo_run import ORM_REWARD, config

ADAMW = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1}


def fixed_samples(n=6, seed=3) -> Samples:
    gen = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(7, 600, (int(torch.randint(3, 8, (1,), generator=gen)),), generator=gen).tolist()
        for _ in range(n)
    ]
    responses = [
        torch.randint(7, 600, (int(torch.randint(2, 7, (1,), generator=gen)),), generator=gen).tolist()
        for _ in range(n)
    ]
    return Samples(prompts, responses, [""] * n, [""] * n, [None] * n, torch.zeros(n, dtype=torch.bool))


def _loss(model, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(7, 600, (2, 9), generator=gen)
    return model(input_ids=ids, labels=ids).loss


# --- adam_offload -------------------------------------------------------------------------------------
def test_host_adamw_equals_adamw_and_keeps_its_state_on_the_host():
    plain, offloaded = tiny_model(seed=1), tiny_model(seed=1)
    ref_opt = torch.optim.AdamW(plain.parameters(), fused=True, **ADAMW)  # the plain role's (fused_if_possible)
    opt = HostAdamW(offloaded.parameters(), **ADAMW)
    assert (
        opt.defaults["fused"] and TrainableRole(plain, 0.1, 0.0, (0.9, 0.999), 1e-8, 0.0, 0).optimizer.defaults["fused"]
    )
    # the copy path is real even with both sides on the CPU: masters are separate fp32 tensors
    for p, m in zip(opt.params, opt.masters):
        assert m.data_ptr() != p.data_ptr() and m.dtype == torch.float32 and m.device == HOST
    for step in range(3):
        for model, o in ((plain, ref_opt), (offloaded, opt)):
            _loss(model, step).backward()
            o.step()
            o.zero_grad(set_to_none=True)
        assert all(p.grad is None for p in offloaded.parameters())
    for (name, a), b in zip(plain.named_parameters(), offloaded.parameters()):
        assert torch.equal(a, b), name  # fp32: the same arithmetic, bit for bit
    moved = sum(not torch.equal(a, b) for a, b in zip(plain.parameters(), tiny_model(seed=1).parameters()))
    assert moved > 0  # the steps changed the weights
    states = [opt.state[m] for m in opt.masters]
    assert all(s["exp_avg"].device == HOST and s["exp_avg_sq"].device == HOST for s in states)
    for p, m in zip(opt.params, opt.masters):  # the H2D copy brought the masters' values back
        assert torch.equal(p, m)


def test_host_adamw_bf16_model_keeps_fp32_master_weights():
    model = tiny_model(seed=2).to(torch.bfloat16)
    opt = HostAdamW(model.parameters(), **ADAMW)
    _loss(model, 0).backward()
    opt.step()
    for p, m in zip(opt.params, opt.masters):
        assert p.dtype == torch.bfloat16 and m.dtype == torch.float32
        assert torch.equal(p, m.to(torch.bfloat16))


def test_offloaded_role_checkpoint_loads_into_a_plain_role_and_back(tmp_path):
    tok = tokenizer()
    model = tiny_model(seed=4)
    role = OffloadedTrainableRole(model, 1e-2, 0.0, (0.9, 0.999), 1e-8, 1.0, 2)
    for step in range(2):
        _loss(model, step).backward()
        role.step()
    role.save(str(tmp_path / "a"), tok, with_optimizer=True)
    plain = TrainableRole(tiny_model(seed=9), 1e-2, 0.0, (0.9, 0.999), 1e-8, 1.0, 2)
    plain.load(str(tmp_path / "a"))
    back = OffloadedTrainableRole(tiny_model(seed=9), 1e-2, 0.0, (0.9, 0.999), 1e-8, 1.0, 2)
    back.load(str(tmp_path / "a"))
    for p, q, r in zip(model.parameters(), plain.model.parameters(), back.model.parameters()):
        assert torch.equal(p, q) and torch.equal(p, r)
    # one more step on each: the same update, so the moments and step counts came across
    for m in (model, plain.model, back.model):
        _loss(m, 7).backward()
    role.step(), plain.step(), back.step()
    for p, q, r in zip(model.parameters(), plain.model.parameters(), back.model.parameters()):
        assert torch.allclose(p, q, atol=1e-6, rtol=0) and torch.equal(p, r)
    assert os.path.exists(tmp_path / "a" / OPTIMIZER_FILE)


def test_adam_offload_on_cpu_is_the_identity_and_says_so(tmp_path, caplog):
    c = parse_ppo_config([config(tmp_path, training={"adam_offload": True})])
    with caplog.at_level(logging.INFO, logger="llm.alignment.ppo.build"):
        run = PPOContext.load(c)
        actor, critic = build_actor(c, Place("cpu"), run), build_critic(c, Place("cpu"), run)
    assert type(actor.optim) is TrainableRole and type(critic.optim) is TrainableRole
    assert "adam_offload: actor_rollout runs on the CPU" in caplog.text
    assert "adam_offload: critic runs on the CPU" in caplog.text


# --- gradient checkpointing ---------------------------------------------------------------------------
def _grads_at_step(role):
    grads = []
    original = role.optim.step

    def spy():
        grads.append({n: p.grad.clone() for n, p in role.model.named_parameters() if p.grad is not None})
        return original()

    role.optim.step = spy
    return grads


@pytest.mark.parametrize("kind", ["actor", "critic"])
def test_gradient_checkpointing_gives_the_same_losses_and_gradients(kind):
    tok, samples = tokenizer(), fixed_samples()
    n = len(samples)
    auto = {"actor": {}, "critic": {"auto_class": AutoModelForSequenceClassification, "num_labels": 1}}[kind]
    base = tiny_model(seed=5, **auto)
    results = []
    for checkpointing in (False, True):
        model = copy.deepcopy(base)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            assert model.is_gradient_checkpointing
        optim = TrainableRole(model, 1e-2, 0.0, (0.9, 0.999), 1e-8, 1.0, 0)
        mask = samples.response_mask()
        gen = torch.Generator().manual_seed(8)
        if kind == "actor":
            role = ActorRole(model, tok, 1.0, 4, optim, PolicyUpdate(n // 2, 0.2, 0.2, entropy_coeff=0.01))
            old = role.log_probs(samples)
            batch = PolicyBatch(samples, mask, old, torch.randn(mask.shape, generator=gen), None)
        else:
            role = CriticRole(model, tok, 4, optim, ValueUpdate(n // 2, 0.2, 1.0))
            old = role.values(samples)
            batch = ValueBatch(samples, mask, old, old + torch.randn(mask.shape, generator=gen))
        grads = _grads_at_step(role)
        stats = role.update(batch, [list(range(n))])  # one PPO step: two mini-batches, micro-batches of 4
        results.append(([loss for _, loss in stats.losses], grads, dict(model.named_parameters())))
    (loss0, grads0, params0), (loss1, grads1, params1) = results
    assert len(loss0) == 2 and max(abs(a - b) for a, b in zip(loss0, loss1)) <= 1e-5
    for g0, g1 in zip(grads0, grads1):
        assert g0.keys() == g1.keys() and len(g0) > 0
        for name in g0:
            assert torch.allclose(g0[name], g1[name], atol=1e-5, rtol=0), name
    for name in params0:
        assert torch.allclose(params0[name], params1[name], atol=1e-5, rtol=0), name


def test_gradient_checkpointing_is_enabled_on_the_trained_roles_only(tmp_path):
    c = parse_ppo_config([config(tmp_path, training={"gradient_checkpointing": True})])
    run = PPOContext.load(c)
    assert build_actor(c, Place(), run).model.is_gradient_checkpointing
    assert build_critic(c, Place(), run).model.is_gradient_checkpointing
    assert not build_ref(c, Place(), run).model.is_gradient_checkpointing


# --- frozen roles in bf16 -----------------------------------------------------------------------------
# bf16 keeps 8 significant bits: each rounding is off by at most u = 2^-9 (~2e-3) relative. The weights
# are rounded once, then the tiny 2-layer model runs ~10 rounded ops per token (embedding, 2 x (norm,
# attention, MLP, residual add), final norm, head); independent roundings grow like sqrt(10) ~ 3, so
# a value v comes out within ~3 u |v|. Log-probs over a 648-token vocabulary are ~ -6.5, at most ~ -9
# here: 3 u 9 ~ 0.05. ORM scores are O(1) (|v| <= 2 here): 3 u 2 ~ 0.012.
# Measured on this machine: 0.0043 (log-probs) and 0.0019 (scores). The tests also require a nonzero
# difference, so the bf16 path is really taken.
LOGP_TOL, SCORE_TOL = 0.05, 0.012


def test_bf16_reference_log_probs_are_close_to_fp32(tmp_path):
    samples = fixed_samples()
    roles = {}
    for dtype in ("float32", "bfloat16"):
        c = parse_ppo_config([config(tmp_path, ref={"dtype": dtype})])
        roles[dtype] = build_ref(c, Place(), PPOContext.load(c))
    assert next(roles["bfloat16"].model.parameters()).dtype == torch.bfloat16
    assert next(roles["float32"].model.parameters()).dtype == torch.float32
    lp32, lp16 = (roles[d].log_probs(samples) for d in ("float32", "bfloat16"))
    mask = samples.response_mask().bool()
    diff = (lp32 - lp16)[mask].abs().max().item()
    assert 0 < diff <= LOGP_TOL, diff


def test_bf16_reward_scores_are_close_to_fp32(tmp_path):
    samples = fixed_samples()
    reward = ORM_REWARD
    scores = {}
    for dtype in ("float32", "bfloat16"):
        c = parse_ppo_config([config(tmp_path, reward={**reward, "dtype": dtype})])
        role = build_reward(c, Place(), PPOContext.load(c))
        assert isinstance(role, ORMReward) and next(role.model.parameters()).dtype == getattr(torch, dtype)
        scores[dtype] = role.score(samples).scores
    diff = (scores["float32"] - scores["bfloat16"]).abs().max().item()
    assert 0 < diff <= SCORE_TOL, diff


def test_frozen_dtype_defaults_to_the_trained_models(tmp_path):
    c = parse_ppo_config([config(tmp_path)])
    assert c.ref.dtype is None and c.reward.dtype is None and not c.ref.offload and not c.training.adam_offload
    assert next(build_ref(c, Place(), PPOContext.load(c)).model.parameters()).dtype == torch.float32


# --- offload when idle --------------------------------------------------------------------------------
class SpiedModel(torch.nn.Module):
    """Records ``to`` calls without moving (the moves a CUDA run would make, observable on a CPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(2, 2)
        self.moves: list[str] = []

    def to(self, device):
        self.moves.append(str(device))
        return self


class Scorer:
    def __init__(self, model) -> None:
        self.model = model

    def score(self, fail=False):
        self.model.moves.append("forward")
        if fail:
            raise RuntimeError("boom")
        return 1.0


def test_offload_when_idle_moves_the_model_around_each_call():
    model = SpiedModel()
    role = offload_when_idle(Scorer(model), model, "cuda:0", ("score",))
    assert model.moves == ["cpu"] and role.offloaded  # idle from the start
    assert role.score() == 1.0
    assert model.moves == ["cpu", "cuda:0", "forward", "cpu"] and role.offloaded
    with pytest.raises(RuntimeError):
        role.score(fail=True)
    assert model.moves[-3:] == ["cuda:0", "forward", "cpu"] and role.offloaded  # back on the host after an error
    assert role.offload_moves == [2, 2]


def test_offload_on_cpu_is_the_identity_and_says_so(tmp_path, caplog):
    c = parse_ppo_config([config(tmp_path, ref={"offload": True})])
    with caplog.at_level(logging.INFO, logger="llm.alignment.ppo.build"):
        ref = build_ref(c, Place("cpu"), PPOContext.load(c))
    assert isinstance(ref, PolicyModel) and not hasattr(ref, "offload_moves")
    assert "ref.offload: ref runs on the CPU, nothing to offload" in caplog.text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: on the CPU there is nothing to move")
def test_offload_moves_parameters_on_cuda(tmp_path):
    samples = fixed_samples()
    reward = {**ORM_REWARD, "offload": True}
    c = parse_ppo_config([config(tmp_path, ref={"offload": True}, reward=reward, training={"adam_offload": True})])
    run = PPOContext.load(c)
    ref, rm = build_ref(c, Place("cuda"), run), build_reward(c, Place("cuda"), run)
    for role in (ref, rm):
        assert next(role.model.parameters()).device.type == "cpu"
    plain_config = parse_ppo_config([config(tmp_path)])
    plain = build_ref(plain_config, Place("cuda"), PPOContext.load(plain_config))
    assert torch.allclose(ref.log_probs(samples), plain.log_probs(samples), atol=1e-5)
    rm.score(samples)
    for role in (ref, rm):
        assert next(role.model.parameters()).device.type == "cpu" and role.offload_moves == [1, 1]
    actor = build_actor(c, Place("cuda"), PPOContext.load(c))
    assert isinstance(actor.optim, OffloadedTrainableRole)
    _loss(actor.model, 0).backward()
    actor.optim.step()
    opt = actor.optim.optimizer
    assert all(opt.state[m]["exp_avg"].device.type == "cpu" for m in opt.masters)
    assert next(actor.model.parameters()).device.type == "cuda"


# --- validation ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "sections, message",
    [
        ({"ref": {"dtype": "float16"}}, "ref.dtype must be float32, bfloat16 or null"),
        ({"reward": {"dtype": "bfloat16"}}, "reward.dtype applies to a reward model"),
        ({"reward": {"offload": True}}, "reward.offload applies to a reward model"),
        ({"ref": {"offload": "yes"}}, "ref.offload must be true or false"),
        ({"training": {"adam_offload": 1}}, "training.adam_offload must be true or false"),
        ({"training": {"gradient_checkpointing": "on"}}, "training.gradient_checkpointing must be true or false"),
    ],
)
def test_memory_fields_are_validated(tmp_path, sections, message):
    with pytest.raises(UserError, match=message):
        parse_ppo_config([config(tmp_path, **sections)])
