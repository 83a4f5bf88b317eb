"""End-to-end runs of llm/run_finetune.py and llm/run_dpo.py on the tiny configs (small data subsets): finite
loss, parameters changed, checkpoint reloads with the plain Auto class, evaluation-only runs reproduce
the evaluation of the trained model; dataset mixing, lazy streaming, bad settings exit 2."""

import json
import math
import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from llm.data.encode_lm import encode_sft
from llm.data.encoding import EncodeConfig, OverlongCounter
from llm.data.readers import read_records
from llm.run_dpo import main as dpo_main
from llm.run_finetune import main as sft_main
from llm.utils.errors import run_cli
from llm.utils.modeling import load_model
from tests.helpers import ROOT, read_json, read_jsonl, tokenizer

TINY = os.path.join(ROOT, "llm", "config", "tiny")
TINY_LLAMA = os.path.join(ROOT, "llm", "assets", "tiny-llama")
SFT_DATA = os.path.join(ROOT, "llm", "data", "sample_sft")
PAIR_DATA = os.path.join(ROOT, "llm", "data", "sample")


def config(tmp_path, name, **overrides):
    with open(os.path.join(TINY, name), encoding="utf-8") as f:
        cfg = json.load(f)
    for key in ("model_name_or_path", "tokenizer_name_or_path"):
        cfg[key] = os.path.join(ROOT, cfg[key])
    cfg.update(
        output_dir=str(tmp_path / "out"),
        disable_tqdm=True,
        report_to="none",
        logging_steps=1,
        warmup_steps=0,
        max_seq_len=512,
        max_prompt_len=128,
        save_strategy="no",
        evaluation_strategy="no",
    )
    cfg.update(overrides)
    if cfg.get("do_train") is False and cfg.get("init_from_config"):
        cfg["eval_random_init"] = True  # an evaluation-only run of the random tiny model, on purpose
    path = tmp_path / f"cfg_{len(list(tmp_path.glob('cfg_*')))}.json"
    path.write_text(json.dumps(cfg, ensure_ascii=False))
    return str(path)


def subset(tmp_path, folder, name, n, start=0):
    with open(os.path.join(folder, name), encoding="utf-8") as f:
        lines = f.readlines()[start : start + n]
    path = tmp_path / f"{start}_{name}"
    path.write_text("".join(lines))
    return str(path)


def train_losses(output_dir):
    state = read_json(os.path.join(output_dir, "trainer_state.json"))
    return [h["loss"] for h in state["log_history"] if "loss" in h]


def check_trained_checkpoint(out, init_state):
    """Finite losses, weights moved, saved model reloads with the plain Auto class."""
    assert train_losses(out) and all(math.isfinite(x) for x in train_losses(out))
    trained = load_file(out / "model.safetensors")
    assert max((trained[k] - init_state[k]).abs().max().item() for k in trained) > 1e-4
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    assert all(torch.equal(reloaded.state_dict()[k], v) for k, v in trained.items())
    assert (out / "tokenizer.json").exists()


def tiny_init_state():
    return load_model(AutoModelForCausalLM, TINY_LLAMA, init_from_config=True, seed=42, pad_token_id=0).state_dict()


