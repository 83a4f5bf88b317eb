"""OpenLLaMA2 / OpenRLHF launch scripts as configs (llm/settings/dialects/openrlhf/): the translation of each
flag by hand, the refusals and their messages, the script forms (heredoc, a plain command, variables), and the
conformance run: the seed's three OpenLLaMA2 commands (tests/data/openrlhf/fdda2cc6, copied as published) through
run_finetune.py, run_reward.py and run_ppo.py on a tiny Llama from a scripts folder, one --save_path for all three,
with only model / data names and sizes edited. The later heredoc form (tests/data/openrlhf/, 55ccebea) is translated
flag by flag. Hostile scripts: tests/test_openrlhf_scripts.py."""

from __future__ import annotations

import json
import logging
import os
import pickle

import pytest
import torch
from safetensors.torch import load_file

from llm import run_finetune, run_ppo, run_reward
from llm.settings.dialects.openrlhf import read_launch_script
from llm.settings.load import parse_arguments, parse_ppo_config
from llm.utils import modeling
from llm.utils.errors import UserError
from tests.helpers import ROOT, read_json, tiny_model, tokenizer

PUBLISHED = os.path.join(ROOT, "tests", "data", "openrlhf")
SAMPLE = os.path.join(ROOT, "llm", "data", "sample")
SFT_SAMPLE = os.path.join(ROOT, "llm", "data", "sample_sft")


def first_lines(src: str, dst, n: int, start: int = 0) -> str:
    with open(src, encoding="utf-8") as f:
        lines = f.readlines()[start : start + n]
    dst.write_text("".join(lines), encoding="utf-8")
    return str(dst)


def script(tmp_path, command: str, name: str = "train.sh") -> str:
    """A launch script in OpenRLHF's heredoc form holding ``command`` (one flag per line)."""
    body = " \\\n".join(line.strip() for line in command.strip().splitlines())
    path = tmp_path / name
    path.write_text(f"set -x\n\nread -r -d '' training_commands <<EOF\n{body}\nEOF\n\ndeepspeed $training_commands\n")
    return str(path)


def translate(path: str, kind: str) -> tuple[dict, list[str]]:
    notes: list[str] = []
    return read_launch_script(path, kind, notes), notes


@pytest.fixture
def data(tmp_path):
    """Small local files in the formats this project reads: SFT, pairs, prompts."""
    return {
        "sft": first_lines(os.path.join(SFT_SAMPLE, "sft_train.jsonl"), tmp_path / "sft.jsonl", 8),
        "pairs": first_lines(os.path.join(SAMPLE, "pairs_train.jsonl"), tmp_path / "pairs.jsonl", 8),
        "prompts": first_lines(os.path.join(SAMPLE, "prompts.jsonl"), tmp_path / "prompts.jsonl", 6),
    }


# --- the translation, by hand ---------------------------------------------------------------------------
def test_published_sft_heredoc_translates_flag_by_flag(tmp_path, data):
    out, notes = translate(published("train_sft_llama.sh", tmp_path, {"Open-Orca/OpenOrca": data["sft"]}), "sft")
    assert out == {
        "model_name_or_path": "meta-llama/Llama-2-7b-hf",  # a hub id: left to the loader, as PaddleNLP names are
        "output_dir": "./ckpt/7b_llama/sft_model",  # OpenLLaMA2 saves ./ckpt/7b_llama/sft_model.pt
        "train_dataset_path": data["sft"],
        "dataset_probs": "1.0",
        "use_chat_template": False,  # OpenRLHF: plain text without --apply_chat_template
        "per_device_train_batch_size": 1,
        "per_device_eval_batch_size": 1,
        "gradient_accumulation_steps": 128,  # the global 128 / (micro 1 x 1 process)
        "num_train_epochs": 1,
        "max_seq_len": 2048,
        "max_prompt_len": 2047,
        "learning_rate": 5e-6,
        "warmup_ratio": 0.03,  # OpenLLaMA2's fixed 3% warmup, then its cosine
        "lr_scheduler_type": "cosine",
        "adam_beta1": 0.9,
        "adam_beta2": 0.95,  # OpenLLaMA2's fixed betas
        "bf16": True,
        "fp16_opt_level": "O2",  # DeepSpeed's bf16: bf16 weights, fp32 masters
        "recompute": True,
        "save_strategy": "no",  # no --save_steps: no checkpoints
        "logging_steps": 1,
        "report_to": "none",
        "do_train": True,
    }
    assert "--train_batch_size 128 -> gradient_accumulation_steps = 128 (128 / (1 x 1 process(es)))" in notes
    assert "--max_samples 500000: the data has 8 records: no cap" in notes
    assert any(n.startswith("--zero_stage 2: DeepSpeed: memory and speed only") for n in notes)
    assert any(n.startswith("--flash_attn: an attention kernel") for n in notes)


