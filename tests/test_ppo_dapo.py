"""DAPO's overlong reward shaping and dynamic sampling (llm/alignment/ppo/dapo.py): the punishment of eq. (13) and
the group filter by hand, the refill loop end to end on a tiny GRPO run (rounds, cap, skipped update), resume with
the extra prompts counted, the validation messages, and the tiny DAPO config."""

from __future__ import annotations

import json
import logging
import os
import shutil
import zlib

import pytest
import torch

from llm.alignment.ppo.build import PPOContext, build_ppo, load_prompts, placed_roles
from llm.alignment.ppo.dapo import DAPO, informative_groups, overlong_punishment, select_scored
from llm.alignment.ppo.interfaces import Samples, Scored
from llm.alignment.ppo.prompts import prompt_stream
from llm.run_ppo import main
from llm.settings.load import parse_ppo_config
from llm.utils.errors import UserError
from tests.helpers import ROOT, read_jsonl
from tests.test_ppo_run import config, history

DAPO_TINY = os.path.join(ROOT, "llm", "config", "tiny", "grpo_dapo_argument.json")


# --- rule rewards for the runs: the module is imported by the trainer (reward.rule) -------------------------------
def half_constant(prompt: str, response: str, reference: str | None) -> float:
    """0 for every response to about half of the prompts (their groups are all equal and dropped), else a parity of
    the response text (the samples of a group differ)."""
    if zlib.crc32(prompt.encode()) % 2 == 0:
        return 0.0
    return float(zlib.crc32(response.encode()) % 2)


def constant(prompt: str, response: str, reference: str | None) -> float:
    return 1.0


GRPO = {  # 4 prompts x 4 samples per step, one mini-batch (on-policy), no KL in the reward
    "actor_rollout": {"num_samples_per_step": 4, "ppo_mini_batch_size": 16},
    "algorithm": {"adv_estimator": "grpo", "use_kl_in_reward": False, "kl_penalty": "low_var_kl"},
    "reward": {"type": "rule", "rule": "tests.test_ppo_dapo:half_constant"},
}


def dapo_config(tmp_path, **sections):
    merged = {k: dict(v) for k, v in GRPO.items()}
    for section, values in sections.items():
        merged.setdefault(section, {}).update(values)
    merged["algorithm"].setdefault("filter_groups", True)
    return config(tmp_path, **merged)


# --- overlong punishment (DAPO eq. 13) -----------------------------------------------------------------------------
def test_overlong_punishment_by_hand():
    # L_max 16, L_cache 4: no punishment up to 12 tokens, (12 - |y|) / 4 in (12, 16], -1 beyond
    got = overlong_punishment([1, 12, 13, 14, 15, 16, 17], max_length=16, buffer_len=4)
    assert got.tolist() == [0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0]
    assert (got <= 0).all()  # a punishment: never a bonus
    half = overlong_punishment(torch.tensor([12, 14, 16]), 16, 4, factor=0.5)
    assert half.tolist() == [0.0, -0.25, -0.5]
    assert overlong_punishment([16, 30], 16, 0, 2.0).tolist() == [0.0, 0.0]  # buffer 0: off
    # at L_max - L_cache exactly: 0; one token into the buffer: -1 / L_cache
    assert overlong_punishment([256, 257], 512, 256).tolist() == [0.0, -1 / 256]


def samples(lengths: list[int]) -> Samples:
    n = len(lengths)
    return Samples(
        [[1]] * n, [[5] * k for k in lengths], ["p"] * n, ["r"] * n, [None] * n, torch.zeros(n, dtype=torch.bool)
    )


def test_punish_adds_to_the_outcome_and_defaults_leave_it(tmp_path):
    c = parse_ppo_config([dapo_config(tmp_path, reward={"overlong_buffer_len": 4, "overlong_penalty_factor": 2.0})])
    assert c.actor_rollout.max_response_length == 8
    d = DAPO(c)
    scores = torch.tensor([1.0, 1.0, 0.0, 0.5])
    got = d.punish(scores, samples([3, 4, 6, 8]))  # punished from 5 tokens: -2 x (|y| - 4) / 4
    assert got.tolist() == [1.0, 1.0, -1.0, -1.5]
    m = d.metrics(Scored(samples([3, 4, 6, 8]), *[None] * 5, scores, scores, None))
    assert m == {"dapo/overlong_penalty": pytest.approx(-0.75), "dapo/overlong_frac": 0.5}
    plain = DAPO(parse_ppo_config([config(tmp_path)]))
    assert plain.punish(scores, samples([3, 4, 6, 8])) is scores and plain.metrics(None) == {}