def test_sft_train_mixed_data_reload_and_eval_only(tmp_path):
    train_a = subset(tmp_path, SFT_DATA, "sft_train.jsonl", 24)
    train_b = subset(tmp_path, SFT_DATA, "sft_train.jsonl", 8, start=100)
    dev = subset(tmp_path, SFT_DATA, "sft_dev.jsonl", 12)
    out = tmp_path / "out"
    sft_main(
        [
            config(
                tmp_path,
                "sft_argument.json",
                train_dataset_path=f"{train_a},{train_b}",
                dataset_probs="0.7,0.3",
                dev_dataset_path=dev,
                max_steps=4,
                save_strategy="steps",
                save_steps=2,
            )
        ]
    )
    results = read_json(out / "all_results.json")
    assert math.isfinite(results["train_loss"]) and results["eval_ppl"] == pytest.approx(math.exp(results["eval_loss"]))
    assert (out / "checkpoint-2" / "model.safetensors").exists()
    check_trained_checkpoint(out, tiny_init_state())
    scores = read_jsonl(out / "eval_scores.jsonl")
    assert len(scores) == 12 and scores[0]["source"] == dev and scores[0]["tokens"] > 0

    eval_dir = tmp_path / "eval_only"
    sft_main(
        [
            config(
                tmp_path,
                "sft_argument.json",
                model_name_or_path=str(out),
                init_from_config=False,
                do_train=False,
                dev_dataset_path=dev,
                output_dir=str(eval_dir),
            )
        ]
    )
    again = read_json(eval_dir / "eval_results.json")
    assert again["eval_loss"] == pytest.approx(results["eval_loss"], abs=1e-6)
    assert again["eval_ppl"] == pytest.approx(results["eval_ppl"], rel=1e-6)
    for a, b in zip(scores, read_jsonl(eval_dir / "eval_scores.jsonl")):
        assert a["index"] == b["index"] and a["nll"] == pytest.approx(b["nll"], abs=1e-5)

    # The plain Auto class (stock attention, full logits, its own label loss) gives the same numbers.
    plain = AutoModelForCausalLM.from_pretrained(out).eval()
    tok = AutoTokenizer.from_pretrained(out)
    records = read_records(dev, "sft")
    nll, tokens = 0.0, 0
    with torch.no_grad():
        for i, (record, score) in enumerate(zip(records, scores)):
            ex = encode_sft(record, tok, EncodeConfig(512, 128), i, OverlongCounter())
            ids = torch.tensor([ex.input_ids])
            labels = torch.full_like(ids, -100)
            labels[0, [p + 1 for p in ex.readout_position]] = torch.tensor(ex.readout_target)
            n = len(ex.readout_position)
            example_nll = plain(input_ids=ids, labels=labels).loss.item() * n
            assert example_nll == pytest.approx(score["nll"], rel=1e-5) and n == score["tokens"]
            nll, tokens = nll + example_nll, tokens + n
    assert nll / tokens == pytest.approx(results["eval_loss"], rel=1e-5)


def test_sft_lazy_streaming_run(tmp_path):
    train = subset(tmp_path, SFT_DATA, "sft_train.jsonl", 40)
    out = tmp_path / "out"
    sft_main([config(tmp_path, "sft_argument.json", train_dataset_path=train, lazy=True, max_steps=2, do_eval=False)])
    assert read_json(out / "trainer_state.json")["global_step"] == 2


@pytest.fixture
def init_dir(tmp_path):
    """The tiny model's random initialisation saved as a checkpoint: the policy's start and the reference."""
    path = tmp_path / "init"
    model = load_model(AutoModelForCausalLM, TINY_LLAMA, init_from_config=True, seed=42, pad_token_id=0)
    model.save_pretrained(path)
    tokenizer().save_pretrained(path)
    return path


EVAL_KEYS = ("eval_loss", "eval_rewards/chosen", "eval_rewards/margins", "eval_logps/chosen", "eval_logps/rejected")


def test_dpo_train_reload_and_eval_only_with_the_reference(tmp_path, init_dir):
    train = subset(tmp_path, PAIR_DATA, "pairs_train.jsonl", 24)
    dev = subset(tmp_path, PAIR_DATA, "pairs_dev.jsonl", 8)
    out = tmp_path / "out"
    dpo_main(
        [
            config(
                tmp_path,
                "dpo_argument.json",
                model_name_or_path=str(init_dir),
                init_from_config=False,
                train_dataset_path=train,
                dev_dataset_path=dev,
                max_steps=4,
                learning_rate=1e-3,
            )
        ]
    )
    results = read_json(out / "all_results.json")
    assert math.isfinite(results["train_loss"]) and 0 < results["eval_loss"] < 10
    check_trained_checkpoint(out, load_file(init_dir / "model.safetensors"))
    assert results["eval_rewards/margins"] != 0  # the policy moved away from the reference
    scores = read_jsonl(out / "eval_scores.jsonl")
    assert len(scores) == 8 and {"chosen_reward", "rejected_logps"} <= set(scores[0])

    # Evaluation only: the trained policy against the same reference, computed on the fly this time.
    eval_dir = tmp_path / "eval_only"
    dpo_main(
        [
            config(
                tmp_path,
                "dpo_argument.json",
                model_name_or_path=str(out),
                ref_model_name_or_path=str(init_dir),
                init_from_config=False,
                do_train=False,
                precompute_ref_log_probs=False,
                dev_dataset_path=dev,
                output_dir=str(eval_dir),
            )
        ]
    )
    again = read_json(eval_dir / "eval_results.json")
    for key in EVAL_KEYS:
        assert again[key] == pytest.approx(results[key], abs=1e-5), key


