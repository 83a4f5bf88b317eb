"""End-to-end runs of llm/run_reward.py on the tiny configs: training, evaluation-only, reload, resume,
bad input (exit code 2 with a message, no traceback), and two processes under torchrun."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from llm.run_reward import main
from llm.utils.errors import run_cli
from tests.helpers import ROOT, read_json, read_jsonl

SAMPLE = os.path.join(ROOT, "llm", "data", "sample")
TINY = os.path.join(ROOT, "llm", "config", "tiny")


def config(tmp_path, name="prm_argument.json", **overrides):
    with open(os.path.join(TINY, name), encoding="utf-8") as f:
        cfg = json.load(f)
    for key in ("model_name_or_path", "tokenizer_name_or_path", "train_dataset_path", "dev_dataset_path"):
        if not os.path.isabs(cfg[key]):
            cfg[key] = os.path.join(ROOT, cfg[key])
    if overrides.get("do_train") is False and cfg.get("init_from_config"):
        cfg["eval_random_init"] = True  # these tests evaluate the random tiny model on purpose
    cfg.update(
        output_dir=str(tmp_path / "out"),
        disable_tqdm=True,
        report_to="none",
        logging_steps=1,
        max_seq_len=256,
        max_prompt_len=128,
        save_strategy="no",
        evaluation_strategy="no",
    )
    cfg.update(overrides)
    path = tmp_path / f"cfg_{len(list(tmp_path.iterdir()))}.json"
    path.write_text(json.dumps(cfg, ensure_ascii=False))
    return str(path)


def small_split(tmp_path, name, n):
    with open(os.path.join(SAMPLE, name), encoding="utf-8") as f:
        lines = [next(f) for _ in range(n)]
    path = tmp_path / name
    path.write_text("".join(lines))
    return str(path)


def train_losses(output_dir):
    state = read_json(os.path.join(output_dir, "trainer_state.json"))
    return [h["loss"] for h in state["log_history"] if "loss" in h]


@pytest.mark.parametrize("mode", ["prm", "orm"])
def test_train_eval_reload_and_eval_only(tmp_path, mode):
    name = "prm_argument.json" if mode == "prm" else "rm_argument.json"
    data = ("prm_train.jsonl", "prm_dev.jsonl") if mode == "prm" else ("pairs_train.jsonl", "pairs_dev.jsonl")
    train, dev = small_split(tmp_path, data[0], 64), small_split(tmp_path, data[1], 24)
    out = tmp_path / "out"
    main(
        [
            config(
                tmp_path,
                name,
                train_dataset_path=train,
                dev_dataset_path=dev,
                max_steps=6,
                max_seq_len=512,
                max_prompt_len=128,
                save_strategy="steps",
                save_steps=3,
            )
        ]
    )
    results = read_json(out / "all_results.json")
    assert math.isfinite(results["train_loss"]) and math.isfinite(results["eval_loss"])
    assert (out / "checkpoint-3" / "model.safetensors").exists() and (out / "tokenizer.json").exists()
    scores = read_jsonl(out / "eval_scores.jsonl")
    assert len(scores) == 24 and scores[0]["source"] == dev

    # Parameters changed: the tiny model is random from a seed, rebuild it and compare.
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from llm.utils.modeling import load_model

    auto = AutoModelForCausalLM if mode == "prm" else AutoModelForSequenceClassification
    extra = {} if mode == "prm" else {"num_labels": 1}
    model_dir = read_json(os.path.join(ROOT, "llm", "config", "tiny", name))["model_name_or_path"]
    init = load_model(
        auto, os.path.join(ROOT, model_dir), init_from_config=True, seed=42, pad_token_id=0, **extra
    ).state_dict()
    trained = load_file(out / "model.safetensors")
    assert max((trained[k] - init[k]).abs().max().item() for k in trained) > 1e-4

    # The saved model loads with the plain Auto class (no custom code, no "newly initialised" head).
    reloaded = auto.from_pretrained(out)
    assert all(torch.equal(reloaded.state_dict()[k], v) for k, v in trained.items())

    # Evaluation-only run on the trained model reproduces the same per-example scores.
    eval_dir = tmp_path / "eval_only"
    main(
        [
            config(
                tmp_path,
                name,
                model_name_or_path=str(out),
                init_from_config=False,
                do_train=False,
                do_eval=True,
                dev_dataset_path=dev,
                max_seq_len=512,
                output_dir=str(eval_dir),
            )
        ]
    )
    again = read_jsonl(eval_dir / "eval_scores.jsonl")
    assert (eval_dir / "eval_results.json").exists() and (eval_dir / "all_results.json").exists()
    key = "step_scores" if mode == "prm" else "chosen_score"
    for a, b in zip(scores, again):
        assert a["index"] == b["index"]
        assert torch.allclose(torch.tensor(a[key]), torch.tensor(b[key]), atol=1e-6)


def test_resume_continues_the_same_run(tmp_path):
    train = small_split(tmp_path, "prm_train.jsonl", 80)
    common = {
        "train_dataset_path": train,
        "do_eval": False,
        "max_steps": 8,
        "save_strategy": "steps",
        "save_steps": 4,
        "lr_scheduler_type": "linear",
    }
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    main([config(tmp_path, output_dir=str(full), **common)])
    # As if a run had died after step 4: only its checkpoint-4 is left; resume from it.
    import shutil

    shutil.copytree(full / "checkpoint-4", resumed / "checkpoint-4")
    main([config(tmp_path, output_dir=str(resumed), resume_from_checkpoint="auto", **common)])
    a, b = train_losses(full), train_losses(resumed)
    assert len(a) == 8 and b[-4:] == pytest.approx(a[-4:], abs=1e-6)  # same batches after resume, same losses
    wa, wb = load_file(full / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) <= 1e-6


BAD_PRM = [
    ({"src": ["q"], "tgt": [], "responses": ["a", "b"], "labels": ["+"]}, "labels"),
    ({"src": ["q"], "tgt": [], "responses": ["a"], "labels": ["?"]}, "'?'"),
    ({"src": ["q"], "tgt": [], "responses": [""], "labels": ["+"]}, "empty"),
    ({"src": ["q"], "tgt": [], "responses": "a", "labels": ["+"]}, "responses"),
]
BAD_PAIR = [
    ({"src": ["q"], "tgt": [], "response": ["a", "b"], "sort": [1, 1]}, "sort"),
    ({"src": ["q"], "tgt": [], "response": ["a", ""], "sort": [1, 0]}, "empty"),
    ({"src": ["q"], "tgt": [], "response": ["a"], "sort": [1, 0]}, "response"),
]


@pytest.mark.parametrize("record, needle", BAD_PRM + BAD_PAIR)
def test_bad_records_exit_2_with_message(tmp_path, capsys, record, needle):
    prm = "responses" in record
    good = small_split(tmp_path, "prm_train.jsonl" if prm else "pairs_train.jsonl", 3)
    bad = tmp_path / "bad.jsonl"
    with open(good, encoding="utf-8") as f:
        bad.write_text(f.read() + json.dumps(record) + "\n")
    name = "prm_argument.json" if prm else "rm_argument.json"
    with pytest.raises(SystemExit) as exit_info:
        run_cli(main, [config(tmp_path, name, train_dataset_path=str(bad), do_eval=False, max_steps=1)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "bad.jsonl" in err and "record 3" in err and needle in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "overrides, needle",
    [
        ({"placeholder_token": "hello world"}, "placeholder_token: 'hello world' must be exactly one token"),
        ({"reward_tokens": "+,-,x"}, "reward_tokens must be two"),
        ({"train_dataset_path": "/nonexistent/data.jsonl"}, "/nonexistent/data.jsonl"),
        ({"model_name_or_path": "/nonexistent/model"}, "/nonexistent/model"),
        ({"dataset_probs": "0.5,0.5"}, "probabilities"),
    ],
)
def test_bad_settings_exit_2_with_message(tmp_path, capsys, overrides, needle):
    with pytest.raises(SystemExit) as exit_info:
        run_cli(main, [config(tmp_path, do_eval=False, max_steps=1, **overrides)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err, err


def test_cli_process_exit_code_and_message(tmp_path):
    cfg = config(tmp_path, learnig_rate=1.0)
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "llm", "run_reward.py"), cfg],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2
    assert "unknown key 'learnig_rate'" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_paddle_launch_form_from_the_llm_directory(tmp_path):
    # PaddleNLP's habit: cd llm && python run_reward.py config/tiny/prm_argument.json; the bundled config's
    # paths are relative to the repository root and are found from there.
    proc = subprocess.run(
        [
            sys.executable,
            "run_reward.py",
            "config/tiny/prm_argument.json",
            "--max_steps",
            "1",
            "--do_eval",
            "false",
            "--report_to",
            "none",
            "--output_dir",
            str(tmp_path / "out"),
        ],
        cwd=os.path.join(ROOT, "llm"),
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert read_json(tmp_path / "out" / "trainer_state.json")["global_step"] == 1
    # a missing relative path names both places it was looked for
    proc = subprocess.run(
        [sys.executable, "run_reward.py", "config/tiny/prm_argument.json", "--train_dataset_path", "no/such.jsonl"],
        cwd=os.path.join(ROOT, "llm"),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert (
        os.path.join(ROOT, "llm", "no/such.jsonl") in proc.stderr and os.path.join(ROOT, "no/such.jsonl") in proc.stderr
    )


def test_torchrun_two_processes_equal_one_process_double_batch(tmp_path):
    train = small_split(tmp_path, "prm_train.jsonl", 48)
    # 7 dev solutions in batches of 2 on 2 ranks: the sampler repeats some; each must count once.
    dev = small_split(tmp_path, "prm_dev.jsonl", 7)
    common = {
        "train_dataset_path": train,
        "dev_dataset_path": dev,
        "do_eval": True,
        "per_device_eval_batch_size": 2,
        "max_steps": 3,
        "optim": "sgd",
        "learning_rate": 0.5,
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "max_grad_norm": 0.0,
        "zero_padding": False,
        "greedy_zero_padding": False,
    }
    one, two = tmp_path / "one", tmp_path / "two"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    script = os.path.join(ROOT, "llm", "run_reward.py")
    subprocess.run(
        [sys.executable, script, config(tmp_path, output_dir=str(one), per_device_train_batch_size=2, **common)],
        check=True,
        env=env,
        timeout=300,
        capture_output=True,
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--standalone",
            script,
            config(tmp_path, output_dir=str(two), per_device_train_batch_size=1, **common),
        ],
        check=False,
        env=env,
        timeout=300,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert train_losses(two) == pytest.approx(train_losses(one), abs=1e-5)
    wa, wb = load_file(one / "model.safetensors"), load_file(two / "model.safetensors")
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) <= 1e-5
    ea, eb = read_json(one / "eval_results.json"), read_json(two / "eval_results.json")
    for key in ("eval_loss", "eval_step_accuracy", "eval_solution_accuracy"):
        assert ea[key] == pytest.approx(eb[key], rel=1e-6, abs=1e-6), key
    assert len(read_jsonl(two / "eval_scores.jsonl")) == 7


def test_sigterm_saves_a_checkpoint_and_resume_finishes(tmp_path):
    import signal

    train = small_split(tmp_path, "prm_train.jsonl", 200)
    out = tmp_path / "out"
    cfg = config(tmp_path, train_dataset_path=train, do_eval=False, max_steps=100000, save_strategy="no")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    script = os.path.join(ROOT, "llm", "run_reward.py")
    proc = subprocess.Popen(
        [sys.executable, script, cfg], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    for line in proc.stdout:  # wait until training is under way
        if "'loss'" in line:
            break
    proc.send_signal(signal.SIGTERM)
    proc.stdout.read()
    assert proc.wait(timeout=120) == 0
    checkpoints = sorted(out.glob("checkpoint-*"))
    assert len(checkpoints) == 1 and (checkpoints[0] / "model.safetensors").exists()
    step = int(checkpoints[0].name.split("-")[1])
    main(
        [
            config(
                tmp_path,
                train_dataset_path=train,
                do_eval=False,
                max_steps=step + 2,
                save_strategy="no",
                resume_from_checkpoint="auto",
            )
        ]
    )
    state = read_json(out / "trainer_state.json")
    assert state["global_step"] == step + 2


def test_lazy_streaming_run(tmp_path):
    out = tmp_path / "out"
    main([config(tmp_path, lazy=True, max_steps=4, do_eval=False, zero_padding=True, greedy_zero_padding=False)])
    state = read_json(out / "trainer_state.json")
    assert state["global_step"] == 4 and all(math.isfinite(x) for x in train_losses(out))


def test_lazy_stream_shorter_than_one_optimizer_step_trains(tmp_path):
    # 2 solutions pack into one row, fewer than gradient_accumulation_steps: the stream is read again from its
    # start (each pass logged), so 4 micro-batches make each of the 3 steps; it used to re-read forever.
    out = tmp_path / "out"
    train = small_split(tmp_path, "prm_train.jsonl", 2)
    cfg = config(
        tmp_path,
        train_dataset_path=train,
        lazy=True,
        max_steps=3,
        gradient_accumulation_steps=4,
        do_eval=False,
        zero_padding=True,
    )
    main([cfg])
    assert read_json(out / "trainer_state.json")["global_step"] == 3


def test_lazy_without_max_steps_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        run_cli(main, [config(tmp_path, lazy=True, do_eval=False)])
    assert "lazy streaming has no length: set max_steps > 0" in capsys.readouterr().err


def test_custom_reward_tokens_label_the_scores_file_and_the_metrics(tmp_path):
    """reward_tokens "a,b": the data's labels are a/b, the scores file writes them back as given, and
    step_accuracy counts a step right when (p(a) > 0.5) == (label is a), recomputed here from the file."""
    with open(os.path.join(SAMPLE, "prm_dev.jsonl"), encoding="utf-8") as f:
        recs = [json.loads(next(f)) for _ in range(6)]
    for rec in recs:
        rec["labels"] = ["a" if lab == "+" else "b" for lab in rec["labels"]]
    dev = tmp_path / "dev_ab.jsonl"
    dev.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs))
    main([config(tmp_path, dev_dataset_path=str(dev), reward_tokens="a,b", do_train=False, do_eval=True)])
    out = tmp_path / "out"
    rows = read_jsonl(out / "eval_scores.jsonl")
    assert [row["labels"] for row in rows] == [rec["labels"] for rec in recs]
    right = [(s > 0.5) == (lab == "a") for row in rows for s, lab in zip(row["step_scores"], row["labels"])]
    results = read_json(out / "eval_results.json")
    assert results["eval_step_accuracy"] == pytest.approx(sum(right) / len(right))


def test_eval_only_processbench_metrics_equal_what_the_step_scores_imply(tmp_path):
    """The bundled ProcessBench-format file, eval-only: the reported acc_error / acc_correct / F1 (overall,
    per subset, per generator) are recomputed here from eval_scores.jsonl's own step scores, with the
    prediction rule written out (first step below the threshold); and at the tuned threshold on 'short'."""
    from llm.alignment.rm.evaluation import f1

    dev = os.path.join(SAMPLE, "processbench_dev.jsonl")
    main([config(tmp_path, dev_dataset_path=dev, do_train=False, do_eval=True, prm_threshold=0.5)])
    out = tmp_path / "out"
    rows = read_jsonl(out / "eval_scores.jsonl")
    results = read_json(out / "eval_results.json")
    assert len(rows) == 120 and all(len(r["step_scores"]) == len(r["labels"]) for r in rows)

    def predicted(scores, t):
        for i, s in enumerate(scores):
            if s < t:
                return i
        return -1

    def expect(rows, t):
        err = [predicted(r["step_scores"], t) == r["first_error"] for r in rows if r["first_error"] >= 0]
        ok = [predicted(r["step_scores"], t) == -1 for r in rows if r["first_error"] < 0]
        return sum(err) / len(err), sum(ok) / len(ok), f1(sum(err) / len(err), sum(ok) / len(ok))

    for r in rows:
        assert r["predicted_first_error"] == predicted(r["step_scores"], 0.5)
    got = [results[f"eval_processbench_{k}"] for k in ("acc_error", "acc_correct", "f1")]
    assert got == pytest.approx(expect(rows, 0.5))
    for subset in ("short", "long"):
        part = [r for r in rows if r["source"] and r["index"] is not None and _subset(r) == subset]
        assert results[f"eval_processbench_{subset}_f1"] == pytest.approx(expect(part, 0.5)[2])
    mean = (results["eval_processbench_short_f1"] + results["eval_processbench_long_f1"]) / 2
    assert results["eval_processbench_mean_f1"] == pytest.approx(mean)
    assert "eval_processbench_generator_sampler_a_f1" in results
    # labels: + before the first error, - at it, none after
    for r in rows:
        e = r["first_error"]
        assert r["labels"] == (
            ["+"] * len(r["labels"]) if e < 0 else ["+"] * e + ["-"] + [None] * (len(r["labels"]) - e - 1)
        )


def _subset(row):
    with open(row["source"], encoding="utf-8") as f:
        for i, line in enumerate(f):
            if i == row["index"]:
                return json.loads(line)["id"].split("-")[0]
    raise AssertionError(row)


def test_eval_only_best_of_n_metrics_and_plot(tmp_path):
    """The bundled best-of-N groups (24 problems x 8 unlabelled candidates): pass@N and majority vote follow
    from the data alone; best-of-N with min from the scores file; the plot is written."""
    from llm.alignment.rm.evaluation import Candidate, best_of_n_metrics

    dev = os.path.join(SAMPLE, "bon_dev.jsonl")
    main([config(tmp_path, dev_dataset_path=dev, do_train=False, do_eval=True, seed=7)])
    out = tmp_path / "out"
    rows = read_jsonl(out / "eval_scores.jsonl")
    results = read_json(out / "eval_results.json")
    assert (out / "eval_best_of_n.png").stat().st_size > 1000
    recs = read_jsonl(dev)
    groups = {}
    for row in rows:
        rec = recs[row["index"]]
        assert all(lab is None for lab in row["labels"])  # unlabelled candidates
        groups.setdefault(rec["group"], []).append(Candidate(row["step_scores"], rec["answer"], rec["correct"]))
    expected = best_of_n_metrics(groups, ["min", "product", "last", "mean"], seed=7)
    for key in ("pass@8", "majority_vote@8", "bon_min@1", "bon_min@8", "weighted_vote_mean@4"):
        assert results[f"eval_{key}"] == pytest.approx(expected[key]), key
    assert results["eval_pass@8"] == pytest.approx(
        sum(any(r["correct"] for r in recs if r["group"] == g) for g in groups) / 24
    )
    assert results["eval_bon_min@1"] <= results["eval_pass@8"]
    # no labelled step, so no loss item: no eval_loss (before: 0.0, which read like a perfect loss)
    assert "eval_loss" not in results and "eval_step_accuracy" not in results


def _shepherd_candidates(with_group):
    """Two problems x 3 best-of-N candidates in the Hugging Face Math-Shepherd layout (the question starts
    the first step; labels from ``label``)."""
    rows = [
        ("a", "What is 2 + 3?", ["2 + 3 = 5.", "The answer is 5."], "5", True),
        ("a", "What is 2 + 3?", ["3 + 2 = 5.", "The answer is 5."], "5", True),
        ("a", "What is 2 + 3?", ["2 + 3 = 6.", "The answer is 6."], "6", False),
        ("b", "What is 4 * 2?", ["4 * 2 = 7.", "The answer is 7."], "7", False),
        ("b", "What is 4 * 2?", ["The answer is 7."], "7", False),
        ("b", "What is 4 * 2?", ["4 * 2 = 8.", "The answer is 8."], "8", True),
    ]
    out = []
    for group, question, steps, answer, correct in rows:
        text = question + " " + "".join(f"{s} ки\n" for s in steps)
        mark = "+" if correct else "-"
        rec = {"input": text, "label": text.replace("ки", mark), "answer": answer, "correct": correct}
        out.append({**rec, "group": group} if with_group else rec)
    return out


def test_eval_only_math_shepherd_candidates_without_group_exit_2(tmp_path, capsys):
    """Before: they formed one group of all problems' candidates, and the metrics were silently wrong."""
    dev = tmp_path / "shepherd_bon.jsonl"
    dev.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in _shepherd_candidates(False)))
    with pytest.raises(SystemExit) as exit_info:
        run_cli(main, [config(tmp_path, dev_dataset_path=str(dev), do_train=False, do_eval=True)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, err
    for needle in ("shepherd_bon.jsonl: record 0", "field 'group'", "add a 'group' field"):
        assert needle in errors[0], err
    assert "Traceback" not in err


def test_eval_only_math_shepherd_candidates_with_group(tmp_path):
    """With ``group``: one group per problem; majority vote and pass@N are hand-computed from the data, best-of-N
    follows from the scores file; the labelled steps give an eval_loss."""
    from llm.alignment.rm.evaluation import AGGREGATIONS

    dev = tmp_path / "shepherd_bon.jsonl"
    recs = _shepherd_candidates(True)
    dev.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs))
    main([config(tmp_path, dev_dataset_path=str(dev), do_train=False, do_eval=True)])
    out = tmp_path / "out"
    results = read_json(out / "eval_results.json")
    assert results["eval_bon_groups"] == 2
    assert results["eval_majority_vote@3"] == pytest.approx(0.5)  # a: "5" (right); b: "7" (wrong)
    assert results["eval_pass@3"] == pytest.approx(1.0) and results["eval_pass@1"] <= 1.0
    rows = read_jsonl(out / "eval_scores.jsonl")
    by_group = {}
    for row in rows:
        rec = recs[row["index"]]
        by_group.setdefault(rec["group"], []).append((AGGREGATIONS["min"](row["step_scores"]), rec["correct"]))
    best = [max(group, key=lambda c: c[0])[1] for group in by_group.values()]  # all 3 compete at N = 3
    assert results["eval_bon_min@3"] == pytest.approx(sum(best) / 2)
    assert math.isfinite(results["eval_loss"]) and results["eval_loss"] > 0


