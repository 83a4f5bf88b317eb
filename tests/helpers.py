"""Shared test fixtures: tiny models built in-process, the bundled tokenizer."""

import copy
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


def twin(model, attn):
    """Same weights, another attention implementation."""
    other = type(model)._from_config(copy.deepcopy(model.config), attn_implementation=attn, dtype=torch.float32)
    other.load_state_dict(model.state_dict())
    return other
