"""Model and tokenizer loading. Architectures are picked by ``config.model_type`` through the Auto classes."""

from __future__ import annotations

import functools
import logging
import os

import torch
import transformers
from torch.utils.checkpoint import checkpoint
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from llm.utils.attention import PACKED_SDPA, RECOMPUTE_CORE_ATTENTION
from llm.utils.distributed import Layout, distributed_config, place_model
from llm.utils.errors import UserError

logger = logging.getLogger(__name__)

WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def tiny_config(model_type: str, vocab_size: int, **overrides) -> PretrainedConfig:
    """A small decoder config of any architecture (llama, mistral, qwen2, ...) for tests and the demo."""
    kwargs = {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    }
    kwargs.update(overrides)
    return AutoConfig.for_model(model_type, **kwargs)


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise UserError(f"tokenizer_name_or_path {path!r}: cannot load a tokenizer ({err})") from None
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise UserError(f"tokenizer {path!r} has neither a pad nor an eos token: add a pad token")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(
    auto_class: type,
    path: str,
    *,
    init_from_config: bool,
    seed: int,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = PACKED_SDPA,
    pad_token_id: int | None = None,
    layout: Layout | None = None,
    recompute: str | None = None,
    **config_overrides,
) -> PreTrainedModel:
    """Load ``auto_class`` (AutoModelForCausalLM, AutoModelForSequenceClassification...) from ``path``.

    With ``init_from_config`` the weights are random, seeded, built from ``path/config.json``. Either way
    the global RNG is seeded with ``seed`` first, so the weights ``from_pretrained`` draws for what the
    checkpoint lacks (a ``score`` head on a causal-LM checkpoint) are the same in every run, on every rank
    and under every layout.
    ``layout`` (FSDP2 sharding / tensor parallel) places the model across the processes: every rank
    reads only its own shard of a checkpoint. ``recompute`` (``full_attn`` | ``core_attn``): see ``enable_recompute``.
    """
    parallel = distributed_config(layout) if layout is not None else None
    if not os.path.isdir(path) and not init_from_config and "/" not in path:
        raise UserError(f"model_name_or_path {path!r}: no such directory")
    try:
        config = AutoConfig.from_pretrained(path, **config_overrides)
    except (OSError, ValueError) as err:
        raise UserError(f"model_name_or_path {path!r}: cannot read config.json ({err})") from None
    if pad_token_id is not None:
        config.pad_token_id = pad_token_id
    transformers.set_seed(seed)
    if init_from_config:
        if os.path.isdir(path) and any(os.path.exists(os.path.join(path, f)) for f in WEIGHT_FILES):
            raise UserError(
                f"init_from_config is true but {path} holds trained weights: set init_from_config false to load them"
            )
        model = auto_class.from_config(config, attn_implementation=attn_implementation, dtype=dtype)
        logger.info("initialised %s randomly from %s/config.json (seed %d)", type(model).__name__, path, seed)
    else:
        if os.path.isdir(path) and not any(os.path.exists(os.path.join(path, f)) for f in WEIGHT_FILES):
            raise UserError(
                f"model_name_or_path {path}: no weights found ({', '.join(WEIGHT_FILES)}); "
                "for a random tiny model set init_from_config true"
            )
        extra = {"distributed_config": parallel} if parallel is not None else {}
        try:
            model = auto_class.from_pretrained(
                path, config=config, attn_implementation=attn_implementation, dtype=dtype, **extra
            )
        except ValueError as err:
            if parallel is None:
                raise
            raise UserError(f"{path}: cannot shard {config.model_type} as {layout.describe()}: {err}") from None
    if layout is not None and layout.native:
        try:
            model = place_model(model, layout, parallel)
        except ValueError as err:
            raise UserError(f"{path}: cannot shard {config.model_type} as {layout.describe()}: {err}") from None
    if recompute is not None:
        enable_recompute(model, recompute)
    if not getattr(model, "_supports_attention_backend", False):
        raise UserError(
            f"model_type {config.model_type!r} does not route attention through transformers' AttentionInterface, "
            "so packed rows cannot be made exact: use a Llama/Mistral/Qwen2-style decoder"
        )
    return model


def enable_recompute(model: torch.nn.Module, granularity: str) -> None:
    """Paddle's ``recompute_granularity`` below a whole decoder layer (``full`` is transformers' per-layer
    activation checkpointing): ``full_attn`` recomputes each self-attention block (projections, rotary
    embedding, attention) in backward, ``core_attn`` only the attention kernel. Parameter names stay as
    they are, so checkpoints are unchanged."""
    blocks = [module for name, module in model.named_modules() if name.endswith("self_attn")]
    if not blocks:
        raise UserError(f"recompute_granularity={granularity!r}: {type(model).__name__} has no self_attn blocks")
    for block in blocks:
        if granularity == "core_attn":
            setattr(block, RECOMPUTE_CORE_ATTENTION, True)
        else:
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
