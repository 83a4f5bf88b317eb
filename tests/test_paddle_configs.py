"""Conformance: PaddleNLP's own argument files run here as a migrating user would run them.

Each config below has the keys and values of a real file in PaddleNLP's ``llm/config/`` (named in
``PADDLE_FILES``; written out here, not copied, from the public repository at the time of writing).
``for_cpu`` changes only what the issue allows a one-process CPU run to change: model and data paths,
``max_steps`` (and the eval/save interval to fit it), and the fields a CPU cannot honour
(``use_flash_attention``, ``tensor_parallel_degree``, ``sharding_parallel_degree``); fp16 + O2 (the Qwen
files) runs as it is, with fp16 autocast and loss scaling on the CPU.
Everything else, bf16 with ``fp16_opt_level: "O2"``, PaddleNLP's names (``dataset_name_or_path``,
``src_length``, ``max_length``, ``train_datasets``, ``regularization``, ...), ``sharding: stage1/2``,
``metric_for_best_model: "accuracy"``, ``load_best_model_at_end``, stays as PaddleNLP ships it.
"""

import json
import math
import os

import pytest
import torch
from safetensors.torch import load_file

from llm import run_dpo, run_finetune, run_reward
from tests.helpers import ROOT

SAMPLE = os.path.join(ROOT, "llm", "data", "sample")
SFT_SAMPLE = os.path.join(ROOT, "llm", "data", "sample_sft")

# The flashmask family (PRM, RM, DPO, SimPO files) shares these keys and values.
FLASHMASK = {
    "model_name_or_path": "meta-llama/Meta-Llama-3-8B",
    "train_dataset_path": "./data/train.jsonl",
    "dev_dataset_path": "./data/dev.jsonl",
    "output_dir": "./checkpoints/dpo_ckpts",
    "per_device_train_batch_size": 1,
    "gradient_accumulation_steps": 8,
    "per_device_eval_batch_size": 1,
    "num_train_epochs": 1,
    "max_steps": 100,
    "learning_rate": 1e-06,
    "warmup_steps": 10,
    "logging_steps": 1,
    "evaluation_strategy": "steps",
    "save_strategy": "steps",
    "eval_steps": 100,
    "save_steps": 500,
    "max_seq_len": 4096,
    "max_prompt_len": 2048,
    "bf16": True,
    "fp16_opt_level": "O2",
    "do_train": True,
    "do_eval": True,
    "disable_tqdm": True,
    "load_best_model_at_end": True,
    "tensor_parallel_degree": 8,
    "sharding": "stage1",
    "use_flash_attention": True,
    "flash_mask": True,
    "recompute": False,
    "recompute_granularity": "full",
    "benchmark": False,
    "unified_checkpoint": True,
    "autotuner_benchmark": False,
}
SFT_BASE = {
    "model_name_or_path": "meta-llama/Meta-Llama-3-8B",
    "dataset_name_or_path": "./data",
    "output_dir": "./checkpoints/llama_sft_ckpts",
    "per_device_train_batch_size": 1,
    "gradient_accumulation_steps": 2,
    "per_device_eval_batch_size": 8,
    "eval_accumulation_steps": 16,
    "num_train_epochs": 3,
    "learning_rate": 3e-05,
    "warmup_steps": 30,
    "logging_steps": 1,
    "evaluation_strategy": "epoch",
    "save_strategy": "epoch",
    "src_length": 1024,
    "max_length": 2048,
    "bf16": True,
    "fp16_opt_level": "O2",
    "do_train": True,
    "do_eval": True,
    "disable_tqdm": True,
    "load_best_model_at_end": True,
    "eval_with_do_generation": False,
    "metric_for_best_model": "accuracy",
    "recompute": False,
    "save_total_limit": 1,
    "tensor_parallel_degree": 1,
    "pipeline_parallel_degree": 1,
    "pipeline_parallel_config": "disable_p2p_cache_shape",
    "sharding": "stage2",
    "zero_padding": False,
    "unified_checkpoint": True,
    "use_flash_attention": False,
}


