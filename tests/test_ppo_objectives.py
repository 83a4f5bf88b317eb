"""The policy objectives and loss aggregations of llm/alignment/ppo/objectives.py, by hand: values, the sign of
the gradient, micro-batches adding up to one big batch, Dr. GRPO's advantage, the config checks; and equality
with TRL's current GRPOTrainer loss for every loss_type both have (test_trl_grpo_loss_parity)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from llm.alignment.ppo.algorithm import group_advantages
from llm.alignment.ppo.objectives import Clip, Counts, aggregate, policy_loss
from llm.settings.registry import LOSS_AGG_MODES, POLICY_LOSSES
from llm.utils.errors import UserError
from tests.helpers import ROOT

LN = math.log
CLIP = Clip(0.2, 0.28, 3.0)


def per_token(name, logp, old, adv, mask=None):
    mask = torch.ones_like(logp) if mask is None else mask
    return POLICY_LOSSES[name](logp, old, adv, mask, CLIP)


def test_every_objective_and_mode_is_registered():
    assert set(POLICY_LOSSES) == {"vanilla", "dual_clip", "gspo", "cispo"}
    assert set(LOSS_AGG_MODES) == {"token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"}


def test_vanilla_hand_values():
    # r = 1.5, A = +1: -1.5 vs -1.28 -> -1.28 (clipped); r = 0.5, A = -1: 0.5 vs 0.8 -> 0.8 (clipped); r = 1, A = 2: -2
    logp = torch.tensor([[LN(1.5), LN(0.5), 0.0]])
    out = per_token("vanilla", logp, torch.zeros(1, 3), torch.tensor([[1.0, -1.0, 2.0]]))
    assert out.per_token.tolist()[0] == pytest.approx([-1.28, 0.8, -2.0])
    assert out.clipped.tolist() == [[1.0, 1.0, 0.0]]


def test_dual_clip_bounds_a_negative_advantages_loss():
    # A = -1, r = 5: vanilla max(5, 1.28) = 5, bounded by c |A| = 3; r = 0.5: 0.8 < 3 stays; A = +1, r = 5: -1.28
    logp = torch.tensor([[LN(5.0), LN(0.5), LN(5.0)]])
    adv = torch.tensor([[-1.0, -1.0, 1.0]])
    out = per_token("dual_clip", logp, torch.zeros(1, 3), adv)
    assert out.per_token.tolist()[0] == pytest.approx([3.0, 0.8, -1.28])
    assert per_token("vanilla", logp, torch.zeros(1, 3), adv).per_token[0, 0].item() == pytest.approx(5.0)
    # the bounded token has no gradient (a constant), the others keep vanilla's
    logp.requires_grad_(True)
    per_token("dual_clip", logp, torch.zeros(1, 3), adv).per_token.sum().backward()
    assert logp.grad[0, 0].item() == 0.0


def test_gspo_uses_one_geometric_mean_ratio_per_response():
    # log ratios ln 2 and 0 -> s = exp(ln 2 / 2) = sqrt 2 at both tokens; A = -1: max(sqrt 2, 1.28) = sqrt 2
    logp = torch.tensor([[LN(2.0), 0.0]], requires_grad=True)
    out = per_token("gspo", logp, torch.zeros(1, 2), torch.tensor([[-1.0, -1.0]]))
    assert out.per_token.tolist()[0] == pytest.approx([math.sqrt(2), math.sqrt(2)])
    # seq-mean-token-mean: loss = sqrt 2; d loss / d logp_t = -A s / |y| = sqrt 2 / 2 at each token (both, though
    # only the first token's ratio moved): the sequence's ratio, not the token's, decides
    loss = aggregate("seq-mean-token-mean", out.per_token, torch.ones(1, 2), Counts(2.0, 1), 2)
    loss.backward()
    assert loss.item() == pytest.approx(math.sqrt(2))
    assert logp.grad.tolist()[0] == pytest.approx([math.sqrt(2) / 2] * 2)
    # A = +1: s = sqrt 2 > 1.28 is clipped at both tokens
    assert per_token("gspo", logp.detach(), torch.zeros(1, 2), torch.ones(1, 2)).clipped.tolist() == [[1.0, 1.0]]


def test_cispo_keeps_the_gradient_of_clipped_tokens():
    # r = 1.5, A = +1: weight sg(clip(1.5, 0.8, 1.28)) = 1.28, loss -1.28 log p; gradient -1.28 (vanilla's: 0)
    logp = torch.tensor([[LN(1.5)]], requires_grad=True)
    out = per_token("cispo", logp, torch.zeros(1, 1), torch.ones(1, 1))
    out.per_token.sum().backward()
    assert out.per_token.item() == pytest.approx(-1.28 * LN(1.5))
    assert logp.grad.item() == pytest.approx(-1.28) and out.clipped.item() == 1.0
    plain = torch.tensor([[LN(1.5)]], requires_grad=True)
    per_token("vanilla", plain, torch.zeros(1, 1), torch.ones(1, 1)).per_token.sum().backward()
    assert plain.grad.item() == 0.0


@pytest.mark.parametrize("name", ["vanilla", "dual_clip", "gspo", "cispo"])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_gradient_raises_the_log_prob_of_a_positive_advantage(name, sign):
    """Unclipped (ratio near 1): gradient descent moves log p up for A > 0 and down for A < 0."""
    logp = torch.tensor([[0.01, -0.01]], requires_grad=True)
    out = per_token(name, logp, torch.zeros(1, 2), torch.full((1, 2), sign))
    aggregate("token-mean", out.per_token, torch.ones(1, 2), Counts(2.0, 1), 2).backward()
    assert (logp.grad * sign < 0).all(), logp.grad


def test_aggregation_hand_values():
    # tokens [1, 2, 3] and [4]: token-mean 10 / 4; seq-mean-token-mean (2 + 4) / 2; seq-mean-token-sum 10 / 2;
    # seq-mean-token-sum-norm 10 / (2 x 5)
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    counts = Counts(mask.sum(), 2)
    expected = {
        "token-mean": 2.5,
        "seq-mean-token-mean": 3.0,
        "seq-mean-token-sum": 5.0,
        "seq-mean-token-sum-norm": 1.0,
    }
    for mode, value in expected.items():
        assert aggregate(mode, loss, mask, counts, 5).item() == pytest.approx(value), mode


@pytest.mark.parametrize(
    "mode", sorted(["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
)
@pytest.mark.parametrize("name", ["vanilla", "gspo", "cispo", "dual_clip"])
def test_micro_batches_with_global_counts_add_up_to_one_big_batch(mode, name):
    gen = torch.Generator().manual_seed(0)
    logp = (torch.randn(6, 5, generator=gen) * 0.3).requires_grad_(True)
    old, adv = torch.randn(6, 5, generator=gen) * 0.3, torch.randn(6, 5, generator=gen)
    mask = (torch.rand(6, 5, generator=gen) > 0.3).float()
    mask[:, 0] = 1
    whole = policy_loss(logp, old, adv, mask, 0.2, 0.28, objective=name, agg_mode=mode, max_length=5)
    (grad_whole,) = torch.autograd.grad(whole.loss, logp)
    total, parts = 0.0, [[0, 1], [2], [3, 4, 5]]
    for part in parts:
        out = policy_loss(
            logp[part], old[part], adv[part], mask[part], 0.2, 0.28,
            normaliser=mask.sum(), objective=name, agg_mode=mode, sequences=6, max_length=5,
        )  # fmt: skip
        total = total + out.loss
    (grad_parts,) = torch.autograd.grad(total, logp)
    assert total.item() == pytest.approx(whole.loss.item(), abs=1e-6)
    assert torch.allclose(grad_parts, grad_whole, atol=1e-6)


def test_dr_grpo_advantage_is_not_divided_by_the_std():
    scores = torch.tensor([1.0, 0.0, 3.0, 1.0])
    assert group_advantages(scores, 2, "grpo", norm_by_std=False).tolist() == [0.5, -0.5, 1.0, -1.0]
    # grpo: (r - mean) / (unbiased std + eps): std of [1, 0] is 1/sqrt 2, of [3, 1] sqrt 2
    scaled = group_advantages(scores, 2, "grpo", eps=0.0)
    assert scaled.tolist() == pytest.approx(
        [0.5 * math.sqrt(2), -0.5 * math.sqrt(2), 1 / math.sqrt(2), -1 / math.sqrt(2)]
    )


def test_config_refuses_unknown_objectives_and_a_small_dual_clip_bound(tmp_path):
    from llm.settings.load import parse_ppo_config
    from tests.test_ppo_run import config

    path = config(tmp_path)
    with pytest.raises(
        UserError, match=r"actor_rollout.policy_loss must be one of vanilla, .*got 'gpso' \(closest: 'gspo'"
    ):
        parse_ppo_config([path, "--actor_rollout.policy_loss", "gpso"])
    with pytest.raises(UserError, match=r"actor_rollout.loss_agg_mode must be one of .*closest: 'seq-mean-token-mean'"):
        parse_ppo_config([path, "--actor_rollout.loss_agg_mode", "seq-mean-token-men"])
    with pytest.raises(UserError, match="clip_ratio_c must be > 1 with policy_loss dual_clip"):
        parse_ppo_config([path, "--actor_rollout.policy_loss", "dual_clip", "--actor_rollout.clip_ratio_c", "0.9"])
    c = parse_ppo_config(
        [path, "--actor_rollout.policy_loss", "gspo", "--actor_rollout.loss_agg_mode", "seq-mean-token-mean"]
    )
    assert (c.actor_rollout.policy_loss, c.actor_rollout.loss_agg_mode) == ("gspo", "seq-mean-token-mean")


@pytest.mark.parametrize(
    "mode, truncated, expected",
    [
        ("token-mean", False, -0.8),  # (-2 x 3 + 1 x 2) / 5 tokens
        ("seq-mean-token-mean", False, -0.5),  # (-2 + 1) / 2 responses
        ("seq-mean-token-sum", False, -2.0),  # (-6 + 2) / 2
        ("seq-mean-token-sum-norm", False, -0.5),  # (-6 + 2) / (2 x max_response_length 4)
        ("token-mean", True, -2.0),  # the second response has no EOS: left out, -6 / 3
    ],
)
def test_actor_update_aggregates_over_the_mini_batch(mode, truncated, expected):
    """One on-policy mini-batch of two samples (3 and 2 response tokens) in micro-batches of one (so each micro-batch
    divides by the mini-batch's counts): advantages +2 on the first sample's tokens, -1 on the second's; ratio 1,
    so the per-token losses are -2 (x3) and +1 (x2)."""
    from llm.alignment.ppo.interfaces import PolicyBatch, Samples
    from llm.alignment.ppo.optim import TrainableRole
    from llm.alignment.ppo.roles import ActorRole
    from llm.alignment.ppo.update import PolicyUpdate
    from tests.helpers import tiny_model, tokenizer

    tok, model = tokenizer(), tiny_model(seed=3)
    samples = Samples(
        prompt_ids=[[1, 40, 41], [1, 42]],
        response_ids=[[50, 51, 2], [52, 53]],
        prompts=["a", "b"],
        responses=["x", "y"],
        references=[None, None],
        ended=torch.tensor([True, not truncated]),
    )
    optim = TrainableRole(model, 0.0, 0.0, (0.9, 0.999), 1e-8, 1.0, 0)  # lr 0: the weights stay, ratio stays 1
    settings = PolicyUpdate(2, 0.2, 0.2, loss_agg_mode=mode, max_length=4, mask_truncated=truncated)
    role = ActorRole(model, tok, 1.0, 1, optim, settings)
    mask = samples.response_mask()
    advantages = torch.tensor([[2.0, 2.0, 2.0], [-1.0, -1.0, 0.0]]) * mask
    stats = role.update(PolicyBatch(samples, mask, role.log_probs(samples), advantages, None), [[0, 1]])
    assert stats.metrics["policy_loss"] == pytest.approx(expected, abs=1e-5)


# --- TRL's current GRPOTrainer loss -----------------------------------------------------------------------------
# TRL's loss_type (with importance_sampling_level) -> ours (policy_loss, loss_agg_mode); cispo: TRL clamps the ratio
# at epsilon_high itself, ours at 1 + clip_ratio_high, with no lower bound when clip_ratio_low >= 1
TRL_EQUIVALENTS = {
    ("grpo", "token"): ("vanilla", "seq-mean-token-mean"),
    ("bnpo", "token"): ("vanilla", "token-mean"),
    ("dapo", "token"): ("vanilla", "token-mean"),
    ("dr_grpo", "token"): ("vanilla", "seq-mean-token-sum-norm"),
    ("grpo", "sequence"): ("gspo", "seq-mean-token-mean"),
    ("dapo", "sequence"): ("gspo", "token-mean"),
    ("cispo", "token"): ("cispo", "token-mean"),
}
TRL_SCRIPT = os.path.join(ROOT, "tests", "trl_grpo_loss.py")


def trl_current() -> str | None:
    """A directory holding TRL's current release (``scripts/setup.sh`` installs it into .trl-current, apart from
    the TRL 1.12 that the PPO / PRM parity tests use), or TRL_CURRENT_PATH."""
    path = os.environ.get("TRL_CURRENT_PATH") or os.path.join(ROOT, ".trl-current")
    return path if os.path.isdir(os.path.join(path, "trl")) else None


def test_trl_grpo_loss_parity(tmp_path):
    """Same log-probs, old log-probs, advantages and masks into TRL's ``GRPOTrainer._compute_loss`` (run in a
    subprocess that imports TRL's current release) and into ours: loss and gradient within 1e-6 for every pair."""
    path = trl_current()
    if path is None:
        if os.environ.get("CI") or os.environ.get("REQUIRE_TRL_CURRENT"):
            pytest.fail("TRL's current release is not installed in .trl-current: run bash scripts/setup.sh")
        pytest.skip("TRL's current release is not installed in .trl-current (bash scripts/setup.sh installs it)")
    gen = torch.Generator().manual_seed(1)
    B, T, max_len = 6, 7, 9
    inputs = {
        "logps": (torch.randn(B, T, generator=gen) * 0.2 - 1.0).double(),
        "old": (torch.randn(B, T, generator=gen) * 0.2 - 1.0).double(),
        "advantages": torch.randn(B, generator=gen).double(),
        "mask": (torch.rand(B, T, generator=gen) > 0.25).long(),
    }
    inputs["mask"][:, 0] = 1
    torch.save(inputs, tmp_path / "inputs.pt")
    cases = [
        {
            "loss_type": t,
            "level": level,
            "eps_low": 0.2,
            "eps_high": (1 + 0.28) if t == "cispo" else 0.28,
            "max_len": max_len,
        }
        for t, level in TRL_EQUIVALENTS
    ]
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([path, ROOT]), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(  # noqa: PLW1510 - the return code is asserted below, with its stderr
        [sys.executable, TRL_SCRIPT, str(tmp_path)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = torch.load(tmp_path / "trl_out.pt")
    assert theirs["version"].split(".")[0] == "1" and theirs["version"] >= "1.16"
    mask = inputs["mask"].double()
    for case, (loss_t, grad_t) in zip(cases, theirs["results"]):
        objective, mode = TRL_EQUIVALENTS[case["loss_type"], case["level"]]
        logp = inputs["logps"].clone().requires_grad_(True)
        adv = inputs["advantages"][:, None].expand(B, T)
        low = 1.0 if objective == "cispo" else 0.2
        ours = policy_loss(
            logp, inputs["old"], adv, mask, low, 0.28, objective=objective, agg_mode=mode, max_length=max_len
        )
        (grad,) = torch.autograd.grad(ours.loss, logp)
        name = f"{case['loss_type']}/{case['level']}"
        assert abs(ours.loss.item() - loss_t.item()) <= 1e-6, name
        assert torch.allclose(grad * mask, grad_t * mask, atol=1e-6, rtol=0), name


def test_mindspeed_layout_takes_the_objectives_under_verls_names(tmp_path):
    """A MindSpeed-layout file gives the actor's objective settings under verl's names (the names MindSpeed's Ray
    PPO came with) and the reward's overlong buffer; the algorithm section's names are ours (verl's too)."""
    from llm.settings.load import parse_ppo_config
    from tests.test_ppo_config import edited

    def edit(data):
        actor = data["actor_rollout_ref"]["actor_rollout"]
        actor.update(policy_loss="dual_clip", clip_ratio_c=2.5, loss_agg_mode="seq-mean-token-mean")
        actor.update(clip_ratio_low=0.2, clip_ratio_high=0.28, n_samples_per_prompt=2)
        data["reward"].update(overlong_buffer_len=4, overlong_penalty_factor=0.5)
        data.setdefault("algorithm", {}).update(adv_estimator="grpo", norm_adv_by_std_in_grpo=False)

    c = parse_ppo_config([edited(tmp_path, edit)])
    a = c.actor_rollout
    assert (a.policy_loss, a.clip_ratio_c, a.loss_agg_mode) == ("dual_clip", 2.5, "seq-mean-token-mean")
    assert (c.clip_low, c.clip_high) == (0.2, 0.28)
    assert (c.reward.overlong_buffer_len, c.reward.overlong_penalty_factor) == (4, 0.5)
    assert c.algorithm.norm_adv_by_std_in_grpo is False
