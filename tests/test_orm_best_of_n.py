"""An ORM's best-of-N: hand-computed values on a small score table (ties, all-right and all-wrong groups,
negative logits), eval-only and during-training runs of llm/run_reward.py on the bundled best-of-N file whose
metrics are recomputed here from eval_scores.jsonl, the candidate text, and bad input (exit 2, one message)."""

import json
import math
import os

import pytest

from llm.alignment.rm.evaluation import (
    Candidate,
    best_of_n_metrics,
    drawn_order,
    orm_best_of_n_metrics,
    sigmoid,
)
from llm.run_reward import main
from llm.utils.errors import run_cli
from tests.test_run_reward import SAMPLE, config, read_json, read_jsonl, small_split

BON_DEV = os.path.join(SAMPLE, "bon_dev.jsonl")


def _c(answer, correct, score):
    return Candidate([score], answer, correct)


def _table():
    # the order given (seed None) is the drawn order
    return {
        # negative logits: "7" three times at -2, "9" once at -1
        "g1": [_c("7", True, -2.0), _c("9", False, -1.0), _c("7", True, -2.0), _c("7", True, -2.0)],
        "g2": [_c("1", True, -5.0), _c("2", True, -5.0), _c("3", True, 2.0), _c("1", True, 0.0)],  # all right
        "g3": [_c("4", False, -1000.0), _c("5", False, 3.0), _c("4", False, 0.0), _c("6", False, 1000.0)],  # all wrong
        # ties: equal best scores, equal vote weights, a 2:2 majority
        "g4": [_c("1", False, 0.5), _c("2", True, 0.5), _c("2", True, -10.0), _c("1", False, -10.0)],
    }


def test_sigmoid_is_the_logistic_function_without_overflow():
    assert sigmoid(0.0) == 0.5
    assert sigmoid(2.0) == pytest.approx(1 / (1 + math.exp(-2.0)))
    assert sigmoid(-2.0) == pytest.approx(1 / (1 + math.exp(2.0)))
    assert sigmoid(-1000.0) == 0.0 and sigmoid(1000.0) == 1.0  # no OverflowError
    assert 0 < sigmoid(-30.0) < sigmoid(-29.0)


def test_orm_best_of_n_by_hand():
    """N=1: the first drawn: g1, g2 right, g3, g4 wrong: 1/2 everywhere.
    N=2: bon g1 picks -1 ("9", wrong), g4 ties at 0.5 and keeps the first drawn ("1", wrong): 1/4; weighted g1
    sigmoid(-1) 0.269 > sigmoid(-2) 0.119 ("9", wrong), g4 tie -> "1": 1/4; majority g1 ties 1:1 -> "7" (right),
    g4 -> "1": 1/2; pass g1, g2, g4: 3/4.
    N=4: bon g1 "9", g2 2.0 (right), g3 1000 (wrong), g4 tie -> "1": 1/4; weighted g1 "7" 3 x 0.119 = 0.358 >
    "9" 0.269 (right; summed raw logits would pick "9": -1 > -6), g4 0.5+(-10) each way, tie -> "1": 1/2;
    majority g1 "7" 3:1, g4 2:2 -> "1": 1/2; pass 3/4."""
    m = orm_best_of_n_metrics(_table(), seed=None)
    assert m["bon_groups"] == 4
    assert [m[f"bon@{n}"] for n in (1, 2, 4)] == [0.5, 0.25, 0.25]
    assert [m[f"weighted_vote@{n}"] for n in (1, 2, 4)] == [0.5, 0.25, 0.5]
    assert [m[f"majority_vote@{n}"] for n in (1, 2, 4)] == [0.5, 0.5, 0.5]
    assert [m[f"pass@{n}"] for n in (1, 2, 4)] == [0.5, 0.75, 0.75]
    assert set(m) == {"bon_groups"} | {
        f"{k}@{n}" for k in ("bon", "weighted_vote", "majority_vote", "pass") for n in (1, 2, 4)
    }
    # the same table with the raw logit as the vote weight (the PRM function's "score"): g1 at N=4 goes wrong
    raw = best_of_n_metrics(_table(), ["score"], seed=None)
    assert raw["weighted_vote_score@4"] == 0.25 and raw["bon_score@4"] == m["bon@4"]