def without(d, *keys):
    return {k: v for k, v in d.items() if k not in keys}


PRM_KEYS = {
    "process_reward": True,
    "placeholder_token": "ки",
    "reward_tokens": "+,-",
    "zero_padding": False,
    "save_total_limit": 1,
    "train_dataset_path": "./data/Math-Shepherd/test.json",
    "dev_dataset_path": "./data/Math-Shepherd/test.json",
    "tensor_parallel_degree": 4,
    "sharding_parallel_degree": 1,
    "flash_mask": False,
}
DPO_KEYS = {"beta": 0.1, "loss_type": "sigmoid", "label_smoothing": 0.0}

# (PaddleNLP file, script kind, config)
PADDLE_FILES = [
    ("llama/prm_flashmask_argument.json", "prm", {**FLASHMASK, **PRM_KEYS, "output_dir": "./checkpoints/prm_ckpts"}),
    (
        "mistral/prm_flashmask_argument.json",
        "prm",
        {
            **FLASHMASK,
            **PRM_KEYS,
            "model_name_or_path": "mistralai/Mistral-7B-v0.1",
            "train_dataset_path": "./data/Math-Shepherd/train.json",
            "output_dir": "./checkpoints/paddle_prm_ckpts",
            "per_device_train_batch_size": 2,
            "gradient_accumulation_steps": 4,
            "max_steps": 450000,
            "eval_steps": 50000,
            "save_steps": 50000,
        },
    ),
    ("llama/rm_flashmask_argument.json", "rm", {**FLASHMASK, "sharding_parallel_degree": 1, "flash_mask": False}),
    (
        "llama/rm_argument.json",
        "rm",
        {
            "model_name_or_path": "PKU-Alignment/alpaca-7b-reproduced",
            "train_datasets": "PKU-SafeRLHF-30K/train",
            "eval_datasets": "PKU-SafeRLHF-30K/test",
            "output_dir": "checkpoints/llama_rm",
            "per_device_train_batch_size": 1,
            "gradient_accumulation_steps": 1,
            "per_device_eval_batch_size": 16,
            "eval_accumulation_steps": 1,
            "num_train_epochs": 2,
            "logging_steps": 1,
            "evaluation_strategy": "epoch",
            "eval_steps": 1000,
            "save_strategy": "epoch",
            "save_steps": 1000,
            "max_length": 512,
            "bf16": True,
            "fp16_opt_level": "O2",
            "do_train": True,
            "do_eval": True,
            "disable_tqdm": True,
            "load_best_model_at_end": False,
            "metric_for_best_model": "accuracy",
            "recompute": True,
            "save_total_limit": 1,
            "sharding_parallel_degree": 4,
            "sharding": "stage2",
            "weight_decay": 0.1,
            "max_grad_norm": 0.0,
            "adam_beta1": 0.9,
            "adam_beta2": 0.95,
            "lr_scheduler_type": "cosine",
            "learning_rate": 2e-5,
            "warmup_ratio": 0.03,
            "normalize_score_during_training": False,
            "normalizer_type": "ExponentialMovingAverage",
            "normalizer_momentum": 0.9,
            "loss_type": "sequence-wise",
            "regularization": 0.001,
        },
    ),
    ("llama/dpo_argument.json", "dpo", {**FLASHMASK, **DPO_KEYS, "lazy": False, "seed": 42}),
    (
        "llama/simpo_argument.json",
        "dpo",
        {**FLASHMASK, **DPO_KEYS, "lazy": False, "seed": 42, "learning_rate": 6e-07, "beta": 2.0}
        | {"simpo_gamma": 1.0, "loss_type": "simpo"},
    ),
    (
        "mistral/dpo_argument.json",
        "dpo",
        {
            **without(FLASHMASK, "flash_mask"),
            **DPO_KEYS,
            "model_name_or_path": "mistralai/Mistral-7B-Instruct-v0.3",
            "dev_dataset_path": "./data/train.jsonl",
        },
    ),
    (
        "qwen/dpo_argument.json",
        "dpo",
        {
            **FLASHMASK,
            **DPO_KEYS,
            "model_name_or_path": "Qwen/Qwen2-7B",
            "tensor_parallel_degree": 4,
            "flash_mask": False,
        },
    ),
    (
        "qwen/dpo_argument_0p5b.json",
        "dpo",
        {
            **without(FLASHMASK, "bf16"),
            **DPO_KEYS,
            "model_name_or_path": "Qwen/Qwen2.5-0.5B-Instruct",
            "fp16": True,
            "tensor_parallel_degree": 1,
            "use_flash_attention": False,
            "flash_mask": False,
            "recompute": True,
            "greedy_zero_padding": False,
        },
    ),
    (
        "llama/flashmask/dpo.json",
        "dpo",
        {
            **without(FLASHMASK, "dev_dataset_path", "benchmark"),
            "model_name_or_path": "meta-llama/Meta-Llama-3.1-8B-Instruct",
            "train_dataset_path": "dpo_data/ultrafeedback.jsonl",
            "output_dir": "./checkpoints/dpo_ckpts_flashmask",
            "gradient_accumulation_steps": 2,
            "max_steps": 4000,
            "learning_rate": 5e-07,
            "warmup_ratio": 0.1,
            "evaluation_strategy": "no",
            "save_strategy": "no",
            "max_seq_len": 8192,
            "max_prompt_len": 8000,
            "do_eval": False,
            "tensor_parallel_degree": 4,
            "sharding": "stage2",
            "greedy_zero_padding": True,
            "lazy": True,
        },
    ),
    ("llama/sft_argument.json", "sft", SFT_BASE),
    (
        "mistral/sft_argument.json",
        "sft",
        {
            **without(SFT_BASE, "pipeline_parallel_config", "sharding", "unified_checkpoint", "use_flash_attention"),
            "model_name_or_path": "mistralai/Mistral-7B-Instruct-v0.3",
            "output_dir": "./checkpoints/mistral_sft_ckpts",
            "per_device_train_batch_size": 4,
            "gradient_accumulation_steps": 4,
            "recompute": True,
            "zero_padding": True,
            "tensor_parallel_degree": 8,
        },
    ),
    (
        "qwen/sft_argument.json",
        "sft",
        {
            **without(SFT_BASE, "pipeline_parallel_config"),
            "model_name_or_path": "Qwen/Qwen2-7B",
            "output_dir": "./checkpoints/sft_ckpts",
            "gradient_accumulation_steps": 4,
            "recompute": True,
            "use_flash_attention": True,
        },
    ),
    (
        "qwen/sft_argument_0p5b.json",
        "sft",
        {
            **without(SFT_BASE, "bf16", "pipeline_parallel_config"),
            "model_name_or_path": "Qwen/Qwen2.5-0.5B-Instruct",
            "output_dir": "./checkpoints/sft_ckpts",
            "fp16": True,
            "gradient_accumulation_steps": 4,
            "recompute": True,
        },
    ),
    (
        "llama/flashmask/sft.json",
        "sft",
        {
            **without(SFT_BASE, "warmup_steps"),
            "model_name_or_path": "meta-llama/Meta-Llama-3.1-8B-Instruct",
            "output_dir": "./checkpoints/llama_sft_flashmask",
            "gradient_accumulation_steps": 4,
            "per_device_eval_batch_size": 1,
            "max_steps": 12000,
            "learning_rate": 2e-05,
            "warmup_ratio": 0.03,
            "evaluation_strategy": "no",
            "save_strategy": "no",
            "src_length": 8000,
            "max_length": 8192,
            "do_eval": False,
            "tensor_parallel_degree": 2,
            "zero_padding": True,
            "tensor_parallel_output": True,
            "use_flash_attention": True,
            "greedy_zero_padding": True,
            "lazy": True,
            "flash_mask": True,
        },
    ),
]
assert len(PADDLE_FILES) == 15