# --- the group filter, the stream, the merge -------------------------------------------------------------------------
def test_informative_groups_by_hand():
    scores = torch.tensor([1, 1, 1, 1, 0, 1, 0, 0, 0, 0, 0, 0, 0.5, 0.5, 0.5, 0.6])
    assert informative_groups(scores, 4) == [1, 3]
    assert informative_groups(scores, 2) == [2, 7]
    assert informative_groups(torch.tensor([-1.0, -1.0]), 2) == []
    # filter_groups_range: group means 1, 0.25, 0, 0.525; the band is inclusive; all-equal groups stay out
    assert informative_groups(scores, 4, scores, [0.2, 0.8]) == [1, 3]
    assert informative_groups(scores, 4, scores, [0.3, 0.8]) == [3]
    assert informative_groups(scores, 4, scores, [0.25, 0.25]) == [1]
    assert informative_groups(scores, 4, scores, [0.0, 1.0]) == [1, 3]
    # the band reads the reward's own values, not the shaped outcome the equality test reads
    assert informative_groups(scores, 4, torch.zeros(16), [0.2, 0.8]) == []


def test_prompt_stream_is_one_stream_of_seeded_passes():
    n, seed = 7, 3
    whole = prompt_stream(n, 0, 30, seed, True)
    assert sorted(whole[:7]) == list(range(7)) and sorted(whole[7:14]) == list(range(7))  # each pass a permutation
    assert whole[:7] != whole[7:14]  # a fresh order per pass
    # any stretch depends only on its position: blocks of 4 (steps), then 3 extra prompts, then blocks again
    assert prompt_stream(n, 0, 4, seed, True) + prompt_stream(n, 4, 3, seed, True) == whole[:7]
    assert prompt_stream(n, 13, 9, seed, True) == whole[13:22]
    assert prompt_stream(n, 5, 4, seed, False) == [5, 6, 0, 1]  # file order


def scored_of(lengths: list[int], scores: list[float]) -> Scored:
    s = samples(lengths)
    mask = s.response_mask()
    t = torch.arange(mask.numel(), dtype=torch.float32).view(mask.shape) * mask
    return Scored(s, mask, t, None, None, t * 0, torch.tensor(scores), torch.tensor(scores), None)


def test_select_scored_pads_and_cuts_to_the_kept_responses():
    a, b = scored_of([2, 5], [0.0, 1.0]), scored_of([3, 1, 2], [2.0, 3.0, 4.0])
    out = select_scored([(a, [0]), (b, [2, 0])])
    assert out.scores.tolist() == [0.0, 4.0, 2.0]
    assert out.mask.tolist() == [[1, 1, 0], [1, 1, 0], [1, 1, 1]]  # width 3: the longest kept response
    assert out.logprobs.tolist() == [[0, 1, 0], [6, 7, 0], [0, 1, 2]]
    assert out.ref_logprobs is None and out.samples.response_ids == [[5] * 2, [5] * 2, [5] * 3]


def test_trainable_groups_divide_the_mini_batch(tmp_path, caplog):
    d = DAPO(parse_ppo_config([dapo_config(tmp_path, actor_rollout={"ppo_mini_batch_size": 8})]))
    assert d.trainable_groups(4, 0) == 4 and d.trainable_groups(2, 0) == 2 and d.trainable_groups(1, 0) == 1
    with caplog.at_level(logging.WARNING):
        assert d.trainable_groups(3, 0) == 2  # 12 samples: the first 8 (2 whole groups)
    assert "ppo_mini_batch_size=8 does not divide the 12 samples of 3 groups: training on the first 2" in caplog.text
    d = DAPO(
        parse_ppo_config(
            [dapo_config(tmp_path, actor_rollout={"ppo_mini_batch_size": 6}, data={"rollout_batch_size": 3})]
        )
    )
    assert d.trainable_groups(2, 0) == 2  # 8 samples, no whole-group multiple of 6 below: a smaller last mini-batch


