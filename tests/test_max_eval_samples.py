"""``max_eval_samples`` (the first N dev records, best-of-N groups kept whole) and the evaluation time estimate."""

import json
import os
import re
from types import SimpleNamespace

import pytest

from llm.alignment.trainer import duration_text, eval_plan_text
from llm.data.prepare import cap_records, train_and_dev
from llm.data.readers.records import PRMRecord
from llm.run_reward import main
from llm.settings.dialects.paddle import PADDLE_REWARD_NAMES
from llm.settings.fingerprint import run_fingerprint
from llm.settings.flat import DataArgument
from llm.settings.load import parse_arguments
from llm.settings.reward import REWARD_ARGUMENT_TYPES
from llm.utils.errors import UserError, run_cli
from tests.test_run_reward import SAMPLE, config, read_jsonl, small_split


def candidate(index: int, group: str | None, correct: bool | None = True) -> PRMRecord:
    return PRMRecord([], ["step"], [None], "dev.jsonl", index, group=group, answer="1", correct=correct)


def test_cap_keeps_the_first_records_and_leaves_out_a_cut_group(caplog):
    caplog.set_level("INFO", "llm.data.prepare")
    records = [candidate(i, None, None) for i in range(4)]  # plain PRM solutions: no group
    assert cap_records(records, None, "dev.jsonl") is records and cap_records(records, 9, "dev.jsonl") is records
    assert [r.index for r in cap_records(records, 3, "dev.jsonl")] == [0, 1, 2]
    assert "evaluating on 3 of 4 dev records (max_eval_samples)" in caplog.text
    caplog.clear()
    # groups a (0-2), b (3-5), c (6): a cut after 5 records splits b, which is left out whole
    grouped = [candidate(i, g) for i, g in enumerate("aaabbbc")]
    assert [r.index for r in cap_records(grouped, 5, "dev.jsonl")] == [0, 1, 2]
    assert "max_eval_samples=5 cuts 1 best-of-N group(s) (b)" in caplog.text and "evaluating on 3 of 7" in caplog.text
    assert [r.index for r in cap_records(grouped, 6, "dev.jsonl")] == [0, 1, 2, 3, 4, 5]
    with pytest.raises(UserError, match=r"dev.jsonl: max_eval_samples=2 keeps no dev record"):
        cap_records(grouped, 2, "dev.jsonl")


def test_the_dev_split_alone_is_capped():
    calls = []

    def build(path, split, batch_size, probs=None, lazy=False, max_records=None):
        calls.append((path, split, max_records))
        return SimpleNamespace(overlong=None)

    data_args = DataArgument(train_dataset_path="t.jsonl", dev_dataset_path="d.jsonl", max_eval_samples=7)
    training_args = SimpleNamespace(
        do_train=True, do_eval=True, eval_strategy="no", per_device_train_batch_size=1, per_device_eval_batch_size=1
    )
    train_and_dev(data_args, training_args, build)
    assert calls == [("t.jsonl", "train", None), ("d.jsonl", "eval", 7)]  # each build told which split it reads


def test_plan_text_hand_values():
    assert eval_plan_text(150, 0.8, "x") == "evaluation: 150 batches, ~2 min at 0.8 s/batch (x)"  # 120 s
    assert eval_plan_text(1, None) == "evaluation: 1 batch"
    seconds = (0.4, 44.6, 89, 90, 5399, 5400)
    assert [duration_text(s) for s in seconds] == ["<1 s", "45 s", "89 s", "2 min", "90 min", "1.5 h"]
    assert eval_plan_text(5, 0.01) == "evaluation: 5 batches, <1 s at 0.01 s/batch"


def plan_lines(err: str) -> list[str]:
    return re.findall(r"evaluation: \d+ batch.*", err)


def test_prm_run_evaluates_exactly_the_first_records(tmp_path, capsys):
    out = tmp_path / "out"
    train = small_split(tmp_path, "prm_train.jsonl", 16)
    main(
        [
            config(
                tmp_path,
                train_dataset_path=train,
                max_eval_samples=5,
                max_steps=6,
                evaluation_strategy="steps",
                eval_steps=4,
                per_device_eval_batch_size=1,
                zero_padding=False,
                greedy_zero_padding=False,
            )
        ]
    )
    scores = read_jsonl(out / "eval_scores.jsonl")
    assert [s["index"] for s in scores] == [0, 1, 2, 3, 4]
    err = capsys.readouterr().err
    assert "evaluating on 5 of 300 dev records (max_eval_samples)" in err
    # three evaluations (step 4, after 3 timed training intervals; the last step, 6; the final one) of 5 unpacked
    # records, one per batch
    lines = plan_lines(err)
    assert len(lines) == 3 and all(re.match(r"evaluation: 5 batches, (~|<)", line) for line in lines), lines
    assert "(estimated from the training speed)" in lines[0]
    assert all("(measured in the last evaluation)" in line for line in lines[1:])


def test_eval_only_best_of_n_keeps_whole_groups_and_times_its_first_batches(tmp_path, capsys):
    out = tmp_path / "out"
    bon = os.path.join(SAMPLE, "bon_dev.jsonl")
    with open(bon, encoding="utf-8") as f:
        groups = [json.loads(line)["group"] for line in f]
    first = groups.index(groups[0]) + groups.count(groups[0])  # the first group's size: candidates are in order
    assert groups[:first] == [groups[0]] * first and groups[first] != groups[0]
    main(
        [
            config(
                tmp_path,
                do_train=False,
                dev_dataset_path=bon,
                max_eval_samples=first + 2,
                per_device_eval_batch_size=1,
                zero_padding=False,
                greedy_zero_padding=False,
            )
        ]
    )
    scores = read_jsonl(out / "eval_scores.jsonl")
    assert [s["index"] for s in scores] == list(range(first))  # the cut second group is left out whole
    results = json.loads((out / "eval_results.json").read_text())
    assert results["eval_bon_groups"] == 1 and f"eval_pass@{first}" in results
    err = capsys.readouterr().err
    assert f"cuts 1 best-of-N group(s) ({groups[first]})" in err
    # no earlier measurement: the batch count first, then the estimate timed on the first 3 batches
    assert plan_lines(err) == [f"evaluation: {first} batches", *plan_lines(err)[1:]]
    assert len(plan_lines(err)) == 2 and "(timed on the first 3 batches)" in plan_lines(err)[1]


@pytest.mark.parametrize("value", [0, -3])
def test_a_cap_below_one_is_refused(tmp_path, capsys, value):
    with pytest.raises(SystemExit) as e:
        run_cli(main, [config(tmp_path, max_eval_samples=value)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "'max_eval_samples' must be a positive number" in err


def test_max_eval_samples_is_not_fingerprinted(tmp_path):
    def parse(path):
        return parse_arguments([path], REWARD_ARGUMENT_TYPES, paddle=PADDLE_REWARD_NAMES)

    a = run_fingerprint(*parse(config(tmp_path)))
    b = run_fingerprint(*parse(config(tmp_path, max_eval_samples=5)))
    assert a.digest == b.digest and "max_eval_samples" not in a.values