def test_orm_and_prm_give_the_same_majority_vote_and_pass_at_n():
    groups = {f"g{i}": [_c(str(k % 3), k % 3 == i % 3, k / 7 - 1) for k in range(8)] for i in range(5)}
    for seed in (None, 3):
        orm = orm_best_of_n_metrics(groups, seed)
        prm = best_of_n_metrics(groups, ["min", "mean"], seed)
        shared = [k for k in orm if k.startswith(("majority_vote@", "pass@")) or k == "bon_groups"]
        assert len(shared) == 1 + 2 * 4 and all(orm[k] == prm[k] for k in shared)


def test_orm_candidate_has_exactly_one_score():
    with pytest.raises(ValueError, match="exactly one score"):
        orm_best_of_n_metrics({"g": [Candidate([0.1, 0.2], "1", True)]}, None)


def _expected_from_scores(rows, seed):
    """The ORM's best-of-N written out from eval_scores.jsonl: highest logit (first drawn on ties); answer with
    the largest sum of 1 / (1 + exp(-logit)) (first drawn on ties); most frequent answer; any right."""
    groups = {}
    for row in rows:
        groups.setdefault(row["group"], []).append(Candidate([row["score"]], row["answer"], row["correct"]))
    ordered = drawn_order(groups, seed)
    smallest = min(len(g) for g in ordered.values())
    out = {}
    for n in [k for k in (1, 2, 4, 8, 16) if k <= smallest]:
        bon = vote = major = any_right = 0
        for group in ordered.values():
            first = group[:n]
            top = max(c.scores[0] for c in first)
            bon += next(c for c in first if c.scores[0] == top).correct
            weights, counts = {}, {}
            for c in first:
                weights[c.answer] = weights.get(c.answer, 0.0) + 1 / (1 + math.exp(-c.scores[0]))
                counts[c.answer] = counts.get(c.answer, 0) + 1
            vote += next(c for c in first if weights[c.answer] == max(weights.values())).correct
            major += next(c for c in first if counts[c.answer] == max(counts.values())).correct
            any_right += any(c.correct for c in first)
        k = len(ordered)
        out.update({f"bon@{n}": bon / k, f"weighted_vote@{n}": vote / k, f"majority_vote@{n}": major / k})
        out[f"pass@{n}"] = any_right / k
    return out


def test_eval_only_orm_best_of_n_equals_what_its_scores_imply(tmp_path):
    """The bundled best-of-N file (24 problems x 8 candidates), eval-only, with the tiny ORM from its seed:
    every reported bon@N / weighted_vote@N / majority_vote@N / pass@N is recomputed from eval_scores.jsonl;
    majority_vote@N and pass@N equal the PRM's eval-only run on the same file and seed; the plot is written."""
    out = tmp_path / "orm"
    main([config(tmp_path, "rm_argument.json", dev_dataset_path=BON_DEV, do_train=False, seed=7, output_dir=str(out))])
    rows = read_jsonl(out / "eval_scores.jsonl")
    results = read_json(out / "eval_results.json")
    recs = read_jsonl(BON_DEV)
    assert len(rows) == 192 and (out / "eval_best_of_n.png").stat().st_size > 1000
    for row in rows:  # the scores file names each candidate's group, answer and correctness
        rec = recs[row["index"]]
        assert (row["group"], row["answer"], row["correct"]) == (rec["group"], rec["answer"], rec["correct"])
        assert math.isfinite(row["score"]) and "chosen_score" not in row
    assert len({row["score"] for row in rows}) > 24  # the scores differ from candidate to candidate
    expected = _expected_from_scores(rows, seed=7)
    assert len(expected) == 16 and results["eval_bon_groups"] == 24
    for key, value in expected.items():
        assert results[f"eval_{key}"] == pytest.approx(value), key
    assert not any(k.startswith(("eval_bon_min", "eval_accuracy", "eval_processbench")) for k in results)
    assert "eval_loss" not in results  # candidates only: no loss item (before: 0.0, a "perfect" loss)

    prm = tmp_path / "prm"
    main([config(tmp_path, dev_dataset_path=BON_DEV, do_train=False, seed=7, output_dir=str(prm))])
    prm_results = read_json(prm / "eval_results.json")
    for n in (1, 2, 4, 8):
        for key in (f"eval_majority_vote@{n}", f"eval_pass@{n}"):
            assert results[key] == prm_results[key], key


