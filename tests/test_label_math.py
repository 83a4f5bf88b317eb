"""The pure algorithms of llm/run_label.py (llm/alignment/label/mc.py, omega.py) on scripted Monte Carlo values
whose truth is known: Math-Shepherd's hard and soft estimates, OmegaPRM's binary search for the first wrong step
(its estimates counted), its selection score and tree search, and the consensus filter."""

import math

import pytest

from llm.alignment.label.mc import NO_ERROR, StepLabels, agrees, first_error_search, math_shepherd
from llm.alignment.label.omega import OmegaSearch, OmegaSettings, Rollout, State


class Counted:
    """``estimate(i)`` from a table of MC values, counting its calls."""

    def __init__(self, values):
        self.values, self.calls = list(values), []

    def __call__(self, i):
        self.calls.append(i)
        return self.values[i]


def test_math_shepherd_hard_is_any_right_soft_is_the_fraction():
    # MC per prefix: 3/4, 1/8, 0, 1/2 -> hard + + - + (each step on its own: step 3 recovers), soft = the values
    est = Counted([0.75, 0.125, 0.0, 0.5])
    labels = math_shepherd(4, est)
    assert labels.hard == [True, True, False, True]
    assert labels.soft == [0.75, 0.125, 0.0, 0.5]
    assert labels.estimates == 4 and est.calls == [0, 1, 2, 3]  # M estimates for M steps
    assert labels.first_error == 2


def test_math_shepherd_takes_a_known_value_without_an_estimate():
    est = Counted([0.5, 0.5, 99.0])  # 99 would be refused: it must not be asked for
    labels = math_shepherd(3, est, known={2: 0.0})
    assert est.calls == [0, 1] and labels.estimates == 2
    assert labels.hard == [True, True, False] and labels.soft == [0.5, 0.5, 0.0]


def test_an_estimate_outside_zero_one_is_refused():
    with pytest.raises(ValueError, match="outside"):
        math_shepherd(1, lambda i: 1.5)


@pytest.mark.parametrize("m", [1, 2, 3, 7, 8, 16, 31])
def test_binary_search_finds_every_first_error_within_log2_estimates(m):
    bound = math.ceil(math.log2(m + 1))
    for error in range(m + 1):  # error == m: every step right
        # MC > 0 before the first error (values vary: only zero / non-zero may matter), 0 from it on
        est = Counted([0.1 + 0.8 * (i % 3) / 2 if i < error else 0.0 for i in range(m)])
        labels = first_error_search(m, est)
        assert labels.first_error == (error if error < m else NO_ERROR)
        assert labels.hard == [i < error for i in range(m)]
        assert labels.estimates == len(est.calls) <= bound, (m, error, est.calls)
        assert len(set(est.calls)) == len(est.calls)  # no prefix estimated twice
        for i in est.calls:
            assert labels.soft[i] == est.values[i]
        assert sum(v is not None for v in labels.soft) == len(est.calls)


def test_binary_search_on_sixteen_steps_costs_five_estimates_not_sixteen():
    # first error at step 11 of 16: mids 8 (>0), 12 (0), 10 (>0), 11 (0) -> 4 estimates; Math-Shepherd needs 16
    est = Counted([0.5] * 11 + [0.0] * 5)
    labels = first_error_search(16, est)
    assert est.calls == [8, 12, 10, 11]
    assert labels.first_error == 11 and labels.estimates == 4
    assert math_shepherd(16, Counted(est.values)).estimates == 16


def test_binary_search_uses_the_known_wrong_last_step():
    # a wrong solution of 4 steps whose answer was checked (MC of the whole = 0, known): error at step 3.
    # lo=0, hi=4: mid 2 (0.5) -> lo 3; mid 3 known 0 -> hi 3: one estimate, not two
    est = Counted([0.5, 0.5, 0.5, 0.7])
    labels = first_error_search(4, est, known={3: 0.0})
    assert est.calls == [2] and labels.estimates == 1
    assert labels.hard == [True, True, True, False]
    assert labels.soft == [None, None, 0.5, 0.0]


def test_consensus_keeps_only_an_agreeing_first_error():
    wrong_at_1 = StepLabels([True, False, False], [0.5, 0.0, 0.0], 3)
    right = StepLabels([True, True], [0.5, 1.0], 2)
    assert agrees(wrong_at_1, 1)
    assert not agrees(wrong_at_1, 2) and not agrees(wrong_at_1, NO_ERROR)
    assert not agrees(wrong_at_1, None)  # a judge without an answer never agrees
    assert agrees(right, NO_ERROR) and not agrees(right, 0)


