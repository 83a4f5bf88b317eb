"""``reward`` as a list (llm/settings/reward_list.py, llm/alignment/ppo/rewards/combined.py): several rewards,
weighted and summed, each logged on its own; one section unchanged; bad lists refused naming ``reward[i].field``."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from llm.alignment.ppo.algorithm import token_rewards
from llm.alignment.ppo.build import ppo_trainer
from llm.alignment.ppo.context import PPOContext
from llm.alignment.ppo.interfaces import Samples
from llm.alignment.ppo.loading import Place
from llm.alignment.ppo.rewards import PRMReward, RuleReward, WeightedRewards, build_rewards
from llm.settings.fingerprint import run_fingerprint
from llm.settings.load import parse_ppo_config
from llm.settings.reward_list import reward_names
from llm.utils.errors import UserError
from tests.helpers import ROOT, ppo_config_file, read_jsonl, tiny_model, tokenizer

TINY_GRPO = os.path.join(ROOT, "llm", "config", "tiny", "grpo_dr_grpo_argument.json")
SHIPPED = os.path.join(ROOT, "llm", "config", "tiny", "grpo_rewards_argument.json")
RULES = "llm.alignment.ppo.rewards.rule_functions"
DIGITS = {"type": "rule", "rule": f"{RULES}:digit_fraction"}
EXACT = {"type": "rule", "rule": f"{RULES}:math_exact_match"}
TINY_PRM = os.path.join(ROOT, "llm", "assets", "tiny-prm")
TINY_TOKENIZER = os.path.join(ROOT, "llm", "assets", "tiny_tokenizer")
PRM = {
    "type": "prm",
    "model_name_or_path": TINY_PRM,
    "tokenizer_name_or_path": TINY_TOKENIZER,
    "init_from_config": True,
}


def config(tmp_path, reward, *layers, argv=()):
    """The tiny GRPO config with ``reward`` (a section or a list), parsed."""
    path = ppo_config_file(tmp_path, TINY_GRPO, "grpo", *layers)
    with open(path, encoding="utf-8") as f:
        raw = json.load(f)
    raw["reward"] = reward
    with open(path, "w", encoding="utf-8") as f:
        json.dump(raw, f)
    return parse_ppo_config([path, *argv])


def samples(responses, references):
    tok = tokenizer()
    ids = [tok(r, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for r in responses]
    n = len(responses)
    return Samples([tok("Q?\n")["input_ids"]] * n, ids, ["Q?\n"] * n, responses, references, torch.ones(n, dtype=bool))


RESPONSES, REFERENCES = ["12", "a1", "ab"], ["12", "1", "3"]
# by hand: digit_fraction 1, 1/2, 0; math_exact_match 1, 1, 0
DIGIT_FRACTION, EXACT_MATCH = [1.0, 0.5, 0.0], [1.0, 1.0, 0.0]


def test_one_section_is_a_one_element_list_with_weight_1(tmp_path):
    one = config(tmp_path, DIGITS)
    listed = config(tmp_path, [DIGITS])
    weighted = config(tmp_path, [{**DIGITS, "weight": 1.0, "name": "digits"}])
    assert one.extra_rewards == listed.extra_rewards == weighted.extra_rewards == ()
    digest = run_fingerprint(one).digest
    assert run_fingerprint(listed).digest == digest == run_fingerprint(weighted).digest  # the name is a metric's
    assert "reward.weight" not in run_fingerprint(one).values  # left out at 1 (ADDED_LATER): old checkpoints resume
    built = [build_rewards(c, Place(), PPOContext.load(c)) for c in (one, listed, weighted)]
    assert all(type(r) is RuleReward for r in built)  # the same reward object as before lists existed
    s = samples(RESPONSES, REFERENCES)
    outs = [r.score(s) for r in built]
    for out in outs:
        assert out.scores.tolist() == DIGIT_FRACTION and out.components is None
    # a weight on one section scales it, and is fingerprinted
    half = config(tmp_path, {**DIGITS, "weight": 0.5})
    assert run_fingerprint(half).digest != digest
    assert build_rewards(half, Place(), PPOContext.load(half)).score(s).scores.tolist() == [0.5, 0.25, 0.0]


def test_two_rules_weighted_give_the_hand_computed_total_and_each_component(tmp_path):
    c = config(tmp_path, [{**DIGITS, "weight": 0.7}, {**EXACT, "weight": 0.3}])
    assert reward_names(c) == ("digit_fraction", "math_exact_match")
    reward = build_rewards(c, Place(), PPOContext.load(c))
    out = reward.score(samples(RESPONSES, REFERENCES))
    expected = [0.7 * d + 0.3 * e for d, e in zip(DIGIT_FRACTION, EXACT_MATCH)]  # 1.0, 0.65, 0.0
    assert out.scores.tolist() == pytest.approx(expected) and out.scores[1].item() == pytest.approx(0.65)
    assert out.dense is None
    assert out.components["digit_fraction"].tolist() == DIGIT_FRACTION
    assert out.components["math_exact_match"].tolist() == EXACT_MATCH
    # swapping the weights changes the total the other way
    swapped = config(tmp_path, [{**DIGITS, "weight": 0.3}, {**EXACT, "weight": 0.7}])
    total = build_rewards(swapped, Place(), PPOContext.load(swapped)).score(samples(RESPONSES, REFERENCES)).scores
    assert total[1].item() == pytest.approx(0.85)


def test_a_run_logs_each_reward_and_their_weighted_sum(tmp_path):
    """One GRPO step: the metrics' reward/NAME/mean and every samples.jsonl row's rewards, by hand from the rows."""
    training = {"max_steps": 1, "log_samples": 64, "micro_batch_size": 8}
    c = config(
        tmp_path,
        [{**DIGITS, "weight": 0.7, "name": "digits"}, {"type": "rule", "rule": f"{RULES}:no_reward", "weight": 0.3}],
        {"training": training, "data": {"rollout_batch_size": 4}, "actor_rollout": {"ppo_mini_batch_size": 16}},
    )
    with ppo_trainer(c) as trainer:
        history = trainer.train()
    metrics = history[0]
    rows = read_jsonl(os.path.join(c.training.output_dir, "samples.jsonl"))
    assert len(rows) == 16
    for row in rows:
        text = row["response"].strip()
        digits = sum(ch.isdigit() for ch in text) / len(text) if text else 0.0
        assert row["rewards"] == {"digits": pytest.approx(digits), "no_reward": 0.0}
        assert row["score"] == pytest.approx(0.7 * digits)
    assert metrics["reward/digits/mean"] == pytest.approx(sum(r["rewards"]["digits"] for r in rows) / 16, abs=1e-6)
    assert metrics["reward/no_reward/mean"] == 0.0
    assert metrics["score"] == pytest.approx(0.7 * metrics["reward/digits/mean"], abs=1e-6)


def test_rule_plus_dense_prm_sum_where_each_puts_its_reward(tmp_path):
    """The outcome at the last response token, the PRM's step rewards at each step's last token, each weighted."""
    tok = tokenizer()
    prm_model = tiny_model("llama").eval()
    plus, minus, ph = (tok.convert_tokens_to_ids(t) for t in ("+", "-", "ки"))
    prm = PRMReward(prm_model, tok, tok, "\n", "ки", (plus, minus), ph, "dense", 4)
    rule = RuleReward(f"{RULES}:digit_fraction")
    s = samples(["3 * 4 = 12\nThe answer is 12", "no"], ["12", "1"])
    alone_prm, alone_rule = prm.score(s), rule.score(s)
    out = WeightedRewards([("digits", 0.25, rule), ("prm", 2.0, prm)]).score(s)
    assert out.scores.tolist() == pytest.approx([0.25 * v for v in alone_rule.scores.tolist()])
    assert torch.allclose(out.dense, 2.0 * alone_prm.dense)
    assert (alone_prm.dense[0] != 0).sum() == 2 and (alone_prm.dense[1] != 0).sum() == 1  # two steps, one step
    assert torch.allclose(out.components["prm"], alone_prm.dense.sum(1))
    assert out.components["digits"].tolist() == alone_rule.scores.tolist()
    # the per-token rewards the trainer builds: each response's last token gets the weighted outcome plus the
    # weighted step reward of the last step (which ends there); the first step's reward stays at its own token
    mask = torch.zeros(2, out.dense.shape[1])
    for i, ids in enumerate(s.response_ids):
        mask[i, : len(ids)] = 1
    rewards = token_rewards(torch.zeros_like(mask), out.scores, mask, 0.0, out.dense)
    for i, ids in enumerate(s.response_ids):
        last = len(ids) - 1
        steps = alone_prm.dense[i].nonzero().flatten().tolist()
        assert rewards[i, last].item() == pytest.approx(
            0.25 * alone_rule.scores[i].item() + 2.0 * alone_prm.dense[i, last].item()
        )
        for k in steps[:-1]:
            assert rewards[i, k].item() == pytest.approx(2.0 * alone_prm.dense[i, k].item())
        assert rewards[i].sum().item() == pytest.approx(
            0.25 * alone_rule.scores[i].item() + 2.0 * alone_prm.dense[i].sum().item()
        )
    # built from a config: the rule and the PRM (loaded once, from llm/assets/tiny-prm)
    c = config(
        tmp_path,
        [{**DIGITS, "weight": 0.25}, PRM],
    )
    built = build_rewards(c, Place(), PPOContext.load(c))
    assert [(n, w, type(r).__name__) for n, w, r in built.parts] == [
        ("digit_fraction", 0.25, "RuleReward"),
        ("prm", 1.0, "PRMReward"),
    ]
    assert built.score(s).dense is not None


def test_the_shipped_rewards_config_runs(tmp_path):
    """llm/config/tiny/grpo_rewards_argument.json as shipped (rule 0.7 + tiny PRM 0.3, its steps averaged), two
    steps: each reward logged, the score their weighted sum."""
    out = tmp_path / "out"
    argv = [SHIPPED, "--training.max_steps", "2", "--training.output_dir", str(out), "--training.report_to", "none"]
    c = parse_ppo_config([*argv, "--training.save_steps", "0"])
    assert [(r.type, r.weight) for r in c.rewards] == [("rule", 0.7), ("prm", 0.3)]
    with ppo_trainer(c) as trainer:
        history = trainer.train()
    for m in history:
        assert 0 <= m["reward/digit_fraction/mean"] <= 1 and 0 < m["reward/tiny_prm/mean"] < 1  # a probability
        total = 0.7 * m["reward/digit_fraction/mean"] + 0.3 * m["reward/tiny_prm/mean"]
        assert m["score"] == pytest.approx(total, abs=1e-5)


@pytest.mark.parametrize(
    "reward, argv, message",
    [
        ([], (), r"reward is an empty list"),
        ([DIGITS, "orm"], (), r"reward\[1\] must be an object of field: value pairs"),
        ([DIGITS, {**EXACT, "weight": 0}], (), r"reward\[1\]\.weight must be a finite number > 0"),
        ([{**DIGITS, "weight": -1.0}], (), r"reward\.weight must be a finite number > 0"),  # one entry: the one section
        ([DIGITS, {**EXACT, "weight": math.nan}], (), r"reward\[1\]\.weight must be a finite number, got NaN"),
        ({**DIGITS, "weight": 0.0}, (), r"reward\.weight must be a finite number > 0"),
        ([{**DIGITS, "name": "a"}, {**EXACT, "name": "a"}], (), r"reward\[1\]\.name 'a' is reward\[0\]'s name too"),
        ([{**DIGITS, "name": "a b"}, EXACT], (), r"reward\[0\]\.name 'a b': use letters"),
        ([DIGITS, {"tpye": "rule"}], (), r"reward\[1\]: unknown key 'tpye'"),
        ([DIGITS, {"type": "orm"}], (), r"reward\[1\]\.type='orm' needs reward\[1\]\.model_name_or_path"),
        ([DIGITS, {"type": "nope"}], (), r"reward\[1\]\.type: .*must be one of"),
        ([DIGITS, {**EXACT, "normalize_reward": True}], (), r"reward\[1\]\.normalize_reward: it shapes the total"),
        ([DIGITS, {**EXACT, "dtype": "bfloat16"}], (), r"reward\[1\]\.dtype applies to a reward model"),
        ([DIGITS, EXACT], ("--reward.weight", "2"), r"--reward\.weight: .* gives reward as a list"),
    ],
)
def test_bad_reward_lists_are_refused_naming_the_entry(tmp_path, reward, argv, message):
    with pytest.raises(UserError, match=message):
        config(tmp_path, reward, argv=argv)


def test_two_reward_models_in_an_fsdp_reward_group_are_refused(tmp_path):
    prm = PRM
    pool = {"use_ray": True, "actor_rollout": 1, "ref": 1, "critic": 1, "reward": 2}
    with pytest.raises(UserError, match=r"reward\[1\]\.type='prm': a second reward model with resource_pool\.reward=2"):
        config(tmp_path, [prm, prm], {"resource_pool": pool})


def test_a_bad_list_exits_2_with_one_message(tmp_path):
    path = ppo_config_file(tmp_path, TINY_GRPO, "grpo")
    with open(path, encoding="utf-8") as f:
        raw = json.load(f)
    raw["reward"] = [DIGITS, {**EXACT, "weight": 0}]
    with open(path, "w", encoding="utf-8") as f:
        json.dump(raw, f)
    run = subprocess.run(
        [sys.executable, os.path.join(ROOT, "llm", "run_ppo.py"), path],
        check=False,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert run.returncode == 2, run.stderr[-2000:]
    assert "reward[1].weight must be a finite number > 0" in run.stderr and "Traceback" not in run.stderr


def test_a_multi_turn_episode_adds_the_weighted_rewards_of_the_whole_conversation(tmp_path):
    """Echo's turns pay 0.1 and 0.2 (gamma 1: 0.3); the list's rules score the whole conversation (the environment's
    messages included) and their weighted sum adds to it."""
    from llm.alignment.ppo.build import build_ppo, load_prompts, placed_roles
    from llm.alignment.ppo.rewards.rule_functions import digit_fraction

    tiny = os.path.join(ROOT, "llm", "config", "tiny", "ppo_argument.json")
    path = ppo_config_file(
        tmp_path,
        tiny,
        "grpo",
        {
            "actor_rollout": {"max_response_length": 4, "num_samples_per_step": 2, "ppo_mini_batch_size": 4},
            "algorithm": {"adv_estimator": "grpo", "use_kl_in_reward": False},
            "data": {"rollout_batch_size": 2, "use_chat_template": None},
            "environment": {"name_or_path": "tests.agent_envs:Echo", "kwargs": {"turns": 2}, "max_episode_tokens": 256},
        },
    )
    with open(path, encoding="utf-8") as f:
        raw = json.load(f)
    raw["reward"] = [
        {"type": "rule", "rule": "tests.agent_envs:always_one", "weight": 0.5},
        {**DIGITS, "weight": 2.0},
    ]
    with open(path, "w", encoding="utf-8") as f:
        json.dump(raw, f)
    c = parse_ppo_config([path])
    run = PPOContext.load(c)
    with placed_roles(c, run) as roles:
        trainer = build_ppo(c, load_prompts(c, run), roles, run)
        eos = trainer.tokenizer.eos_token_id
        digit = trainer.tokenizer("7", add_special_tokens=False)["input_ids"][-1]
        trainer.generator.generate = lambda prompt_ids, **s: [[digit, eos] for _ in prompt_ids]
        scored = trainer.source.collect(0).scored
        exp = trainer.advantages(scored)
    responses = scored.samples.responses
    assert len(responses) == 4 and all("obs 1" in r for r in responses)  # the whole conversation was scored
    digits = [digit_fraction("", r, None) for r in responses]
    assert all(0 < d < 1 for d in digits)
    assert scored.components["always_one"].tolist() == [1.0] * 4
    assert scored.components["digit_fraction"].tolist() == pytest.approx(digits)
    assert scored.raw_scores.tolist() == pytest.approx([0.5 + 2.0 * d for d in digits])
    assert exp.rewards.sum(1).tolist() == pytest.approx([0.5 + 2.0 * d + 0.3 for d in digits], abs=1e-5)


def test_an_entry_that_fails_to_build_is_named(tmp_path):
    c = config(tmp_path, [DIGITS, {"type": "rule", "rule": "no_such_module_xyz:f"}])
    with pytest.raises(UserError, match=r"reward\[1\] \(f\): reward.rule 'no_such_module_xyz:f': cannot import"):
        build_rewards(c, Place(), PPOContext.load(c))
