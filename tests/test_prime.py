"""PRIME (the ``prime`` section: llm/alignment/ppo/prime.py, algorithm.prime_advantages): the advantages by hand,
the online update's direction, update before vs after, checkpoint / resume exactness of the PRM and its optimizer,
the tiny config as shipped, and bad input (one message naming the field, exit 2)."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from llm.alignment.ppo.algorithm import leave_one_out, prime_advantages
from llm.alignment.ppo.interfaces import Samples
from llm.alignment.ppo.optim import TrainableRole
from llm.alignment.ppo.prime import PrimePRM
from llm.alignment.ppo.roles import PolicyModel
from llm.alignment.rm.implicit import read_implicit_prm
from llm.run_ppo import main
from llm.settings.load import parse_ppo_config
from llm.settings.prime import PrimeSection
from llm.utils.checkpoints import read_safetensors
from llm.utils.errors import UserError
from tests.helpers import ROOT, ppo_config_file, tiny_model, tokenizer

SHIPPED = os.path.join(ROOT, "llm", "config", "tiny", "grpo_prime_argument.json")
SMALL = {  # 4 prompts x 4 samples, short responses
    "actor_rollout": {"max_response_length": 8, "ppo_mini_batch_size": 16},
    "data": {"rollout_batch_size": 4},
    "prime": {"mini_batch_size": 8},
}


# --- the advantages by hand --------------------------------------------------------------------------------
def test_prime_advantages_by_hand():
    """One group of 3 (lengths 2, 3, 1; outcomes 1, 0, 0) and one of 3 that gives nothing (equal outcomes, zero
    process rewards), outcome_coef 2, process_coef 1.

    Outcome, leave-one-out: 1 - 0 = 1, 0 - 1/2 = -1/2, 0 - 1/2 = -1/2, at each last token.
    Process: the samples' means m = 0.3, 0.2, 0.9 (sum 1.4); each token r -> (3 r - 1.4) / 2:
      sample 0: 0.2, 0.4 -> -0.4, -0.1; sample 1: 0.3, -0.3, 0.6 -> -0.25, -1.15, 0.2; sample 2: 0.9 -> 0.65.
    Token rewards (process + 2 x outcome): [-0.4, 1.9], [-0.25, -1.15, -0.8], [-0.35]; returns, summed from the end:
      [1.5, 1.9], [-2.2, -1.95, -0.8], [-0.35].
    """
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1], [1, 1, 1], [1, 1, 1]], dtype=torch.float32)
    process = torch.tensor([[0.2, 0.4, 0.0], [0.3, -0.3, 0.6], [0.9, 0.0, 0.0]] + [[0.0] * 3] * 3)
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    got = prime_advantages(scores, process, mask, 3, outcome_coef=2.0, process_coef=1.0)
    expected = torch.tensor([[1.5, 1.9, 0.0], [-2.2, -1.95, -0.8], [-0.35, 0.0, 0.0], [0.0] * 3, [0.0] * 3, [0.0] * 3])
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
    # the coefficients weight each part alone
    only_outcome = prime_advantages(scores, process, mask, 3, outcome_coef=1.0, process_coef=0.0)
    torch.testing.assert_close(only_outcome[:3], torch.tensor([[1.0, 1.0, 0.0], [-0.5] * 3, [-0.5, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="num_samples_per_step >= 2"):
        leave_one_out(process, mask, 1)


# --- the implicit PRM's online update --------------------------------------------------------------------------
def prm(update: str, lr: float = 1e-2, seed: int = 0) -> PrimePRM:
    """A tiny PRM and its reference, the same initial weights (PRIME's default: both the SFT model)."""
    tok = tokenizer()
    model = tiny_model(seed=seed)
    reference = PolicyModel(copy.deepcopy(model).eval().requires_grad_(False), tok, 1.0, 8)
    optim = TrainableRole(model, lr, 0.0, (0.9, 0.999), 1e-8, 1.0, 0)
    settings = PrimeSection(update=update, beta=0.5, norm="none")
    return PrimePRM(model, tok, 8, optim, reference, settings, "unused")


def rollouts() -> Samples:
    tok = tokenizer()
    texts = ["1 + 2 = 3", "so 3", "it is 4", "4"]
    ids = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in texts]
    prompt = tok("Q: 1+2?\n")["input_ids"]
    return Samples([prompt] * 4, ids, ["Q"] * 4, texts, ["3"] * 4, torch.ones(4, dtype=bool))


def implicit_rewards(p: PrimePRM, s: Samples) -> torch.Tensor:
    return p.settings.beta * p.log_ratios(s, p.reference.log_probs(s)).sum(1)