SCRIPTS = {"prm": run_reward, "rm": run_reward, "dpo": run_dpo, "sft": run_finetune}
MODELS = {"prm": "tiny-prm", "rm": "tiny-llama", "dpo": "tiny-llama", "sft": "tiny-llama"}


def first_lines(src, dst, n):
    with open(src, encoding="utf-8") as f:
        lines = [next(f) for _ in range(n)]
    with open(dst, "w", encoding="utf-8") as f:
        f.writelines(lines)
    return str(dst)


def math_shepherd_paddle(src, dst, n):
    """PaddleNLP's Math-Shepherd conversion of our sample PRM records: ``src: [""]``, the question at the start
    of the first step."""
    with open(src, encoding="utf-8") as f, open(dst, "w", encoding="utf-8") as out:
        for _, line in zip(range(n), f):
            rec = json.loads(line)
            steps = [f"{rec['src'][0]} {rec['responses'][0]}", *rec["responses"][1:]]
            out.write(json.dumps({"src": [""], "tgt": [], "responses": steps, "labels": rec["labels"]}) + "\n")
    return str(dst)


def for_cpu(cfg: dict, kind: str, tmp_path) -> dict:
    """Only model/data paths, steps and what one CPU process cannot honour change."""
    c = dict(cfg)
    c["model_name_or_path"] = os.path.join(ROOT, "llm", "assets", MODELS[kind])
    c["tokenizer_name_or_path"] = os.path.join(ROOT, "llm", "assets", "tiny_tokenizer")
    c["init_from_config"] = True  # the tiny model directories hold a config, no weights
    if kind == "prm":
        data = [
            math_shepherd_paddle(os.path.join(SAMPLE, f"prm_{s}.jsonl"), tmp_path / f"{s}.json", 8)
            for s in ("train", "dev")
        ]
    elif kind in ("rm", "dpo"):
        data = [
            first_lines(os.path.join(SAMPLE, f"pairs_{s}.jsonl"), tmp_path / f"{s}.jsonl", 8) for s in ("train", "dev")
        ]
    else:
        folder = tmp_path / "data"
        folder.mkdir()
        for s in ("train", "dev"):
            first_lines(os.path.join(SFT_SAMPLE, f"sft_{s}.jsonl"), folder / f"{s}.json", 8)
        c["dataset_name_or_path"] = str(folder)
    for key, path in zip(("train_dataset_path", "dev_dataset_path"), data if kind != "sft" else ()):
        if key in c:
            c[key] = path
    for key, path in zip(("train_datasets", "eval_datasets"), data if kind != "sft" else ()):
        if key in c:
            c[key] = f"local:1:{path}"
    c["output_dir"] = str(tmp_path / "out")
    c["max_steps"] = 2
    for key in ("eval_steps", "save_steps"):
        if key in c:
            c[key] = 1
    c["use_flash_attention"] = False
    c["tensor_parallel_degree"] = 1
    if "sharding_parallel_degree" in c:
        c["sharding_parallel_degree"] = 1
    c["report_to"] = "none"
    return c


@pytest.mark.slow
@pytest.mark.parametrize("paddle_file, kind, cfg", PADDLE_FILES, ids=[f for f, _, _ in PADDLE_FILES])
def test_paddle_config_runs(tmp_path, paddle_file, kind, cfg):
    c = for_cpu(cfg, kind, tmp_path)
    path = tmp_path / os.path.basename(paddle_file)
    path.write_text(json.dumps(c, ensure_ascii=False))
    SCRIPTS[kind].main([str(path)])

    out = tmp_path / "out"
    results = json.loads((out / "all_results.json").read_text())
    assert math.isfinite(results["train_loss"]), results
    weights = load_file(str(out / "model.safetensors"))
    # O2 keeps the weights in half precision: the saved model is bf16 / fp16, as PaddleNLP's would be.
    assert {t.dtype for t in weights.values()} == {torch.float16 if c.get("fp16") else torch.bfloat16}
    if c.get("do_eval"):
        metric = c.get("metric_for_best_model")
        if metric:
            assert f"eval_{metric}" in results, sorted(results)
