"""Shared test fixtures: tiny models built in-process, the bundled tokenizer."""

import copy
import json
import os

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from llm.utils.attention import PACKED_SDPA
from llm.utils.modeling import tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER_DIR = os.path.join(ROOT, "llm", "assets", "tiny_tokenizer")


def tokenizer():
    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


def tiny_model(model_type="llama", auto_class=AutoModelForCausalLM, attn=PACKED_SDPA, seed=0, vocab=648, **overrides):
    # A fresh config per model: transformers writes the attention choice into the config object.
    config = copy.deepcopy(tiny_config(model_type, vocab, pad_token_id=0, **overrides))
    transformers.set_seed(seed)
    return auto_class.from_config(config, attn_implementation=attn, dtype=torch.float32)


SECOND_EOS = 7  # two_eos_model's second EOS id (an ordinary token of the bundled tokenizer)


def two_eos_model(directory: str, scale: float = 40.0) -> int:
    """A seeded tiny Llama (bundled tokenizer, EOS 2) whose generation_config.json lists EOS ids [2, SECOND_EOS] while
    its config.json names 2 only (as Qwen2.5-Instruct's), the LM-head row of SECOND_EOS scaled up so that it is sampled
    often; returns the tokenizer's EOS id."""
    tok = tokenizer()
    model = tiny_model(attn="sdpa", vocab=len(tok), eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    with torch.no_grad():
        model.lm_head.weight[SECOND_EOS] *= scale
    model.generation_config.eos_token_id = [tok.eos_token_id, SECOND_EOS]
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return tok.eos_token_id


def twin(model, attn):
    """Same weights, another attention implementation."""
    other = type(model)._from_config(copy.deepcopy(model.config), attn_implementation=attn, dtype=torch.float32)
    other.load_state_dict(model.state_dict())
    return other


def reward_trainer(process_reward: bool, reward_token_ids=None, **kwargs):
    """The reward trainer ``build_reward_trainer`` picks: a ``PRMTrainer`` (reading ``reward_token_ids``) or an
    ``ORMTrainer``, built from ``Trainer`` keywords."""
    from llm.alignment.rm.orm_trainer import ORMTrainer
    from llm.alignment.rm.prm_trainer import PRMTrainer

    if process_reward:
        return PRMTrainer(reward_token_ids=reward_token_ids, **kwargs)
    return ORMTrainer(**kwargs)


def ppo_config_file(tmp_path, source: str, name: str, *layers: dict) -> str:
    """A copy of the PPO config ``source`` in ``tmp_path`` (``<name>_<n>.json``) with its repository paths made
    absolute, output in ``tmp_path/out``, no reports, no checkpoints, then each of ``layers`` (``{section:
    {field: value}}``) merged in order."""
    with open(source, encoding="utf-8") as f:
        cfg = json.load(f)
    for sec, key in (
        ("actor_rollout", "model_name_or_path"),
        ("actor_rollout", "tokenizer_name_or_path"),
        ("data", "train_dataset_path"),
    ):
        cfg[sec][key] = os.path.join(ROOT, cfg[sec][key])
    cfg["training"].update(output_dir=str(tmp_path / "out"), report_to="none", disable_tqdm=True, save_steps=0)
    for layer in layers:
        for sec, values in layer.items():
            cfg.setdefault(sec, {}).update(values)
    path = tmp_path / f"{name}_{len(list(tmp_path.glob(f'{name}_*')))}.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def read_json(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]