@pytest.mark.parametrize("label", [1.0, 0.0])
def test_the_update_moves_the_implicit_reward_toward_the_outcome(label):
    p, s = prm("after"), rollouts()
    start = implicit_rewards(p, s)
    assert torch.allclose(start, torch.zeros(4), atol=1e-6)  # the PRM starts as its reference: r = 0
    assert p.step(s, torch.full((4,), label), [list(range(4))])[1]["prime/accuracy"] == 0.0  # r = 0: no sign yet
    for _ in range(2):
        p.step(s, torch.full((4,), label), [list(range(4))])
    after = implicit_rewards(p, s)
    assert bool((after > 0.05).all()) if label else bool((after < -0.05).all()), after


def test_update_before_scores_with_the_updated_prm_and_after_with_the_old_one():
    s, outcomes, order = rollouts(), torch.tensor([1.0, 1.0, 0.0, 0.0]), [[0, 1, 2, 3]]
    results = {}
    for update in ("before", "after", "none"):
        p = prm(update)
        p.step(s, outcomes, order)  # one step first, so the PRM differs from its reference
        old = p.settings.beta * p.log_ratios(s, p.reference.log_probs(s))
        process, metrics = p.step(s, outcomes, order)
        new = p.settings.beta * p.log_ratios(s, p.reference.log_probs(s))
        results[update] = (process, old, new, metrics)
    process, old, new, metrics = results["before"]
    torch.testing.assert_close(process, new)
    assert not torch.allclose(process, old, atol=1e-4)
    assert not torch.allclose(old, new, atol=1e-4) and "prime/loss" in metrics
    process, old, new, metrics = results["after"]
    torch.testing.assert_close(process, old)
    assert not torch.allclose(process, new, atol=1e-4)
    process, old, new, metrics = results["none"]  # a frozen PRM: r = 0 at every step, no loss
    torch.testing.assert_close(process, torch.zeros_like(process))
    assert "prime/loss" not in metrics
    # the same first step in "before" and "after": the same PRM before the second
    torch.testing.assert_close(results["before"][1], results["after"][1])
    # the accuracy is read before the update: after one step on these labels, the correct ones score > 0
    assert results["after"][3]["prime/accuracy"] == 1.0


def test_whole_granularity_and_batch_norm():
    """``whole``: each response's summed reward at its last token; ``batch_norm``: the largest |return| becomes 1."""
    s, outcomes, order = rollouts(), torch.tensor([1.0, 1.0, 0.0, 0.0]), [[0, 1, 2, 3]]
    token, whole = prm("after"), prm("after")
    whole.settings = PrimeSection(update="after", beta=0.5, norm="none", granularity="whole")
    token.step(s, outcomes, order)
    whole.step(s, outcomes, order)
    per_token, _ = token.step(s, outcomes, order)
    summed, _ = whole.step(s, outcomes, order)
    lengths = [len(r) for r in s.response_ids]
    for i, n in enumerate(lengths):
        assert summed[i, n - 1].item() == pytest.approx(per_token[i].sum().item(), abs=1e-6)
        assert not summed[i, : n - 1].any()
    token.settings = PrimeSection(update="none", beta=0.5, norm="batch_norm")
    raw = 0.5 * token.log_ratios(s, token.reference.log_probs(s))  # the PRM now, which a frozen step reads
    normed, _ = token.step(s, outcomes, order)
    assert normed.flip(-1).cumsum(-1).flip(-1).abs().max().item() == pytest.approx(1.0, abs=1e-4)
    largest = raw.flip(-1).cumsum(-1).flip(-1).abs().max()
    torch.testing.assert_close(normed, raw / (largest + 1e-6), atol=1e-6, rtol=0)


def test_outcomes_outside_0_1_are_refused():
    with pytest.raises(UserError, match=r"prime: the verifier .* answered .*\[0, 1\]"):
        prm("after").step(rollouts(), torch.tensor([1.0, 2.0, 0.0, 0.0]), [[0, 1, 2, 3]])


