"""The reward registry that both the config check and the builder read, and the one-pass decoding behind PRM
dense rewards, against the decode-every-prefix it replaced."""

from __future__ import annotations

import random
from typing import ClassVar

import pytest
import torch
from transformers import AutoTokenizer

from llm.alignment.ppo import rewards
from llm.alignment.ppo.build import PPOContext, build_role
from llm.alignment.ppo.interfaces import RewardOutput, Samples
from llm.alignment.ppo.rewards import REWARDS, RewardFunction, char_to_token_end, decoded_lengths, register_reward
from llm.run_ppo import main
from llm.settings.load import parse_ppo_config
from llm.utils.errors import UserError
from tests.helpers import tokenizer
from tests.test_ppo_run import config, history
from tests.test_prm_tokenizers import mistral_dir, qwen_dir  # noqa: F401 - fixtures: the real tokenizers, offline


# --- the reward registry --------------------------------------------------------------------------------
def test_an_unregistered_reward_type_is_refused_with_the_valid_ones(tmp_path):
    assert {"orm", "prm", "rule", "http"} <= set(REWARDS)
    valid = ", ".join(sorted(REWARDS))
    with pytest.raises(UserError, match=rf"reward.type must be one of {valid}, got 'orn' \(closest: 'orm'"):
        parse_ppo_config([config(tmp_path, reward={"type": "orn"})])
    with pytest.raises(UserError, match=r"reward.type='http' needs reward.url"):
        parse_ppo_config([config(tmp_path, reward={"type": "http"})])
    with pytest.raises(UserError, match=r"reward.type='prm' needs reward.model_name_or_path"):
        parse_ppo_config([config(tmp_path, reward={"type": "prm"})])


def test_every_registered_reward_type_builds_and_scores():
    for name, kind in REWARDS.items():
        assert kind.name == name and issubclass(kind.cls, RewardFunction)
        for method in ("from_config", "score"):
            assert getattr(kind.cls, method) is not getattr(RewardFunction, method), (name, method)


class ToyLength(RewardFunction):
    """A toy reward type: ``scale`` x the response's length in characters (``reward.timeout`` as the scale,
    to show a type reading its settings from the reward section)."""

    calls: ClassVar[list[int]] = []

    def __init__(self, scale: float) -> None:
        self.scale = scale

    @classmethod
    def from_config(cls, c, place, run) -> ToyLength:
        return cls(c.reward.timeout)

    def score(self, samples: Samples) -> RewardOutput:
        ToyLength.calls.append(len(samples))
        return RewardOutput(torch.tensor([self.scale * len(r) for r in samples.responses]))


@pytest.fixture
def toy_reward():
    register_reward("toy_length")(ToyLength)
    ToyLength.calls = []
    try:
        yield
    finally:
        del REWARDS["toy_length"]


def test_a_registered_toy_reward_type_runs_through_build_and_a_run(tmp_path, toy_reward):
    c = parse_ppo_config([config(tmp_path, reward={"type": "toy_length", "timeout": 0.5})])
    reward = build_role(c, "reward", run=PPOContext.load(c))
    assert isinstance(reward, ToyLength) and reward.scale == 0.5
    n = 3
    s = Samples([[1, 5]] * n, [[9]] * n, ["q"] * n, ["ab", "", "abcd"], [None] * n, torch.ones(n, dtype=bool))
    assert reward.score(s).scores.tolist() == [1.0, 0.0, 2.0]
    # It has no model: the model settings of a reward are refused, naming the types that have one.
    with pytest.raises(
        UserError, match=r"reward.dtype applies to a reward model \(type generative_prm or implicit_prm or orm or prm\)"
    ):
        parse_ppo_config([config(tmp_path, reward={"type": "toy_length", "dtype": "bfloat16"})])
    # A whole run with it (the critic starts from the actor: the toy has no value head).
    out, ToyLength.calls = tmp_path / "out", []
    main([config(tmp_path, reward={"type": "toy_length", "timeout": 0.5}, training={"max_steps": 1})])
    assert len(ToyLength.calls) == 1 and len(history(out)) == 1  # one step: one batch scored
    assert history(out)[0]["score"] >= 0
    assert "toy_length" not in rewards.model_types()


# --- one-pass decoding for PRM dense rewards ----------------------------------------------------------
def old_char_to_token_end(tokenizer, response_ids: list[int], char_end: int) -> int:
    """The function it replaced: decodes every prefix again for each step."""
    for k in range(len(response_ids)):
        if len(tokenizer.decode(response_ids[: k + 1], skip_special_tokens=True)) >= char_end:
            return k
    return len(response_ids) - 1


TEXTS = [
    "Cheese costs 3 * 4 = 12 dollars.\nThe answer is 12.",
    "Step 1: Janet’s ducks lay 16 eggs.  \nStep 2: 16 - 3 = <<16-3=13>>13 ки\n\nThe answer is: 18",
    "价格是 3 × 4 = 12 元。\n答案是 12。",
    "Émile paid €12.50 🙂 for it , isn't it ?\n  So 12 .",
    " leading space\nand  double  spaces \n",
]


def check_same(tok, ids: list[int]) -> None:
    prefix = [len(tok.decode(ids[: k + 1], skip_special_tokens=True)) for k in range(len(ids))]
    assert decoded_lengths(tok, ids) == prefix, tok.convert_ids_to_tokens(ids)
    lengths = decoded_lengths(tok, ids)
    for char_end in range((prefix[-1] if prefix else 0) + 2):
        assert char_to_token_end(tok, ids, char_end) == old_char_to_token_end(tok, ids, char_end)
        assert char_to_token_end(tok, ids, char_end, lengths) == old_char_to_token_end(tok, ids, char_end)


@pytest.mark.parametrize("which", ["tiny", "qwen", "mistral"])
def test_one_pass_token_ends_equal_decoding_every_prefix(which, request):
    tok = tokenizer() if which == "tiny" else AutoTokenizer.from_pretrained(request.getfixturevalue(f"{which}_dir"))
    specials = [t for t in (tok.eos_token_id, tok.bos_token_id) if t is not None]
    for text in TEXTS:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        check_same(tok, ids)
        check_same(tok, ids + specials[:1])  # a response that ended with EOS
        check_same(tok, ids[:3] + specials + ids[3:])  # special tokens inside (skipped when decoding)
    # Sampled responses: any ids, so byte-level tokens that hold part of a character (decoded as U+FFFD).
    rng = random.Random(0)
    vocab = len(tok)
    for _ in range(6):
        check_same(tok, [rng.randrange(vocab) for _ in range(rng.randint(1, 40))])
    for text in TEXTS[2:4]:  # multi-byte characters cut into their bytes, where the tokenizer has byte tokens
        ids = [i for ch in text for i in tok(ch, add_special_tokens=False)["input_ids"]]
        check_same(tok, ids)


def test_a_rule_named_by_its_old_module_still_loads():
    """llm.alignment.ppo.rules moved to llm.alignment.ppo.rewards.rule_functions: configs naming the old module
    keep working, and call the same function."""
    from llm.alignment.ppo.rewards.rule import RuleReward
    from llm.alignment.ppo.rewards.rule_functions import math_exact_match

    assert RuleReward("llm.alignment.ppo.rules:math_exact_match").fn is math_exact_match
    with pytest.raises(UserError, match="cannot import"):
        RuleReward("llm.alignment.ppo.rulez:math_exact_match")
