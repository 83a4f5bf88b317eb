"""An on-policy update (ppo_epochs 1, one mini-batch) skips the forward that computes the old log-probs: the
update's own log-probs, detached, are the ratio's denominator (TRL's GRPO with num_iterations 1). The run must
equal the one that computes them separately: the same losses, KL statistics and weights."""

import pytest
from safetensors.torch import load_file

from llm.alignment.ppo.roles import ActorRole
from llm.run_ppo import main
from llm.settings.ppo import PPOConfig
from tests.test_ppo_run import config, history

# 4 prompts x 2 samples = one mini-batch of 8; a KL loss and a KL statistic against the reference
ON_POLICY = {
    "algorithm": {"adv_estimator": "grpo", "kl_penalty": "k3", "kl_loss_coef": 0.1, "kl_ctrl": {"kl_coef": 0.0}},
    "actor_rollout": {"num_samples_per_step": 2, "ppo_mini_batch_size": 8, "ppo_epochs": 1},
    "training": {"max_steps": 3},
}


def run(tmp_path, name, monkeypatch, on_policy: bool):
    calls = []
    real = ActorRole.log_probs

    def counted(self, *args, **kwargs):
        calls.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(ActorRole, "log_probs", counted)
    if not on_policy:
        monkeypatch.setattr(PPOConfig, "on_policy_update", property(lambda self: False))
    out = tmp_path / name
    main([config(tmp_path, training={**ON_POLICY["training"], "output_dir": str(out)}, **_rest())])
    monkeypatch.undo()
    return history(out), load_file(out / "actor" / "model.safetensors"), len(calls)


def _rest():
    return {k: v for k, v in ON_POLICY.items() if k != "training"}


def test_on_policy_update_skips_the_old_log_prob_forward_and_equals_the_full_run(tmp_path, monkeypatch):
    fast, fast_w, fast_calls = run(tmp_path, "fast", monkeypatch, on_policy=True)
    full, full_w, full_calls = run(tmp_path, "full", monkeypatch, on_policy=False)
    assert fast_calls == 0 and full_calls == 3  # one actor forward per step, skipped
    assert len(fast) == len(full) == 3
    # 1e-5: the separate forward runs in eval mode and packs the samples into other rows than the update's
    # micro-batches, so its log-probs differ from the update's by float rounding (~1e-7), compounded over 3 steps
    for a, b in zip(fast, full):
        for key in ("score", "kl", "policy_loss", "abs_policy_loss", "kl_loss", "entropy", "clipfrac"):
            assert a[key] == pytest.approx(b[key], abs=1e-5), (a["step"], key)
    assert any(h["kl"] > 0 for h in fast[1:])  # the KL statistic is filled in after the update, not left at 0
    assert all(h["clipfrac"] == 0 for h in fast)  # ratio 1 exactly
    assert max((fast_w[k] - full_w[k]).abs().max().item() for k in fast_w) <= 1e-6


@pytest.mark.parametrize(
    "change, expected",
    [
        ({}, True),
        ({"actor_rollout": {"ppo_epochs": 2}}, False),
        ({"actor_rollout": {"ppo_mini_batch_size": 4}}, False),
        ({"algorithm": {"kl_ctrl": {"kl_coef": 0.05}}}, False),  # the KL in the reward needs them first
        ({"algorithm": {"kl_penalty": "full"}}, False),
        ({"actor_rollout": {"rollout_is_cap": 2.0}}, False),
    ],
)
def test_which_runs_are_on_policy(tmp_path, change, expected):
    from llm.settings.load import parse_ppo_config

    sections = {k: dict(v) for k, v in _rest().items()}
    for sec, values in change.items():
        if sec == "algorithm" and "kl_ctrl" in values:
            sections["algorithm"] = {**sections["algorithm"], "kl_ctrl": values["kl_ctrl"]}
        else:
            sections[sec] = {**sections.get(sec, {}), **values}
    assert parse_ppo_config([config(tmp_path, **sections)]).on_policy_update is expected