# --- runs: the shipped config, resume -------------------------------------------------------------------------
def test_the_shipped_config_runs_and_saves_an_implicit_prm(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    c = parse_ppo_config([SHIPPED])
    assert c.prime is not None and c.prime.update == "before" and c.algorithm.adv_estimator == "rloo"
    out = tmp_path / "out"
    main([SHIPPED, "--training.max_steps", "2", "--training.output_dir", str(out), "--training.report_to", "none",
          "--training.save_steps", "0", "--training.disable_tqdm", "true"])  # fmt: skip
    with open(out / "log_history.json", encoding="utf-8") as f:
        logs = json.load(f)
    assert len(logs) == 2
    for m in logs:
        assert 0 <= m["prime/accuracy"] <= 1 and m["prime/loss"] > 0 and torch.isfinite(torch.tensor(m["policy_loss"]))
        assert "prime/implicit_reward" in m and "prime/process_reward" in m
    beta, reference = read_implicit_prm(str(out / "prime"), "prime")  # a reward.type implicit_prm model
    assert beta == 0.05 and os.path.isfile(os.path.join(reference, "model.safetensors"))


def untuple(obj: dict):
    """A tuple as saved (``betas``: a tuple when the optimizer was made, a list after a state was loaded into it)."""
    return obj["__tuple__"] if set(obj) == {"__tuple__"} else obj


def test_resume_gives_the_prm_and_its_optimizer_of_an_uninterrupted_run(tmp_path):
    full = tmp_path / "full"
    first = {"training": {"max_steps": 4, "save_steps": 2, "save_total_limit": None, "output_dir": str(full)}}
    main([ppo_config_file(tmp_path, SHIPPED, "prime", SMALL, first)])
    resumed = tmp_path / "resumed"
    shutil.copytree(full / "checkpoint-2", resumed / "checkpoint-2")
    again = {"training": {**first["training"], "output_dir": str(resumed), "resume_from_checkpoint": "auto"}}
    main([ppo_config_file(tmp_path, SHIPPED, "prime", SMALL, again)])
    for name in ("model.safetensors", "optimizer.safetensors"):
        a = read_safetensors(str(full / "checkpoint-4" / "prime" / name))
        b = read_safetensors(str(resumed / "checkpoint-4" / "prime" / name))
        assert sorted(a) == sorted(b) and len(a) > 0
        for key in a:
            assert torch.equal(a[key], b[key]), (name, key)
    with open(full / "checkpoint-4" / "prime" / "optimizer.json", encoding="utf-8") as f:
        a = json.load(f, object_hook=untuple)
    with open(resumed / "checkpoint-4" / "prime" / "optimizer.json", encoding="utf-8") as f:
        assert json.load(f, object_hook=untuple) == a  # the step counts, the LR schedule, the hyper-parameters
    assert not torch.equal(  # and the PRM did train
        read_safetensors(str(full / "checkpoint-2" / "prime" / "model.safetensors"))["model.norm.weight"],
        read_safetensors(str(full / "checkpoint-4" / "prime" / "model.safetensors"))["model.norm.weight"],
    )


# --- bad input -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "layer, message",
    [
        ({"prime": {"outcome_coef": "five"}}, r"prime\.outcome_coef must be a number"),
        ({"prime": {"process_coef": -1.0}}, r"prime\.process_coef"),
        ({"prime": {"update": "sometimes"}}, r"prime\.update must be one of before, after, none"),
        ({"prime": {"granularity": "step"}}, r"prime\.granularity must be one of token, whole"),
        ({"prime": {"beta": 0.0}}, r"prime\.beta must be > 0"),
        ({"prime": {"outcome_coef": 0.0, "process_coef": 0.0}}, r"prime\.outcome_coef and prime\.process_coef"),
        ({"prime": {"mini_batch_size": 5}}, r"prime\.mini_batch_size=5 must divide"),
        ({"prime": {"adam_beta2": 1.0}}, r"adam_beta2 of prime must be in \[0, 1\)"),
        ({"algorithm": {"adv_estimator": "grpo"}}, r"algorithm\.adv_estimator 'grpo' with a prime section"),
        ({"algorithm": {"use_kl_in_reward": True}}, r"algorithm\.use_kl_in_reward with a prime section"),
        ({"resource_pool": {"use_ray": True}}, r"prime with resource_pool\.use_ray"),
        ({"prime": {"bogus": 1}}, r"prime: unknown key 'bogus'"),
    ],
)
def test_bad_prime_settings_are_refused_naming_the_field(tmp_path, layer, message):
    with pytest.raises(UserError, match=message):
        parse_ppo_config([ppo_config_file(tmp_path, SHIPPED, "prime", layer)])


def test_prime_without_an_outcome_verifier_exits_2_naming_the_reward(tmp_path):
    orm = {"type": "orm", "model_name_or_path": os.path.join(ROOT, "llm", "assets", "tiny-llama")}
    path = ppo_config_file(tmp_path, SHIPPED, "prime")
    with open(path, encoding="utf-8") as f:
        raw = json.load(f)
    raw["reward"] = orm  # the whole section replaced: an ORM, no verifier
    with open(path, "w", encoding="utf-8") as f:
        json.dump(raw, f)
    run = subprocess.run([sys.executable, os.path.join(ROOT, "llm", "run_ppo.py"), path, "--prime.update", "after"],
                         check=False, capture_output=True, text=True, cwd=ROOT)  # fmt: skip
    assert run.returncode == 2, run.stderr[-2000:]
    assert "reward.type 'orm' with a prime section" in run.stderr and "Traceback" not in run.stderr