@pytest.mark.parametrize("loss_type", ["ipo", "orpo"])
def test_dpo_variants_run(tmp_path, loss_type):
    """ipo with the reference computed on the fly from a copy of the initial policy; orpo without reference."""
    train = subset(tmp_path, PAIR_DATA, "pairs_train.jsonl", 12)
    out = tmp_path / "out"
    dpo_main(
        [
            config(
                tmp_path,
                "dpo_argument.json",
                loss_type=loss_type,
                precompute_ref_log_probs=False,
                train_dataset_path=train,
                do_eval=False,
                max_steps=2,
            )
        ]
    )
    assert read_json(out / "trainer_state.json")["global_step"] == 2
    assert all(math.isfinite(x) for x in train_losses(out))


@pytest.mark.parametrize(
    "main, name, overrides, needle",
    [
        (dpo_main, "dpo_argument.json", {"do_train": False}, "set ref_model_name_or_path"),
        (dpo_main, "dpo_argument.json", {"lazy": True, "max_steps": 2}, "precompute_ref_log_probs needs the data"),
        (dpo_main, "dpo_argument.json", {"tokenizer_name_or_path": "/nonexistent/tok"}, "/nonexistent/tok"),
        (sft_main, "sft_argument.json", {"learnig_rate": 1.0}, "unknown key 'learnig_rate'"),
        (sft_main, "sft_argument.json", {"use_chat_template": True, "tokenizer_name_or_path": TINY_LLAMA}, "tokenizer"),
    ],
)
def test_bad_settings_exit_2_with_message(tmp_path, capsys, main, name, overrides, needle):
    with pytest.raises(SystemExit) as exit_info:
        run_cli(main, [config(tmp_path, name, **overrides)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err, err


def test_bad_sft_record_exit_2_names_file_record_field(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    good = subset(tmp_path, SFT_DATA, "sft_train.jsonl", 2)
    with open(good, encoding="utf-8") as f:
        bad.write_text(f.read() + json.dumps({"src": ["q1", "q2"], "tgt": ["a1"]}) + "\n")
    with pytest.raises(SystemExit):
        run_cli(sft_main, [config(tmp_path, "sft_argument.json", train_dataset_path=str(bad), do_eval=False)])
    err = capsys.readouterr().err
    assert "bad.jsonl: record 2" in err and "field 'tgt'" in err and "Fix:" in err, err


def test_torchrun_two_processes_equal_one_process_double_batch(tmp_path):
    """DDP with the LM head applied outside the model's forward, and reference log-probs precomputed by both
    ranks (each its share, then exchanged): 2 ranks x batch 1 == 1 process x batch 2."""
    import subprocess
    import sys

    common = {
        "train_dataset_path": subset(tmp_path, PAIR_DATA, "pairs_train.jsonl", 16),
        "dev_dataset_path": subset(tmp_path, PAIR_DATA, "pairs_dev.jsonl", 6),
        "max_steps": 2,
        "optim": "sgd",
        "learning_rate": 0.5,
        "lr_scheduler_type": "constant",
        "max_grad_norm": 0.0,
        "zero_padding": False,
        "greedy_zero_padding": False,
        # 6 dev rows in batches of 1 split evenly over 2 ranks. (With an uneven split accelerate repeats rows
        # to even out the ranks; the metrics keep each record once, AlignmentTrainer's eval_loss counts them.)
        "per_device_eval_batch_size": 1,
    }
    one, two = tmp_path / "one", tmp_path / "two"
    dpo_main([config(tmp_path, "dpo_argument.json", output_dir=str(one), per_device_train_batch_size=2, **common)])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    cfg = config(tmp_path, "dpo_argument.json", output_dir=str(two), per_device_train_batch_size=1, **common)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone"]
    proc = subprocess.run(
        [*launcher, os.path.join(ROOT, "llm", "run_dpo.py"), cfg],
        env=env,
        timeout=300,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert train_losses(two) == pytest.approx(train_losses(one), abs=1e-5)
    wa, wb = load_file(one / "model.safetensors"), load_file(two / "model.safetensors")
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) <= 1e-5
    a, b = read_json(one / "eval_results.json"), read_json(two / "eval_results.json")
    for key in EVAL_KEYS:
        assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-5), key
