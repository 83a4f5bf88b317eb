"""The reference model only where a KL term reads it (``algorithm.uses_reference``): without one it is neither
built nor run, and the run is the same, number for number, as one that builds and runs it."""

import os

import pytest
import torch

from llm.alignment.ppo.build import ppo_trainer, role_names
from llm.settings.load import parse_ppo_config
from llm.settings.ppo import AlgorithmSection
from tests.helpers import ROOT, ppo_config_file

TINY = os.path.join(ROOT, "llm", "config", "tiny")
GRPO = os.path.join(TINY, "grpo_dr_grpo_argument.json")  # no KL term as shipped
PPO = os.path.join(TINY, "ppo_argument.json")  # the KL in the reward, adaptive by default
SMALL = {
    "training": {"max_steps": 2, "micro_batch_size": 8},
    "data": {"rollout_batch_size": 4},
    "actor_rollout": {"ppo_mini_batch_size": 8},
    "critic": {"critic_mini_batch_size": 8},
}


def config(tmp_path, source, *layers):
    return parse_ppo_config([ppo_config_file(tmp_path, source, "ref", SMALL, *layers)])


@pytest.mark.parametrize(
    "source, algorithm, needed",
    [
        (GRPO, {}, False),
        (GRPO, {"kl_loss_coef": 0.01}, True),  # the KL as a loss term
        (PPO, {"kl_ctrl": {"type": "fixed", "kl_coef": 0.05}}, True),  # the KL in the reward
        (PPO, {"kl_ctrl": {"type": "fixed", "kl_coef": 0.0}}, False),  # fixed at 0: no KL
        (PPO, {"kl_ctrl": {"type": "adaptive", "kl_coef": 0.0}}, True),  # adaptive: it may grow from 0
        (PPO, {"use_kl_in_reward": False}, False),
    ],
)
def test_the_reference_is_a_role_only_when_a_kl_term_reads_it(tmp_path, source, algorithm, needed):
    c = config(tmp_path, source, {"algorithm": algorithm})
    assert c.algorithm.uses_reference is needed
    assert ("ref" in role_names(c)) is needed


def run(c) -> tuple[list[dict], dict[str, torch.Tensor], object]:
    with ppo_trainer(c) as trainer:
        history = trainer.train()
        weights = {k: v.detach().clone() for k, v in trainer.actor.model.state_dict().items()}
        return history, weights, trainer.ref


@pytest.mark.parametrize("source", [GRPO, PPO])
def test_skipping_the_reference_changes_no_number(tmp_path, monkeypatch, source):
    """The same seeded run twice: as built (no reference: the KL term's coefficient is 0) and with the reference
    forced in (built, run every step, its KL computed and multiplied by 0). Every trained weight and every
    metric but the logged KL are equal; the logged KL is 0 without the reference and not with it."""
    layer = {"algorithm": {"kl_ctrl": {"type": "fixed", "kl_coef": 0.0}}} if source == PPO else {}
    c = config(tmp_path, source, layer)
    assert not c.algorithm.uses_reference
    skipped, skipped_weights, ref = run(c)
    assert ref is None
    monkeypatch.setattr(AlgorithmSection, "uses_reference", property(lambda self: True))
    forced, forced_weights, ref = run(config(tmp_path, source, layer))
    assert ref is not None
    assert len(skipped) == len(forced) == 2
    for a, b in zip(skipped, forced):
        assert a["kl"] == 0.0
        assert {k for k in a if not k.startswith("time")} == {k for k in b if not k.startswith("time")}
        for key in a:
            if key.startswith("time") or key == "kl" or "kl" in key.split("/")[-1]:
                continue
            assert a[key] == b[key], key  # the same arithmetic in the same order: equal, not close
    assert forced[1]["kl"] != 0.0  # the second step's actor has moved away from the reference
    for name, w in skipped_weights.items():
        torch.testing.assert_close(w, forced_weights[name], rtol=0, atol=0, msg=name)