def test_candidate_text_is_the_pair_answer_text_and_pairs_mix_with_candidates(tmp_path):
    """A candidate is scored as the answer "\\n".join(steps) after its question, exactly the chosen side of a
    pair with that answer: in one dev file holding both, the two scores agree; pair accuracy and margin are
    over the pairs only, best-of-N over the candidates only."""
    cands = read_jsonl(BON_DEV)[:8]  # problem-0
    pairs = []
    for a, b in ((0, 1), (3, 1), (2, 4)):
        pairs.append(
            {
                "src": cands[a]["src"],
                "tgt": [],
                "response": ["\n".join(cands[a]["responses"]), "\n".join(cands[b]["responses"])],
                "sort": [1, 0],
            }
        )
    dev = tmp_path / "mixed.jsonl"
    dev.write_text("".join(json.dumps(r) + "\n" for r in pairs[:2] + cands + pairs[2:]))
    out = tmp_path / "out"
    main([config(tmp_path, "rm_argument.json", dev_dataset_path=str(dev), do_train=False, output_dir=str(out))])
    rows = read_jsonl(out / "eval_scores.jsonl")
    assert [("chosen_score" in r, "score" in r) for r in rows] == [(True, False)] * 2 + [(False, True)] * 8 + [
        (True, False)
    ]
    score = {r["index"] - 2: r["score"] for r in rows if "score" in r}
    for row, (a, b) in zip([rows[0], rows[1], rows[10]], ((0, 1), (3, 1), (2, 4))):
        assert row["chosen_score"] == pytest.approx(score[a], abs=1e-5)
        assert row["rejected_score"] == pytest.approx(score[b], abs=1e-5)
    results = read_json(out / "eval_results.json")
    diffs = [r["chosen_score"] - r["rejected_score"] for r in rows if "chosen_score" in r]
    assert results["eval_accuracy"] == pytest.approx(sum(d > 0 for d in diffs) / 3)
    assert results["eval_margin"] == pytest.approx(sum(diffs) / 3)
    assert math.isfinite(results["eval_loss"]) and results["eval_loss"] > 0  # the pairs' loss
    assert results["eval_bon_groups"] == 1 and "eval_bon@8" in results


def test_eval_during_training_reads_best_of_n_candidates(tmp_path):
    """An ORM trained on pairs with the best-of-N file as its dev split: each evaluation reports bon@N."""
    train = small_split(tmp_path, "pairs_train.jsonl", 16)
    dev = small_split(tmp_path, "bon_dev.jsonl", 32)  # 4 problems x 8
    out = tmp_path / "out"
    main(
        [
            config(
                tmp_path,
                "rm_argument.json",
                train_dataset_path=train,
                dev_dataset_path=dev,
                max_steps=2,
                evaluation_strategy="steps",
                eval_steps=1,
            )
        ]
    )
    history = read_json(out / "trainer_state.json")["log_history"]
    evals = [h for h in history if "eval_bon@8" in h]
    assert [h["step"] for h in evals] == [1, 2]
    results = read_json(out / "eval_results.json")
    assert results["eval_bon_groups"] == 4
    assert results["eval_bon@8"] == pytest.approx(
        _expected_from_scores(read_jsonl(out / "eval_scores.jsonl"), 42)["bon@8"]
    )


CANDIDATE = {"src": ["What is 2 + 3?"], "tgt": [], "responses": ["2 + 3 = 5.", "The answer is 5."]}