def test_omega_selection_score_by_hand():
    s = OmegaSettings(k=4, alpha=0.5, beta=0.9, length_scale=500, c_puct=0.125)
    search = OmegaSearch(lambda prefix, k: [], s)
    a, b = State([], None, mc=0.25, visits=1), State(["x"], None, mc=0.75, visits=3)
    search.states = [a, b]
    rollout = Rollout(["one two three", "four five"], False)  # 5 words
    # Q = 0.5^(1 - 0.25) * 0.9^(5 / 500); U = 0.125 * sqrt(1 + 3) / (1 + 1)
    q = 0.5**0.75 * 0.9**0.01
    assert search.score(a, rollout) == pytest.approx(q + 0.125 * 2 / 2, rel=1e-12)
    # the other state: U = 0.125 * 2 / 4; its higher MC raises Q
    assert search.score(b, rollout) == pytest.approx(0.5**0.25 * 0.9**0.01 + 0.125 * 2 / 4, rel=1e-12)


def world(prefix, k):
    """Scripted rollouts: a prefix holding the wrong step "x" never reaches the answer; from a right prefix of j
    steps ("g"), the first half of the k rollouts finish right (the remaining "g" steps to 3 in all), the second
    half go wrong at their second step: ["g", "x", "g"] cut to what remains after the prefix."""
    if "x" in prefix:
        return [Rollout(["y"], False)] * k
    rest = 3 - len(prefix)
    right = Rollout(["g"] * rest, True)
    wrong = Rollout((["g", "x", "g"] if rest >= 2 else ["x"])[:rest] or ["x"], False)
    return [right] * (k // 2) + [wrong] * (k - k // 2)


def test_omega_tree_search_labels_the_first_wrong_step_of_each_searched_rollout():
    calls = []

    def rollouts(prefix, k):
        calls.append(list(prefix))
        return world(prefix, k)

    search = OmegaSearch(rollouts, OmegaSettings(k=4, max_search_count=1, rollout_budget=100))
    found = search.run()
    # the root: 2 right rollouts g g g (all +, the last one's MC 1 by its checked answer), 2 wrong g x g in the pool
    right = [f for f in found if all(f.labels.hard)]
    assert len(right) == 2 and all(f.steps == ["g", "g", "g"] for f in right)
    assert right[0].labels.soft == [None, None, 1.0]
    # one search (max_search_count 1) of g x g from the root: lo=0, hi=3: mid 1 -> prefix g x: MC 0 -> hi 1;
    # mid 0 -> prefix g: MC 1/2 (2 of 4 right) -> lo 1: first error at step 1, two estimates
    (searched,) = [f for f in found if not all(f.labels.hard)]
    assert searched.steps == ["g", "x", "g"]
    assert searched.labels.hard == [True, False, False]
    assert searched.labels.soft == [0.5, 0.0, 0.0]
    assert searched.labels.estimates == 2
    assert calls == [[], ["g", "x"], ["g"]]
    assert search.estimates == 3 and search.rollouts_made == 12


def test_omega_tree_search_stops_at_the_rollout_budget():
    search = OmegaSearch(world, OmegaSettings(k=4, max_search_count=50, rollout_budget=12))
    search.run()
    # the root (4) and the first search (2 estimates: 8) spend the budget of 12: no second search starts
    assert search.rollouts_made == 12 and search.estimates == 3


def test_omega_search_of_a_deeper_state_keeps_the_path_values():
    # search count 3: after the root's search, the pool holds the wrong rollouts of state "g" (MC 1/2): its
    # rollout is x (one step left to the 3) -> ["g"] + ["x"]... the searched records all put their first error at
    # the "x" and carry the MC of every state on their path
    found = OmegaSearch(world, OmegaSettings(k=4, max_search_count=3, rollout_budget=1000)).run()
    searched = [f for f in found if not all(f.labels.hard)]
    assert len(searched) == 3
    for f in searched:
        e = f.steps.index("x")
        assert f.labels.first_error == e
        assert f.labels.hard == [i < e for i in range(len(f.steps))]
        assert all(v == 0.5 for v in f.labels.soft[:e] if v is not None)  # every right prefix: 2 of 4 right


# --- training on soft labels (llm/alignment/rm/loss.py soft_step_loss, the PRM trainer with soft_labels) -------
def test_soft_step_loss_hand_values():
    import torch

    from llm.alignment.rm.loss import soft_step_loss, step_loss

    # logits (2, 0): p(+) = sigmoid(2) = 0.880797. Target 0.25: -(0.25 log 0.880797 + 0.75 log 0.119203)
    # = 0.25 * 0.126928 + 0.75 * 2.126928 = 1.626928. Target 1: 0.126928 (= CE of '+'); a step without a label: 0
    logits = torch.tensor([[2.0, 0.0], [2.0, 0.0], [2.0, 0.0]])
    values = torch.tensor([0.25, 1.0, 0.5])
    got = soft_step_loss(logits, torch.tensor([0, 0, -1]), values)
    assert torch.allclose(got, torch.tensor([1.626928, 0.126928, 0.0]), atol=1e-6)
    # no soft label (NaN): the hard label's target, exactly the cross-entropy of step_loss
    hard = torch.tensor([0, 1, 1])
    nan = torch.full((3,), float("nan"))
    assert torch.allclose(soft_step_loss(logits, hard, nan), step_loss(logits, hard), atol=1e-6)


def test_prm_trainer_with_soft_labels_equals_bce_on_each_step_alone(tmp_path):
    import torch

    from llm.alignment.rm.loss import soft_step_loss
    from llm.alignment.rm.prm_trainer import PRMTrainer
    from llm.data.encode_reward import encode_prm
    from llm.data.encoding import EncodeConfig, OverlongCounter
    from llm.data.packing import collate, pack
    from llm.data.readers import PRMRecord
    from llm.settings.reward import RewardTrainingArguments
    from tests.helpers import tiny_model, tokenizer, twin

    tok = tokenizer()
    records = [
        PRMRecord([{"role": "user", "content": "2 + 3?"}], ["2 + 3 = 5.", "The answer is 5."], ["+", "+"], "f", 0,
                  soft_labels=[0.75, 1.0]),
        PRMRecord([{"role": "user", "content": "4 * 2?"}], ["4 * 2 = 6.", "So 6.", "The answer is 6."],
                  ["-", "-", "-"], "f", 1, soft_labels=[0.25, None, 0.0]),
    ]  # fmt: skip
    ph = tok.convert_tokens_to_ids("ки")
    examples = [encode_prm(r, tok, EncodeConfig(256, 64), ph, "ки", ("+", "-"), i, OverlongCounter()) for i, r in
                enumerate(records)]  # fmt: skip
    assert examples[1].readout_value[0] == 0.25 and examples[1].readout_value[1] != examples[1].readout_value[1]
    model = tiny_model("llama").eval()
    stock = twin(model, "sdpa").eval()
    plus, minus = tok.convert_tokens_to_ids("+"), tok.convert_tokens_to_ids("-")
    args = RewardTrainingArguments(
        output_dir=str(tmp_path), report_to="none", process_reward=True, soft_labels=True, save_strategy="no"
    )
    trainer = PRMTrainer(model=model, args=args, reward_token_ids=(plus, minus))
    rows, _ = pack(examples, 256, "greedy")
    with torch.no_grad():
        out = trainer.forward_items(model, collate(rows, pad_token_id=tok.pad_token_id))
        oracle = []
        for ex in examples:  # each solution alone, the two reward-token logits at its placeholders
            logits = stock(input_ids=torch.tensor([ex.input_ids])).logits[0][ex.readout_position][:, [plus, minus]]
            targets = torch.tensor(ex.readout_target)
            oracle.append(soft_step_loss(logits, targets, torch.tensor(ex.readout_value)))
    expected = torch.cat(oracle)
    assert torch.allclose(out.loss.sort().values, expected.sort().values, atol=1e-5)
    assert out.loss.numel() == 5
    # without soft_labels the same batch trains on the hard labels: another loss wherever a soft value is not 0/1
    args.soft_labels = False
    with torch.no_grad():
        hard = trainer.forward_items(model, collate(rows, pad_token_id=tok.pad_token_id)).loss
    assert not torch.allclose(hard.sort().values, out.loss.sort().values, atol=1e-3)


def test_the_judge_prompt_and_its_boxed_verdict():
    from llm.alignment.label.verify import critique_prompt, read_verdict

    prompt = critique_prompt("What is 2 + 3?", ["2 + 3 = 6.", "The answer is 6."])
    assert "[Math Problem]\n\nWhat is 2 + 3?" in prompt
    assert "<paragraph_0>\n2 + 3 = 6.\n</paragraph_0>\n\n<paragraph_1>\nThe answer is 6.\n</paragraph_1>" in prompt
    assert prompt.endswith("Please put your final answer (i.e., the index) in \\boxed{}.")
    assert read_verdict("Paragraph 0 is wrong: \\boxed{0}", 2) == 0
    assert read_verdict("first \\boxed{1}, on reflection \\boxed{ -1 }", 2) == -1  # the last one counts
    assert read_verdict("no box", 2) is None and read_verdict("\\boxed{5}", 2) is None  # no such step
