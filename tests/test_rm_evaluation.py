"""ProcessBench and best-of-N metrics on small score tables, every value derived by hand."""

import math

import pytest

from llm.alignment.rm.evaluation import (
    Candidate,
    Solution,
    best_of_n_metrics,
    best_threshold,
    drawn_order,
    first_error,
    processbench_metrics,
    sizes,
)

# A (label 1) and C (label -1) in gsm8k; B (label 0) and D (label -1) in math.
A = Solution([0.9, 0.3, 0.8], 1, "gsm8k", "Qwen2-7B-Instruct")
B = Solution([0.9, 0.6], 0, "math", "Qwen2-7B-Instruct")
C = Solution([0.7, 0.5], -1, "gsm8k", "Llama-3.1-8B")
D = Solution([0.4], -1, "math", "Llama-3.1-8B")


def test_first_error_is_strictly_below_the_threshold():
    assert first_error([0.7, 0.5], 0.5) == -1  # exactly at the threshold: correct
    assert first_error([0.7, 0.5], 0.5000001) == 1
    assert first_error([0.4, 0.9], 0.5) == 0
    assert first_error([], 0.5) == -1


def test_processbench_by_hand():
    """At 0.5: A predicted 1 (right), B -1 (wrong: label 0), C -1 (right; 0.5 is not below 0.5), D 0 (wrong).
    acc_error 1/2, acc_correct 1/2, F1 1/2. gsm8k {A, C}: 1, 1, F1 1; math {B, D}: 0, 0, F1 0; mean F1 1/2.
    Qwen2-7B-Instruct {A, B}: acc_error 1/2 and no correct solution: acc_correct and F1 nan."""
    m = processbench_metrics([A, B, C, D], 0.5)
    assert (m["processbench_acc_error"], m["processbench_acc_correct"], m["processbench_f1"]) == (0.5, 0.5, 0.5)
    assert (m["processbench_erroneous"], m["processbench_correct"]) == (2, 2)
    assert (m["processbench_gsm8k_f1"], m["processbench_math_f1"], m["processbench_mean_f1"]) == (1.0, 0.0, 0.5)
    assert m["processbench_generator_qwen2_7b_instruct_acc_error"] == 0.5
    assert math.isnan(m["processbench_generator_qwen2_7b_instruct_acc_correct"])
    assert math.isnan(m["processbench_generator_qwen2_7b_instruct_f1"])
    assert m["processbench_generator_llama_3_1_8b_acc_correct"] == 0.5
    assert m["processbench_threshold"] == 0.5


def test_all_correct_all_wrong_and_both_zero():
    """Only correct solutions: acc_error nan, F1 nan. Every prediction wrong: F1 0, not a division by zero."""
    only_correct = processbench_metrics([C, D], 0.5)
    assert only_correct["processbench_acc_correct"] == 0.5 and math.isnan(only_correct["processbench_acc_error"])
    assert math.isnan(only_correct["processbench_f1"])
    wrong = processbench_metrics([Solution([0.9], 0), Solution([0.1], -1)], 0.5)
    assert (wrong["processbench_acc_error"], wrong["processbench_acc_correct"], wrong["processbench_f1"]) == (0, 0, 0)


def test_best_threshold_by_hand():
    """Candidates 0.3 ... 0.9 and one above: F1 is 0 at 0.3 (nothing flagged: A missed), 2/3 at 0.4 (A's 0.3
    flagged at step 1; D's 0.4 is not below 0.4), 1/2 at 0.5, 0 from 0.6 up (C flagged too early)."""
    t, best = best_threshold([A, B, C, D])
    assert t == 0.4 and best == pytest.approx(2 / 3)
    assert processbench_metrics([A, B, C, D], t)["processbench_f1"] == pytest.approx(2 / 3)


def test_sizes():
    assert sizes(4) == [1, 2, 4] and sizes(6) == [1, 2, 4, 6] and sizes(1) == [1] and sizes(0) == []


def _groups():
    g1 = [
        Candidate([0.9, 0.2], "3", False),
        Candidate([0.6, 0.6], "4", True),
        Candidate([0.5, 0.5], "4", True),
        Candidate([0.95, 0.9], "5", False),
    ]
    g2 = [Candidate([0.1 * k], "7", True) for k in range(1, 5)]  # all right
    g3 = [Candidate([0.5], a, False) for a in "1212"]  # all wrong
    return {"g1": g1, "g2": g2, "g3": g3}


def test_best_of_n_by_hand():
    """g1 in the given order: min scores 0.2, 0.6, 0.5, 0.9; product 0.18, 0.36, 0.25, 0.855; last = min here;
    mean 0.55, 0.6, 0.5, 0.925. N=1: c1 (wrong) everywhere. N=2: every aggregation picks c2 (right); the vote
    ties 3:1, 4:1 and takes the first drawn (3, wrong); weighted min 3:0.2 < 4:0.6 (right). N=4: every
    aggregation picks c4 (wrong); the vote is 4 (x2, right); weighted min 3:0.2, 4:1.1, 5:0.9 (right),
    product 3:0.18, 4:0.61, 5:0.855 (wrong), mean 3:0.55, 4:1.1, 5:0.925 (right). g2 always right, g3 never."""
    aggs = ["min", "product", "last", "mean"]
    m = best_of_n_metrics(_groups(), aggs, seed=None)
    third = pytest.approx(1 / 3)
    two_thirds = pytest.approx(2 / 3)
    for agg in aggs:
        assert m[f"bon_{agg}@1"] == third and m[f"bon_{agg}@2"] == two_thirds and m[f"bon_{agg}@4"] == third
        assert m[f"weighted_vote_{agg}@1"] == third and m[f"weighted_vote_{agg}@2"] == two_thirds
    assert m["weighted_vote_min@4"] == two_thirds and m["weighted_vote_product@4"] == third
    assert m["weighted_vote_last@4"] == two_thirds and m["weighted_vote_mean@4"] == two_thirds
    assert (m["majority_vote@1"], m["majority_vote@2"], m["majority_vote@4"]) == (third, third, two_thirds)
    assert (m["pass@1"], m["pass@2"], m["pass@4"]) == (third, two_thirds, two_thirds)
    assert m["bon_groups"] == 3 and "bon_min@3" not in m


def test_best_of_n_ties_go_to_the_first_drawn_and_an_orm_uses_its_one_score():
    group = {"g": [Candidate([0.5], "1", False), Candidate([0.5], "2", True)]}
    m = best_of_n_metrics(group, ["min", "score"], seed=None)
    assert m["bon_min@2"] == 0.0 and m["bon_score@2"] == 0.0 and m["pass@2"] == 1.0
    swapped = {"g": group["g"][::-1]}
    assert best_of_n_metrics(swapped, ["score"], seed=None)["bon_score@2"] == 1.0


def test_drawn_order_is_seeded_and_fixed():
    groups = {f"g{i}": [Candidate([k / 10], str(k), k % 2 == 0) for k in range(8)] for i in range(3)}
    a, b, c = drawn_order(groups, 1), drawn_order(groups, 1), drawn_order(groups, 2)
    assert a == b and a != c
    assert all(sorted(x.answer for x in a[k]) == sorted(x.answer for x in groups[k]) for k in groups)
    assert best_of_n_metrics(groups, ["min"], 1) == best_of_n_metrics(groups, ["min"], 1)