# --- end to end ------------------------------------------------------------------------------------------------------
def test_dynamic_sampling_drops_equal_groups_and_draws_more(tmp_path):
    out = tmp_path / "out"
    main([dapo_config(tmp_path, training={"max_steps": 3})])
    logs = history(out)
    assert len(logs) == 3
    for h in logs:
        assert h["dapo/groups_kept"] == 4 and h["dapo/update_skipped"] == 0 and "policy_loss" in h
    assert any(h["dapo/gen_rounds"] > 1 for h in logs) and sum(h["dapo/groups_dropped"] for h in logs) > 0
    # every trained group has unequal rewards: no sample of an all-zero prompt is in a step's batch
    rows = read_jsonl(out / "samples.jsonl")
    assert rows and all(zlib.crc32(r["prompt"].encode()) % 2 == 1 for r in rows)


def test_range_trains_only_groups_whose_mean_reward_is_in_it(tmp_path):
    """half_constant: parity rewards on half the prompts; with the band [0.5, 0.5] only groups with exactly 2 of
    their 4 samples rewarded are trained on."""
    out = tmp_path / "out"
    training = {"max_steps": 2, "log_samples": 64}
    cfg = dapo_config(tmp_path, training=training, algorithm={"filter_groups_range": [0.5, 0.5]})
    main([cfg])
    logs = history(out)
    assert len(logs) == 2 and sum(h["dapo/groups_dropped"] for h in logs) > 0
    by_group: dict = {}
    for r in read_jsonl(out / "samples.jsonl"):
        by_group.setdefault((r["step"], r["prompt"]), []).append(r["score"])
    assert by_group and sum(len(v) for v in by_group.values()) == sum(4 * h["dapo/groups_kept"] for h in logs)
    assert all(len(v) == 4 and sum(v) == 2 for v in by_group.values()), by_group


@pytest.mark.parametrize(
    "actor",
    [{"ppo_mini_batch_size": 4, "ppo_epochs": 2}, {"rollout_is_cap": 2.0}, {"rollout_log_probs": True}],
    ids=["old-log-probs", "tis", "engine-log-probs"],
)
def test_refill_carries_the_log_probs(tmp_path, actor):
    """Off-policy mini-batches, TIS and the engine's log-probs: each round's log-probs follow its kept samples."""
    main([dapo_config(tmp_path, actor_rollout=actor, training={"max_steps": 2})])
    logs = history(tmp_path / "out")
    assert any(h["dapo/gen_rounds"] > 1 for h in logs)
    assert all(torch.isfinite(torch.tensor(h["policy_loss"])) for h in logs)
    if "rollout_is_cap" in actor:
        assert all(0 < h["rollout_is_weight"] <= 2 for h in logs)


def test_resume_draws_the_same_prompts(tmp_path):
    out, resumed = tmp_path / "out", tmp_path / "resumed"
    settings = {"max_steps": 4, "save_steps": 2, "save_total_limit": None, "log_samples": 16}
    main([dapo_config(tmp_path, training=settings)])
    state = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["tree"]["dapo"]["extra_prompts"] > 0  # steps 1-2 drew extra prompts: the stream moved on
    shutil.copytree(out / "checkpoint-2", resumed / "checkpoint-2")
    main([dapo_config(tmp_path, training={**settings, "output_dir": str(resumed), "resume_from_checkpoint": "auto"})])
    full, again = history(out), history(resumed)
    assert [h["step"] for h in again] == [1, 2, 3, 4]
    for a, b in zip(full[2:], again[2:]):
        for key in ("dapo/gen_rounds", "dapo/groups_dropped", "score"):
            assert a[key] == pytest.approx(b[key], abs=1e-6), key
    rows = [{k: r[k] for k in ("step", "prompt", "response_ids")} for r in read_jsonl(out / "samples.jsonl")]
    rows_again = [{k: r[k] for k in ("step", "prompt", "response_ids")} for r in read_jsonl(resumed / "samples.jsonl")]
    assert [r for r in rows if r["step"] > 2] == [r for r in rows_again if r["step"] > 2]


def test_the_cap_trains_on_fewer_groups(tmp_path, capsys):
    main([dapo_config(tmp_path, algorithm={"max_num_gen_batches": 1}, training={"max_steps": 2})])
    logs = history(tmp_path / "out")
    assert all(h["dapo/gen_rounds"] == 1 for h in logs)
    assert any(h["dapo/groups_kept"] < 4 for h in logs)
    for h in logs:  # trained on the groups it had, or (none) skipped
        assert ("policy_loss" in h) == (h["dapo/groups_kept"] > 0) == (h["dapo/update_skipped"] == 0)
    assert (
        "groups have unequal rewards after algorithm.max_num_gen_batches=1 generation rounds" in capsys.readouterr().err
    )  # the run logs to stderr