def test_best_model_by_loss_with_a_dev_split_without_loss_items_stops_before_training(tmp_path, capsys):
    """load_best_model_at_end makes metric_for_best_model "loss"; dev data of unlabelled best-of-N candidates
    has no loss item, so no evaluation reports eval_loss. Before: every evaluation reported 0.0 and the first
    checkpoint was silently the "best"; without the check transformers would stop at the first evaluation with
    a KeyError. The run stops at start-up instead, exit 2, and trains nothing."""
    train = small_split(tmp_path, "prm_train.jsonl", 4)
    dev = small_split(tmp_path, "bon_dev.jsonl", 8)
    cfg = config(
        tmp_path,
        train_dataset_path=train,
        dev_dataset_path=dev,
        max_steps=2,
        evaluation_strategy="steps",
        save_strategy="steps",
        eval_steps=1,
        save_steps=1,
        load_best_model_at_end=True,
    )
    with pytest.raises(SystemExit) as exit_info:
        run_cli(main, [cfg])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "metric_for_best_model='loss'" in errors[0], err
    assert "no loss item (no labelled steps)" in errors[0] and "load_best_model_at_end" in errors[0], err
    assert "Traceback" not in err
    assert not any(p.name.startswith("checkpoint-") for p in (tmp_path / "out").glob("*"))


