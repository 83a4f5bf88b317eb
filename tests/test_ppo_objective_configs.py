"""Each RL objective family has a tiny config in llm/config/tiny (its file name names the family), and each runs:
two short steps through llm/run_ppo.py, with finite losses and the family's settings in effect."""

from __future__ import annotations

import glob
import math
import os

import pytest

from llm.run_ppo import main
from llm.settings.load import parse_ppo_config
from tests.helpers import ROOT
from tests.test_ppo_run import history

FAMILIES = {  # the family -> what its config must select
    "dapo": lambda c: c.algorithm.filter_groups and c.reward.overlong_buffer_len > 0 and c.clip_high > c.clip_low,
    "dr_grpo": lambda c: (
        c.actor_rollout.loss_agg_mode == "seq-mean-token-sum-norm" and not c.algorithm.norm_adv_by_std_in_grpo
    ),
    "gspo": lambda c: c.actor_rollout.policy_loss == "gspo" and c.actor_rollout.loss_agg_mode == "seq-mean-token-mean",
    "cispo": lambda c: c.actor_rollout.policy_loss == "cispo",
    "dual_clip": lambda c: c.actor_rollout.policy_loss == "dual_clip" and c.actor_rollout.clip_ratio_c > 1,
}


def family_config(family: str) -> str:
    (path,) = glob.glob(os.path.join(ROOT, "llm", "config", "tiny", f"*{family}*_argument.json"))
    return path


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_config_selects_its_objective_and_runs(family, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    path = family_config(family)
    c = parse_ppo_config([path])
    assert FAMILIES[family](c), family
    samples = 4 * c.actor_rollout.num_samples_per_step
    out = tmp_path / "out"
    small = ["--training.max_steps", "2", "--training.save_steps", "0", "--training.output_dir", str(out)]
    small += [
        "--training.report_to",
        "none",
        "--data.rollout_batch_size",
        "4",
        "--actor_rollout.max_response_length",
        "8",
    ]
    small += ["--actor_rollout.ppo_mini_batch_size", str(samples // 2)]
    if c.uses_critic:
        small += ["--critic.critic_mini_batch_size", str(samples // 2)]
    main([path, *small])
    steps = [h for h in history(out) if "policy_loss" in h]
    assert len(steps) == 2
    for h in steps:
        assert math.isfinite(h["policy_loss"]) and math.isfinite(h["abs_policy_loss"]), h