def test_no_group_left_skips_the_update(tmp_path, caplog):
    c = parse_ppo_config(
        [dapo_config(tmp_path, reward={"rule": "tests.test_ppo_dapo:constant"}, algorithm={"max_num_gen_batches": 2})]
    )
    run = PPOContext.load(c)
    with placed_roles(c, run) as roles:
        trainer = build_ppo(c, load_prompts(c, run), roles, run)
        before = {k: v.clone() for k, v in trainer.actor.model.state_dict().items()}
        with caplog.at_level(logging.WARNING):
            metrics = trainer.train_step()
        after = trainer.actor.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # no optimizer step
    assert metrics["dapo/update_skipped"] == 1 and metrics["dapo/gen_rounds"] == 2
    assert metrics["dapo/groups_dropped"] == 8 and metrics["dapo/groups_kept"] == 0 and "policy_loss" not in metrics
    assert (
        trainer.step == 1
        and trainer.prompt_stream.extra_prompts == 4
        and len(trainer.last_experience.scored.samples) == 32
    )
    assert "no update this step" in caplog.text
    assert trainer.prompt_indices(1) == prompt_stream(
        300, 8, 4, c.training.seed, True
    )  # after step 0 and its extra round


def test_overlong_shaping_in_a_run(tmp_path):
    out = tmp_path / "out"
    main([dapo_config(tmp_path, reward={"overlong_buffer_len": 3}, algorithm={"filter_groups": False})])
    logs = history(out)
    assert "dapo/gen_rounds" not in logs[0] and logs[0]["dapo/overlong_frac"] > 0
    for r in read_jsonl(out / "samples.jsonl"):  # score_shaped = score + R_length(|y|), L_max 8, L_cache 3
        assert r["score_shaped"] == pytest.approx(r["score"] + min(max((5 - r["response_length"]) / 3, -1), 0))


# --- validation ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "sections, needle",
    [
        ({"algorithm": {"adv_estimator": "gae"}}, "algorithm.filter_groups .* needs a grouped estimator.*grpo"),
        (
            {"algorithm": {"adv_estimator": "reinforce_plus_plus"}},
            "adv_estimator is 'reinforce_plus_plus': set algorithm.adv_estimator",
        ),
        ({"actor_rollout": {"num_samples_per_step": 1, "ppo_mini_batch_size": 4}}, "num_samples_per_step >= 2"),
        ({"reward": {"overlong_buffer_len": 8}}, "reward.overlong_buffer_len=8 must be less than actor_rollout.max_"),
        ({"algorithm": {"filter_groups_range": [0.8, 0.2]}}, r"filter_groups_range must be \[low, high\] with low <="),
        ({"algorithm": {"filter_groups_range": [0.5]}}, r"filter_groups_range must be \[low, high\].*got \[0.5\]"),
    ],
)
def test_validation_messages(tmp_path, sections, needle):
    with pytest.raises(UserError, match=needle):
        parse_ppo_config([dapo_config(tmp_path, **sections)])


def test_unused_settings_are_noted(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        parse_ppo_config(
            [
                config(
                    tmp_path,
                    algorithm={"max_num_gen_batches": 3, "filter_groups_range": [0.2, 0.8]},
                    reward={"overlong_penalty_factor": 2},
                )
            ]
        )
    assert "max_num_gen_batches applies with algorithm.filter_groups true only" in caplog.text
    assert "filter_groups_range applies with algorithm.filter_groups true only" in caplog.text
    assert "overlong_penalty_factor applies with reward.overlong_buffer_len > 0 only" in caplog.text


def test_the_tiny_dapo_config_runs(tmp_path):
    out = tmp_path / "dapo"
    main([DAPO_TINY, "--training.output_dir", str(out), "--training.max_steps", "2", "--training.save_steps", "0"])
    logs = history(out)
    assert len(logs) == 2 and all("dapo/gen_rounds" in h and "dapo/overlong_penalty" in h for h in logs)
    c = parse_ppo_config([DAPO_TINY])
    assert c.clip_low == 0.2 and c.clip_high == 0.28 and c.algorithm.filter_groups and c.reward.overlong_buffer_len