def test_best_model_check_counts_loss_items_of_the_packed_dev_rows(tmp_path):
    """The start-up check and the guard at each evaluation, on a built trainer: a dev split with one labelled
    record among the candidates passes; an evaluation without the metric is one UserError, not a KeyError."""
    from llm.alignment.context import RunContext
    from llm.alignment.rm.build import build_reward_trainer
    from llm.settings.flat import validate_arguments
    from llm.settings.load import parse_arguments
    from llm.settings.reward import REWARD_ARGUMENT_TYPES
    from llm.utils.errors import UserError

    dev = tmp_path / "dev.jsonl"
    with open(small_split(tmp_path, "bon_dev.jsonl", 8), encoding="utf-8") as f:
        cands = f.read()
    with open(small_split(tmp_path, "prm_dev.jsonl", 1), encoding="utf-8") as f:
        labelled = f.read()

    def trainer_for(text):
        dev.write_text(text)
        cfg = config(tmp_path, dev_dataset_path=str(dev), do_train=False, metric_for_best_model="loss")
        args = parse_arguments([cfg], REWARD_ARGUMENT_TYPES)
        validate_arguments(*args)
        return build_reward_trainer(RunContext.load(*args))[0]

    trainer = trainer_for(cands)
    assert trainer.eval_has_loss_items() is False
    with pytest.raises(UserError, match="no loss item"):
        trainer.check_metric_for_best_model()
    with pytest.raises(UserError, match=r"metric_for_best_model='loss': this evaluation did not report it"):
        trainer._determine_best_metric({"eval_bon_min@8": 0.5, "eval_runtime": 0.1}, None)
    metrics = trainer.evaluate()
    assert "eval_loss" not in metrics and "eval_bon_min@8" in metrics
    trainer = trainer_for(cands + labelled)
    assert trainer.eval_has_loss_items() is True
    trainer.check_metric_for_best_model()
    assert math.isfinite(trainer.evaluate()["eval_loss"])