@pytest.mark.parametrize(
    "records, needles",
    [
        (None, ["processbench_dev.jsonl: record 0", "ProcessBench", "process_reward: true"]),
        ([{**CANDIDATE, "labels": ["+", "+"]}], ["record 0", "field 'correct'", "add its final 'answer'"]),
        ([{**CANDIDATE, "answer": "5"}], ["record 0", "field 'correct'", "is missing while 'answer' is given"]),
        ([{**CANDIDATE, "answer": "5", "correct": "yes"}], ["field 'correct'", "true or false"]),
        ([{**CANDIDATE, "answer": "5", "correct": True, "chosen": "5"}], ["record 0", "mixes preference-pair"]),
        ([{"question": "q", "answer": "5", "correct": True}], ["record 0", "missing required fields", "'question'"]),
        ([{"input": "q 1 + 1 = 2. ки", "label": "q 1 + 1 = 2. +", "answer": "2", "correct": True}], ["field 'group'"]),
    ],
)
def test_bad_orm_dev_records_exit_2_with_one_message(tmp_path, capsys, records, needles):
    if records is None:
        dev = os.path.join(SAMPLE, "processbench_dev.jsonl")
    else:
        dev = tmp_path / "bad.jsonl"
        dev.write_text("".join(json.dumps(r) + "\n" for r in records))
    with pytest.raises(SystemExit) as exit_info:
        run_cli(main, [config(tmp_path, "rm_argument.json", dev_dataset_path=str(dev), do_train=False)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and all(n in errors[0] for n in needles), err
    assert "Traceback" not in err


def test_candidates_in_the_training_file_of_an_orm_stop_the_run(tmp_path, capsys):
    """Training and dev the same file (read as dev records): a candidate in it is no training pair."""
    path = tmp_path / "both.jsonl"
    with open(small_split(tmp_path, "pairs_train.jsonl", 3), encoding="utf-8") as f:
        lines = f.read()
    path.write_text(lines + json.dumps({**CANDIDATE, "answer": "5", "correct": True}) + "\n")
    cfg = config(tmp_path, "rm_argument.json", train_dataset_path=str(path), dev_dataset_path=str(path), max_steps=1)
    with pytest.raises(SystemExit) as exit_info:
        run_cli(main, [cfg])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "both.jsonl: record 3" in err and "trains on preference pairs only" in err and "Traceback" not in err


def test_candidate_encoding_with_and_without_a_separate_question(tmp_path):
    """With a question: the ids of a pair's [prompt | chosen + eos] with chosen = "\\n".join(steps), one readout
    at its last token. Math-Shepherd layout (the question starts the first step): BOS + the joined steps + EOS."""
    from llm.alignment.rm.data import CANDIDATE as CANDIDATE_PART
    from llm.alignment.rm.data import encode_orm_candidate
    from llm.data.encode_reward import encode_pair_for_scores
    from llm.data.encoding import EncodeConfig, OverlongCounter
    from llm.data.readers import PairRecord, read_records
    from llm.utils.modeling import load_tokenizer
    from tests.helpers import ROOT

    tok = load_tokenizer(os.path.join(ROOT, "llm", "assets", "tiny_tokenizer"))
    cfg, counter = EncodeConfig(256, 128), OverlongCounter()
    path = tmp_path / "c.jsonl"
    shepherd = {"input": "What is 2 + 3? 2 + 3 = 5. ки\nThe answer is 5. ки", "group": "p", "answer": "5"}
    shepherd.update(label=shepherd["input"].replace("ки", "+"), correct=True)
    path.write_text(json.dumps({**CANDIDATE, "answer": "5", "correct": True}) + "\n" + json.dumps(shepherd) + "\n")
    with_question, without = read_records(str(path), "orm_eval")
    ex = encode_orm_candidate(with_question, tok, cfg, 0, counter)
    pair = PairRecord(with_question.prompt, "\n".join(with_question.steps), "x", "", 0)
    pair_ex = encode_pair_for_scores(pair, tok, cfg, 0, counter)
    assert ex.input_ids == pair_ex.input_ids[: pair_ex.readout_position[0] + 1]
    assert ex.readout_position == pair_ex.readout_position[:1] and ex.readout_part == [CANDIDATE_PART]
    ex = encode_orm_candidate(without, tok, cfg, 1, counter)
    assert ex.input_ids == [tok.bos_token_id] + tok("What is 2 + 3? 2 + 3 = 5.\nThe answer is 5.")["input_ids"][1:] + [
        tok.eos_token_id
    ]
    assert ex.readout_position == [len(ex.input_ids) - 1] and dict(counter) == {"ok": 3}