def test_global_batch_is_split_by_micro_batch_and_world_size(tmp_path, data, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    path = script(tmp_path, f"../train_sft.py\n--pretrain m\n--dataset {data['sft']}\n"
                  "--micro_train_batch_size 2\n--train_batch_size 64")  # fmt: skip
    out, notes = translate(path, "sft")
    assert (out["per_device_train_batch_size"], out["gradient_accumulation_steps"]) == (2, 8)  # 64 / (2 x 4)
    assert "--train_batch_size 64 -> gradient_accumulation_steps = 8 (64 / (2 x 4 process(es)))" in notes
    path = script(tmp_path, f"../train_sft.py\n--pretrain m\n--dataset {data['sft']}\n--train_batch_size 100")
    with pytest.raises(UserError, match=r"--train_batch_size: 100 is OpenRLHF's global batch.* multiple of 8 x 4"):
        translate(path, "sft")  # the default micro batch, 8, x 4 processes does not divide 100


def test_flags_left_out_take_openllama2_defaults_and_say_so(tmp_path, data):
    out, notes = translate(script(tmp_path, f"../train_rm.py\n--pretrain m\n--dataset {data['pairs']}"), "rm")
    # train_rm.py's defaults: micro 8, global 128, max_len 512, lr 1e-5, one epoch
    assert (out["per_device_train_batch_size"], out["gradient_accumulation_steps"]) == (8, 16)
    assert (out["max_seq_len"], out["max_prompt_len"], out["learning_rate"], out["num_train_epochs"]) == (
        1024,  # a pair is one row here: 2 x 512
        511,
        1e-5,
        1,
    )
    assert "--learning_rate 1e-05 (train_rm.py's default) -> learning_rate = 1e-05" in notes
    assert '(no flag) -> report_to = "none" (OpenRLHF logs only with --use_wandb / --use_tensorboard)' in notes


def test_column_keys_become_map_keys(tmp_path, data):
    out, _ = translate(
        script(tmp_path, f"openrlhf.cli.train_sft\n--pretrain m\n--dataset {data['sft']}\n--input_key question\n"
               "--output_key response\n--apply_chat_template"), "sft")  # fmt: skip
    assert out["map_keys"] == {"src": "question", "tgt": "response"} and out["use_chat_template"] is True
    out, _ = translate(script(tmp_path, f"openrlhf.cli.train_sft\n--pretrain m\n--dataset {data['sft']}\n"
                              "--input_key conversation"), "sft")  # fmt: skip
    assert out["map_keys"] == {"messages": "conversation"}  # no --output_key: the column holds the conversation
    out, notes = translate(script(tmp_path, f"../train_rm.py\n--pretrain m\n--dataset {data['pairs']}\n"
                                  "--prompt_key question\n--chosen_key better\n--rejected_key rejected"), "rm")  # fmt: skip
    assert out["map_keys"] == {"prompt": "question", "chosen": "better"}
    assert "--rejected_key rejected: the column this project reads" in notes


def test_later_openrlhf_ppo_flags(tmp_path, data):
    path = script(
        tmp_path,
        f"""
        openrlhf.cli.train_ppo
        --pretrain sft_dir
        --reward_pretrain rm_dir
        --critic_pretrain critic_dir
        --prompt_data {data["prompts"]}
        --input_key question
        --label_key answer
        --apply_chat_template
        --n_samples_per_prompt 4
        --rollout_batch_size 2
        --micro_rollout_batch_size 2
        --train_batch_size 8
        --num_episodes 2
        --max_epochs 2
        --advantage_estimator group_norm
        --use_kl_loss
        --init_kl_coef 0.001
        --kl_estimator k3
        --temperature 0.7
        --lora_rank 16
        --target_modules q_proj v_proj
        --packing_samples
        --save_steps 5
    """,
    )
    out, notes = translate(path, "ppo")
    a, c, alg = out["actor_rollout"], out["critic"], out["algorithm"]
    assert (a["model_name_or_path"], c["model_name_or_path"]) == ("sft_dir", "critic_dir")
    assert out["reward"] == {"type": "orm", "model_name_or_path": "rm_dir", "reward_clip": 10.0}
    assert out["data"] == {
        "train_dataset_path": data["prompts"],
        "map_keys": {"prompt": "question", "reference": "answer"},
        "use_chat_template": True,
        "rollout_batch_size": 2,
    }
    assert (a["num_samples_per_step"], a["ppo_mini_batch_size"], c["critic_mini_batch_size"]) == (4, 8, 8)
    assert (a["ppo_epochs"], c["critic_update_epochs"], a["temperature"], a["top_k"]) == (2, 2, 0.7, 50)
    assert (alg["adv_estimator"], alg["kl_penalty"], alg["use_kl_in_reward"], alg["kl_loss_coef"]) == (
        "grpo",
        "low_var_kl",
        False,
        0.001,
    )
    assert (a["lora"], a["lora_rank"], a["lora_alpha"], a["target_modules"]) == (True, 16, 16, ["q_proj", "v_proj"])
    assert c["lora_rank"] == 16
    # 6 prompts, 2 per step, twice over: 6 steps; warmup ceil(0.03 x 2 episodes x (6 x 4 // 8) x 2 epochs) = 1
    assert (out["training"]["max_steps"], out["training"]["lr_warmup_steps"]) == (6, 1)
    assert out["training"]["save_steps"] == 5
    assert "--num_episodes 2 -> training.max_steps = 6 (2 x (6 prompts // 2))" in notes
    assert any(n.startswith("--packing_samples: exact packing") for n in notes)


def test_dpo_flags(tmp_path, data):
    out, _ = translate(script(tmp_path, f"../train_dpo.py\n--pretrain m\n--ref_pretrain ref\n--dataset "
                              f"{data['pairs']}\n--beta 0.2\n--ipo\n--nll_loss_coef 0.5"), "dpo")  # fmt: skip
    assert (out["ref_model_name_or_path"], out["beta"], out["loss_type"], out["sft_loss_weight"]) == (
        "ref",
        0.2,
        "ipo",
        0.5,
    )


# --- the script forms -----------------------------------------------------------------------------------
def test_plain_command_with_variables_comments_and_continuations(tmp_path, data, monkeypatch):
    monkeypatch.setenv("LR", "3e-6")
    path = tmp_path / "run.sh"
    path.write_text(f"""#!/bin/bash
# a commented-out command is not read: deepspeed ../train_sft.py --pretrain other
export SAVE=/tmp/out_sft
MODEL="tiny model"
deepspeed --num_gpus 8 --module openrlhf.cli.train_sft \\
    --pretrain "$MODEL" \\
    --save_path ${{SAVE}} \\
    --dataset {data["sft"]} \\
    --learning_rate $LR \\
    --max_epochs=3  # a trailing comment
""")
    out, _ = translate(str(path), "sft")
    assert (out["model_name_or_path"], out["output_dir"], out["learning_rate"], out["num_train_epochs"]) == (
        "tiny model",
        "/tmp/out_sft",
        3e-6,
        3,
    )
    path.write_text("deepspeed ../train_sft.py --pretrain $NOWHERE_SET --dataset x\n")
    with pytest.raises(UserError, match=r"uses \$NOWHERE_SET, which neither the script nor the environment sets"):
        translate(str(path), "sft")
    path.write_text("echo nothing to run\n")
    with pytest.raises(UserError, match="holds no OpenRLHF training command"):
        translate(str(path), "sft")


def test_a_script_of_another_kind_names_the_reader(tmp_path, data):
    path = os.path.join(PUBLISHED, "train_ppo_llama.sh")
    with pytest.raises(UserError, match=r"runs OpenRLHF's train_ppo: read it with python llm/run_ppo.py .*"
                       r"\(this is llm/run_finetune.py\)"):  # fmt: skip
        translate(path, "sft")
    with pytest.raises(UserError, match=r"runs OpenRLHF's train_sft: read it with python llm/run_finetune.py"):
        parse_ppo_config([os.path.join(PUBLISHED, "train_sft_llama.sh")])  # through the real config path
    kto = script(tmp_path, "../train_kto.py\n--pretrain m")
    with pytest.raises(UserError, match="runs OpenRLHF's train_kto: no counterpart here"):
        translate(kto, "dpo")


def test_unknown_flag_names_the_closest(tmp_path, data):
    path = script(tmp_path, f"../train_sft.py\n--pretrain m\n--dataset {data['sft']}\n--learning_rat 1e-5")
    with pytest.raises(UserError, match=r"--learning_rat: not a flag of OpenRLHF's train_sft .*closest: "
                       r"'learning_rate'"):  # fmt: skip
        translate(path, "sft")
    path = script(tmp_path, f"../train_sft.py\n--pretrain m\n--dataset {data['sft']}\n--actor_learning_rate 1e-5")
    with pytest.raises(UserError, match="--actor_learning_rate: not a flag of OpenRLHF's train_sft"):
        translate(path, "sft")  # a train_ppo flag
    path = script(tmp_path, f"../train_sft.py\n--pretrain m\n--dataset {data['sft']}\n--max_epochs two")
    with pytest.raises(UserError, match=r"--max_epochs must be a whole number \(OpenRLHF's type\), got 'two'"):
        translate(path, "sft")
    path = script(tmp_path, f"../train_sft.py\n--pretrain m\n--dataset {data['sft']}\n--bf16 true")
    with pytest.raises(UserError, match=r"--bf16 takes no value, got \['true'\]"):
        translate(path, "sft")


REFUSED = [  # (script, extra flags, the message); every other flag as in a valid command
    ("ppo", "--enable_ema", "--enable_ema: no EMA copy of the actor is kept here: remove it"),
    ("ppo", "--pretrain_data x", r"--pretrain_data: PPO-ptx \(a pretraining loss beside PPO\) is not available"),
    ("ppo", "--remote_rm_url http://h:5000/get_reward", "--remote_rm_url: OpenRLHF's remote reward speaks another"),
    ("ppo", "--freezing_actor_steps 10", "--freezing_actor_steps: 10: the actor is never frozen here"),
    ("ppo", "--advantage_estimator reinforce_baseline", "'reinforce_baseline' is not available here: one of gae,"),
    ("ppo", "--kl_estimator k4", "--kl_estimator: 'k4' is not available here: one of k1, k2, k3"),
    ("ppo", "--reward_clip_range -5 10", r"--reward_clip_range: \(-5.0, 10.0\): a symmetric range \(-c, c\) only"),
    ("ppo", "--use_wandb token", "--use_wandb: PPO here logs to TensorBoard only: use --use_tensorboard"),
    ("ppo", "--load_in_4bit", "--load_in_4bit: QLoRA is not available in PPO here"),
    ("sft", "--pretrain_mode", "--pretrain_mode: SFT here trains on the answer tokens only"),
    ("sft", "--input_template 'User: {}'", "--input_template: prompts are plain text or the tokenizer's chat"),
    ("sft", "--train_split validation", "--train_split: validation: a local file has one split: train"),
    ("sft", "--max_samples 3", "--max_samples: would keep 3 of 8; this project reads every record: cut the data"),
    ("sft", "--load_model ckpt/sft_model.pt", r"--load_model: neither 'ckpt/sft_model.pt' nor .* \(ckpt/sft_model/"),
    ("sft", "--ring_attn_size 2", "--ring_attn_size: 2: no ring attention here: set 1"),
    ("sft", "--use_ms", "--use_ms: ModelScope downloads are not available: give local paths"),
    ("rm", "--margin_loss", "--margin_loss: a per-pair margin column is not read"),
    ("rm", "--loss hinge", "--loss: hinge: this project's ORM loss is sigmoid"),
    ("rm", "--value_head_prefix value_head", "--value_head_prefix: value_head: this project's value head is 'score'"),
    ("rm", "--aux_loss_coef 0.01", "--aux_loss_coef: 0.01: no MoE balancing loss here: set 0"),
]


@pytest.mark.parametrize("kind, flags, message", REFUSED, ids=[f"{k} {f.split()[0]}" for k, f, _ in REFUSED])
def test_flags_that_cannot_take_effect_stop_with_what_to_do(tmp_path, data, kind, flags, message):
    base = {
        "sft": f"../train_sft.py --pretrain m --dataset {data['sft']}",
        "rm": f"../train_rm.py --pretrain m --dataset {data['pairs']}",
        "ppo": f"../train_ppo.py --pretrain m --reward_pretrain r --prompt_data {data['prompts']} "
        "--rollout_batch_size 2 --train_batch_size 2",
    }[kind]
    with pytest.raises(UserError, match=message):
        translate(script(tmp_path, f"{base} {flags}"), kind)


def test_hub_data_sets_and_missing_reward_model_are_refused(tmp_path, data):
    path = script(tmp_path, "../train_sft.py\n--pretrain m\n--dataset Open-Orca/OpenOrca")
    with pytest.raises(UserError, match=r"--dataset: 'Open-Orca/OpenOrca' is not a local file.*reads local files"):
        translate(path, "sft")
    path = script(tmp_path, f"../train_ppo.py\n--pretrain m\n--prompt_data {data['prompts']}\n"
                  "--rollout_batch_size 2\n--train_batch_size 2")  # fmt: skip
    with pytest.raises(UserError, match=r"--reward_pretrain \(OpenLLaMA2: --critic_pretrain\) is required"):
        translate(path, "ppo")
    path = script(tmp_path, f"../train_ppo.py\n--pretrain m\n--reward_pretrain r\n--prompt_data {data['prompts']}")
    with pytest.raises(UserError, match=r"the 6 prompts make no full rollout batch of 512"):
        translate(path, "ppo")  # OpenLLaMA2's default rollout batch


class _Runs:
    """A pickle that would create ``path`` when unpickled (torch.load without weights_only)."""

    def __init__(self, path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_openllama2_pt_names_the_model_saved_for_it_and_a_real_pt_is_refused(tmp_path, data, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ckpt" / "sft_model").mkdir(parents=True)
    (tmp_path / "ckpt" / "sft_model" / "config.json").write_text('{"model_type": "llama"}')
    rm = f"../train_rm.py\n--pretrain base\n--load_model ./ckpt/sft_model.pt\n--dataset {data['pairs']}\n"
    rm += "--save_path ./ckpt"
    out, notes = translate(script(tmp_path, rm), "rm")
    assert (out["model_name_or_path"], out["tokenizer_name_or_path"], out["output_dir"]) == (
        "./ckpt/sft_model",  # the directory an OpenLLaMA2 SFT script with --save_path ./ckpt wrote here
        "base",  # OpenLLaMA2: --pretrain gives the architecture and tokenizer when --load_model gives the weights
        "./ckpt/rm_model",  # beside it, where a later ./ckpt/rm_model.pt finds it
    )
    assert ("--load_model ./ckpt/sft_model.pt: OpenLLaMA2's sft_model.pt; the model saved for it here, "
            "./ckpt/sft_model, is loaded (Hugging Face format)") in notes  # fmt: skip
    # OpenLLaMA2's later scripts load sft_model_ocra.pt, which its users renamed sft_model.pt to
    with pytest.raises(UserError, match=r"neither './ckpt/sft_model_ocra.pt' nor .*; ./ckpt holds sft_model: rename"):
        translate(script(tmp_path, rm.replace("sft_model.pt", "sft_model_ocra.pt")), "rm")
    # OpenRLHF's own CLI saves the model in --save_path itself
    cli = f"openrlhf.cli.train_rm\n--pretrain ./ckpt/sft_model\n--dataset {data['pairs']}\n--save_path ./ckpt/rm"
    assert translate(script(tmp_path, cli, "cli.sh"), "rm")[0]["output_dir"] == "./ckpt/rm"
    # a real .pt is a pickle, which can run code: refused unopened, naming the directory to give instead
    ran = tmp_path / "unpickled"
    (tmp_path / "ckpt" / "sft_model.pt").write_bytes(pickle.dumps(_Runs(ran)))
    refused = r"--load_model: './ckpt/sft_model.pt' is a state dict, OpenLLaMA2's .pt format; nothing is unpickled"
    with pytest.raises(UserError, match=refused + r" here: .*\(the model saved for it here, ./ckpt/sft_model\)"):
        translate(script(tmp_path, rm), "rm")
    assert not ran.exists()


def test_normalize_reward_with_stored_statistics_is_refused(tmp_path, data):
    rm = tmp_path / "rm"
    rm.mkdir()
    (rm / "config.json").write_text(json.dumps({"model_type": "llama", "mean": 0.5, "std": 2.0}))
    path = script(tmp_path, f"../train_ppo.py\n--pretrain m\n--reward_pretrain {rm}\n--prompt_data {data['prompts']}"
                  "\n--rollout_batch_size 2\n--train_batch_size 2\n--normalize_reward")  # fmt: skip
    with pytest.raises(UserError, match="stores a mean and std, which OpenRLHF applies"):
        translate(path, "ppo")


# --- conformance: the three commands of the OpenLLaMA2 document -----------------------------------------
def published(name: str, tmp_path, edits: dict[str, str], source: str = PUBLISHED) -> str:
    """The published script ``name`` with each ``old -> new`` of ``edits`` applied as text (each must be there)."""
    with open(os.path.join(source, name), encoding="utf-8") as f:
        text = f.read()
    for old, new in edits.items():
        assert old in text, (name, old)
        text = text.replace(old, new)
    (tmp_path / name).write_text(text, encoding="utf-8")
    return str(tmp_path / name)


@pytest.fixture
def records_logs(caplog, monkeypatch):
    """The run scripts reconfigure logging (basicConfig(force=True)), which drops pytest's handler: put it back."""
    original = logging.basicConfig

    def keep_caplog(*args, **kwargs):
        original(*args, **kwargs)
        logging.getLogger().addHandler(caplog.handler)

    monkeypatch.setattr(logging, "basicConfig", keep_caplog)
    caplog.set_level(logging.INFO)
    return caplog


@pytest.fixture
def loads(monkeypatch):
    """Each model a run loads from a directory: (its real path, the embedding and score head as loaded, float)."""
    seen: list[tuple[str, dict]] = []
    original = modeling.check_weights_match

    def record(model, missing, path):
        keep = {k: v.detach().float().clone() for k, v in model.state_dict().items() if k in WATCHED}
        seen.append((os.path.realpath(path), keep))
        return original(model, missing, path)

    monkeypatch.setattr(modeling, "check_weights_match", record)
    return seen


WATCHED = ("model.embed_tokens.weight", "score.weight")


def saved(directory) -> dict:
    return {k: v.float() for k, v in load_file(os.path.join(directory, "model.safetensors")).items() if k in WATCHED}


@pytest.mark.slow
def test_openllama2_sft_rm_ppo_scripts_run_as_published(tmp_path, records_logs, loads, monkeypatch):
    """The seed's three OpenLLaMA2 commands (fdda2cc6) run in sequence from examples/scripts, as published: one
    --save_path ./ckpt/7b_llama for all three, the RM loading ./ckpt/7b_llama/sft_model.pt, PPO rm_model.pt and
    sft_model.pt. Only the model and data names and the sizes are replaced; each stage loads the weights the one
    before saved (checked by value)."""
    base = tmp_path / "llama"  # what "meta-llama/Llama-2-7b-hf" names: a tiny Llama with its tokenizer
    tiny_model("llama").save_pretrained(base)
    tokenizer().save_pretrained(base)
    scripts, data = tmp_path / "examples" / "scripts", tmp_path / "data"
    scripts.mkdir(parents=True)
    data.mkdir()
    monkeypatch.chdir(scripts)  # as the seed runs them: cd examples/scripts; ./train_sft_llama.sh
    save = scripts / "ckpt" / "7b_llama"
    model = {'"meta-llama/Llama-2-7b-hf"': '"../../llama"'}

    # SFT: the hub data set -> 256 local SFT records (two steps of the published global batch 128)
    first_lines(os.path.join(SFT_SAMPLE, "sft_train.jsonl"), data / "orca.jsonl", 256)
    sft = seed("train_sft_llama.sh", scripts, {**model, "'Open-Orca/OpenOrca'": "'../../data/orca.jsonl'"})
    run_finetune.main([sft])
    assert read_json(save / "sft_model" / "trainer_state.json")["global_step"] == 2
    log = records_logs.text
    assert "--train_batch_size 128 -> gradient_accumulation_steps = 128 (128 / (1 x 1 process(es)))" in log
    assert '--save_path ./ckpt/7b_llama -> output_dir = "./ckpt/7b_llama/sft_model" (OpenLLaMA2 saves' in log
    assert '--bf16 -> fp16_opt_level = "O2"' in log and "--zero_stage 2: DeepSpeed: memory and speed only" in log
    sft_weights = saved(save / "sft_model")
    base_embed = saved(base)["model.embed_tokens.weight"].bfloat16().float()
    assert not torch.equal(sft_weights["model.embed_tokens.weight"], base_embed)  # SFT moved the weights

    # RM: the four hub pair sets -> four local files (the published mixing probabilities kept); --load_model
    # './ckpt/7b_llama/sft_model.pt' as published
    names = []
    for i in range(4):
        first_lines(os.path.join(SAMPLE, "pairs_train.jsonl"), data / f"p{i}.jsonl", 16, 16 * i)
        names.append(f"../../data/p{i}.jsonl")
    pairs = ("'Anthropic/hh-rlhf,tasksource/oasst1_pairwise_rlhf_reward,lmsys/chatbot_arena_conversations,"
             "openai/webgpt_comparisons'")  # fmt: skip
    before = len(loads)
    run_reward.main([seed("train_rm_llama.sh", scripts, {**model, pairs: f"'{','.join(names)}'"})])
    assert "--load_model ./ckpt/7b_llama/sft_model.pt: OpenLLaMA2's sft_model.pt; the model saved for it here, " \
           "./ckpt/7b_llama/sft_model, is loaded" in records_logs.text  # fmt: skip
    [(path, weights)] = loads[before:]
    assert path == str(save / "sft_model")
    assert torch.equal(weights["model.embed_tokens.weight"], sft_weights["model.embed_tokens.weight"])
    rm_weights = saved(save / "rm_model")
    assert not torch.equal(rm_weights["model.embed_tokens.weight"], sft_weights["model.embed_tokens.weight"])

    # PPO: the three hub prompt sets -> three local files (8 prompts); --rollout_batch_size 1024 -> 4,
    # --train_batch_size 128 -> 4 (it must divide the rollout batch), --generate_max_len 1024 -> 8: two PPO steps
    for i, n in enumerate((4, 2, 2)):
        first_lines(os.path.join(SAMPLE, "prompts.jsonl"), data / f"q{i}.jsonl", n, 4 * i)
    prompts = "'yahma/alpaca-cleaned,Dahoas/full-hh-rlhf,tasksource/oasst1_pairwise_rlhf_reward'"
    before = len(loads)
    run_ppo.main([seed("train_ppo_llama.sh", scripts, {
        **model,
        prompts: "'../../data/q0.jsonl,../../data/q1.jsonl,../../data/q2.jsonl'",
        "--rollout_batch_size 1024": "--rollout_batch_size 4",
        "--train_batch_size 128": "--train_batch_size 4",
        "--generate_max_len 1024": "--generate_max_len 8",
    })])  # fmt: skip
    history = read_json(save / "ppo_model" / "log_history.json")
    assert [h["step"] for h in history] == [1, 2] and all(h["response_length"] <= 8 for h in history)
    by_path: dict[str, list[dict]] = {}
    for path, weights in loads[before:]:
        by_path.setdefault(path, []).append(weights)
    assert sorted(by_path) == [str(save / "rm_model"), str(save / "sft_model")]
    for weights in by_path[str(save / "sft_model")]:  # the actor and its reference
        assert torch.equal(weights["model.embed_tokens.weight"], sft_weights["model.embed_tokens.weight"])
    for weights in by_path[str(save / "rm_model")]:  # the reward model and the critic, a copy of it
        assert all(torch.equal(weights[k], rm_weights[k]) for k in WATCHED)
    assert sorted(os.listdir(save)) == ["ppo_model", "rm_model", "sft_model"]  # one directory per stage
    assert (save / "ppo_model" / "actor" / "model.safetensors").exists()
    log = records_logs.text
    assert "--num_episodes 1 (train_ppo.py's default) -> training.max_steps = 2 (1 x (8 prompts // 4))" in log
    assert "--reward_model_path ./ckpt/7b_llama/rm_model.pt: OpenLLaMA2's rm_model.pt" in log
    assert "--normalize_reward: the reward model stores no mean / std" in log
    # a later script's ppo_model.pt is PPO's actor
    flags = "--pretrain ../../llama\n--load_model ./ckpt/7b_llama/ppo_model.pt\n--dataset ../../data/orca.jsonl"
    out, _ = translate(script(tmp_path, f"../train_sft.py\n{flags}"), "sft")
    assert out["model_name_or_path"] == "./ckpt/7b_llama/ppo_model/actor"


def seed(name: str, folder, edits: dict[str, str]) -> str:
    """The seed's script ``name`` (tests/data/openrlhf/fdda2cc6) in ``folder`` with each ``old -> new`` of ``edits``
    applied as text (each must be there); its name, to run from ``folder``."""
    published(name, folder, edits, os.path.join(PUBLISHED, "fdda2cc6"))
    return name


def test_flat_reader_takes_overrides_after_the_script(tmp_path, data):
    path = script(tmp_path, f"../train_sft.py\n--pretrain {os.path.join(ROOT, 'llm', 'assets', 'tiny-llama')}\n"
                  f"--dataset {data['sft']}\n--micro_train_batch_size 2\n--train_batch_size 4")  # fmt: skip
    _, _, training = parse_arguments([path, "--max_steps", "1", "--output_dir", str(tmp_path / "o")])
    assert (training.max_steps, training.gradient_accumulation_steps, training.adam_beta2) == (1, 2, 0.95)
    assert any("-> gradient_accumulation_steps = 2" in note for note in training.config_notes)


def test_the_2026_objective_flags(tmp_path, data):
    """OpenRLHF's names for DAPO's clip-higher, dual-clip, GSPO, dynamic filtering, the overlong buffer and async
    training land on our fields, each with its log line."""
    path = script(
        tmp_path,
        f"""
        openrlhf.cli.train_ppo
        --pretrain sft_dir
        --reward_pretrain rm_dir
        --prompt_data {data["prompts"]}
        --n_samples_per_prompt 4
        --rollout_batch_size 2
        --train_batch_size 8
        --advantage_estimator group_norm
        --eps_clip_low_high 0.2 0.28
        --policy_loss_type gspo
        --dynamic_filtering
        --dynamic_filtering_reward_range 0 1
        --overlong_buffer_len 64
        --overlong_penalty_factor 0.5
        --async_train
        """,
    )
    config, notes = translate(path, "ppo")
    a = config["actor_rollout"]
    assert (a["clip_ratio_low"], a["clip_ratio_high"], a["policy_loss"]) == (0.2, 0.28, "gspo")
    assert a["async_rollout"] is True and config["algorithm"]["filter_groups"] is True
    assert (config["reward"]["overlong_buffer_len"], config["reward"]["overlong_penalty_factor"]) == (64, 0.5)
    assert any("--dynamic_filtering_reward_range" in n for n in notes)
    dual = script(
        tmp_path,
        "openrlhf.cli.train_ppo\n--pretrain sft_dir\n--reward_pretrain rm_dir\n"
        f"--prompt_data {data['prompts']}\n--rollout_batch_size 2\n--dual_clip 3.0\n--policy_loss_type ppo",
        name="dual.sh",
    )
    a = translate(dual, "ppo")[0]["actor_rollout"]
    assert (a["policy_loss"], a["clip_ratio_c"]) == ("dual_clip", 3.0)
    alone = dual.replace("dual.sh", "alone.sh")
    with open(dual, encoding="utf-8") as f, open(alone, "w", encoding="utf-8") as g:
        g.write(f.read().replace(" \\\n--policy_loss_type ppo", ""))
    assert translate(alone, "ppo")[0]["actor_rollout"]["policy_loss"] == "dual_clip"
    with open(dual, encoding="utf-8") as f, open(alone, "w", encoding="utf-8") as g:
        g.write(f.read().replace("--policy_loss_type ppo", "--policy_loss_type gspo"))
    with pytest.raises(UserError, match="dual-clip bounds the ppo loss only"):
        translate(alone, "ppo")