def test_head_learning_rate_moves_the_score_head_by_its_own_rate(tmp_path):
    """AdamW's first step moves each weight by lr * g / (|g| + eps): ~lr where the gradient is not ~0. With the
    backbone at 1e-6 and the new score head at 1e-2 (constant schedule, no warmup, no decay), one step moves
    the head's weights by ~1e-2 and no other weight by more than ~1e-6."""
    from transformers import AutoModelForSequenceClassification

    from llm.utils.modeling import load_model

    train = small_split(tmp_path, "pairs_train.jsonl", 8)
    out = tmp_path / "out"
    main(
        [
            config(
                tmp_path,
                "rm_argument.json",
                train_dataset_path=train,
                do_eval=False,
                max_steps=1,
                learning_rate=1e-6,
                head_learning_rate=1e-2,
                warmup_steps=0,
                lr_scheduler_type="constant",
                adam_epsilon=1e-12,
                max_grad_norm=0.0,
            )
        ]
    )
    model_dir = os.path.join(ROOT, read_json(os.path.join(TINY, "rm_argument.json"))["model_name_or_path"])
    init = load_model(
        AutoModelForSequenceClassification, model_dir, init_from_config=True, seed=42, pad_token_id=0, num_labels=1
    ).state_dict()
    trained = load_file(out / "model.safetensors")
    head = (trained["score.weight"] - init["score.weight"]).abs()
    assert head.max().item() == pytest.approx(1e-2, rel=1e-3)
    assert head.median().item() > 0.9e-2  # almost every head weight took a full step
    rest = max((trained[k] - init[k]).abs().max().item() for k in trained if k != "score.weight")
    assert 0.5e-6 < rest < 1.1e-6


def test_head_learning_rate_on_a_prm_exit_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_cli(main, [config(tmp_path, do_eval=False, max_steps=1, head_learning_rate=1e-3)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "head_learning_rate is an ORM's" in err and "Traceback" not in err, err
