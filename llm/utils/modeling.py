"""Model and tokenizer loading. Architectures are picked by ``config.model_type`` through the Auto classes."""

from __future__ import annotations

import contextvars
import functools
import json
import logging
import os
import pickle
import re
from collections.abc import Iterable

import torch
import transformers
from safetensors import SafetensorError
from torch.utils.checkpoint import checkpoint
from transformers import (
    AutoConfig,
    AutoTokenizer,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from llm.utils.attention import PACKED_SDPA, RECOMPUTE_CORE_ATTENTION
from llm.utils.distributed import Layout, distributed_config, place_model
from llm.utils.errors import UserError
from llm.utils.gguf import is_gguf, load_gguf_config, load_gguf_model, load_gguf_tokenizer
from llm.utils.paths import tried

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


# What may name a Hugging Face Hub repository (``org/name`` or ``name``); anything else is a local path.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


def check_model_dir(path: str, field: str) -> None:
    """A model or tokenizer path that is not a directory stops the run: a file, or a local path that does
    not exist (absolute, ``./``, ``~``: not a Hub id), is named with the places looked at. A Hub-id-like
    name that is not a directory is left to ``from_pretrained`` (the local Hub cache)."""
    if os.path.isdir(path) or is_gguf(path):
        return
    if os.path.exists(path):
        raise UserError(
            f"{field} {path!r} is a file, not a model directory: give the directory that holds config.json "
            "(or a .gguf file)"
        )
    if not _HUB_ID.fullmatch(path) or path.startswith("."):
        raise UserError(
            f"{field} {path!r}: the directory does not exist (looked in: {tried(path)}); give an existing "
            "model directory (relative paths are read from the working directory or the repository root)"
        )


def _not_found(field: str, path: str, what: str, err: Exception) -> UserError:
    if os.path.isdir(path):
        return UserError(f"{field} {path!r}: cannot load {what} ({err})")
    return UserError(
        f"{field} {path!r}: no such directory (looked in: {tried(path)}) and no Hub model of that name in the "
        f"local cache ({err}); give an existing model directory"
    )


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    check_model_dir(path, "tokenizer_name_or_path")
    if is_gguf(path):
        tokenizer = load_gguf_tokenizer(path)
    else:
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError) as err:
            raise _not_found("tokenizer_name_or_path", path, "a tokenizer", err) from None
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise UserError(f"tokenizer {path!r} has neither a pad nor an eos token: add a pad token")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_config(path: str, **overrides) -> PretrainedConfig:
    """The model config of ``model_name_or_path`` ``path``: its config.json, or a GGUF file's metadata."""
    if is_gguf(path):
        return load_gguf_config(path, **overrides)
    try:
        return AutoConfig.from_pretrained(path, **overrides)
    except (OSError, ValueError) as err:
        raise _not_found("model_name_or_path", path, "config.json", err) from None


def generation_eos_ids(path: str) -> list[int]:
    """The EOS ids of ``model_name_or_path`` ``path``'s generation config, which ``generate`` (and TRL's rollouts)
    stop on besides the tokenizer's: its ``generation_config.json`` when it has one, else its config's
    ``eos_token_id`` (a ``.gguf`` file: what its metadata gives), as transformers makes a model's generation config.
    Reads no weights; [] when unset."""
    file = os.path.join(path, "generation_config.json")
    if not is_gguf(path) and (not os.path.isdir(path) or os.path.isfile(file)):
        try:
            return eos_id_list(GenerationConfig.from_pretrained(path).eos_token_id)
        except OSError as err:
            if os.path.isdir(path):
                raise UserError(f"{file}: cannot read it ({err}): fix or remove the file") from None
            # a Hub name without a generation config: its config's, as transformers does
    return eos_id_list(getattr(load_config(path), "eos_token_id", None))


def eos_id_list(value) -> list[int]:
    """A config's ``eos_token_id`` (an id, a list of ids, or None) as a list."""
    return [] if value is None else [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]


def stop_token_ids(tokenizer: PreTrainedTokenizerBase, generation_eos: Iterable[int] = ()) -> tuple[int, ...]:
    """The token ids that end a generated response: the tokenizer's EOS first, then the generation config's EOS
    ids (``generation_eos_ids``) in their order, each once (TRL's GRPO stops on the same set)."""
    first = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    return tuple(dict.fromkeys([*first, *generation_eos]))


def model_stop_ids(model, tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """``stop_token_ids`` of a model already loaded: its ``generation_config``'s EOS ids (what loading it gave);
    logged when they are more than the tokenizer's EOS."""
    config = getattr(model, "generation_config", None)
    stop_ids = stop_token_ids(tokenizer, eos_id_list(getattr(config, "eos_token_id", None)))
    log_stop_ids(stop_ids, tokenizer, getattr(model, "name_or_path", "") or type(model).__name__)
    return stop_ids


def log_stop_ids(stop_ids: tuple[int, ...], tokenizer: PreTrainedTokenizerBase, source: str) -> None:
    """One log line naming the stop ids, when the model's generation config adds any to the tokenizer's EOS."""
    if stop_ids and stop_ids != (tokenizer.eos_token_id,):
        logger.info(
            "responses end at any of the token ids %s (%s): the tokenizer's EOS and the eos_token_id of %s's "
            "generation config",
            list(stop_ids),
            ", ".join(repr(t) for t in tokenizer.convert_ids_to_tokens(list(stop_ids))),
            source,
        )


# set while a run that resumes a checkpoint builds its model (llm/alignment/recipe.py): a config-built model's
# random weights are then replaced at once, and the log says so instead of "initialised randomly"
RESUMING: contextvars.ContextVar[bool] = contextvars.ContextVar("resuming", default=False)


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
    quantization_config=None,
    **config_overrides,
) -> PreTrainedModel:
    """Load ``auto_class`` (AutoModelForCausalLM, AutoModelForSequenceClassification...) from ``path``.

    With ``init_from_config`` the weights are random, seeded, built from ``path/config.json``. Either way
    the global RNG is seeded with ``seed`` first, so the weights ``from_pretrained`` draws for what the
    checkpoint lacks (a ``score`` head on a causal-LM checkpoint) are the same in every run, on every rank
    and under every layout.
    ``layout`` (FSDP2 sharding / tensor parallel) places the model across the processes: every rank
    reads only its own shard of a checkpoint. ``recompute`` (``full_attn`` | ``core_attn``): see ``enable_recompute``.
    ``quantization_config`` (QLoRA's ``BitsAndBytesConfig``, ``llm.utils.lora``) goes to ``from_pretrained``.
    """
    parallel = distributed_config(layout) if layout is not None else None
    check_model_dir(path, "model_name_or_path")
    if not any(os.path.exists(os.path.join(path, f)) for f in WEIGHT_FILES) and os.path.exists(
        os.path.join(path, "adapter_config.json")
    ):
        raise UserError(
            f"model_name_or_path {path} holds a PEFT (LoRA) adapter, not a model: give its base model with "
            f"lora true and lora_path {path}, or the merged model ({os.path.join(path, 'merged')}, written with "
            "lora_merge)"
        )
    gguf = is_gguf(path)
    if gguf and parallel is not None:
        raise UserError(
            f"model_name_or_path {path} is a GGUF file, which is not read shard by shard: convert it first "
            "(python llm/convert_gguf.py FILE.gguf --output DIR) and give DIR"
        )
    if gguf and quantization_config is not None:
        raise UserError(
            f"model_name_or_path {path} is a GGUF file, read as float weights, which transformers cannot quantize "
            "again for QLoRA (weight_quantize_algo): unset weight_quantize_algo (plain LoRA), or convert it first "
            "(python llm/convert_gguf.py FILE.gguf --output DIR) and give DIR"
        )
    config = load_config(path, **config_overrides)
    if pad_token_id is not None:
        config.pad_token_id = pad_token_id
    transformers.set_seed(seed)
    if init_from_config:
        if gguf or os.path.isdir(path) and any(os.path.exists(os.path.join(path, f)) for f in WEIGHT_FILES):
            raise UserError(
                f"init_from_config is true but {path} holds trained weights: set init_from_config false to load them"
            )
        model = auto_class.from_config(config, attn_implementation=attn_implementation, dtype=dtype)
        if RESUMING.get():  # random weights only until the checkpoint's replace them: not worth a line saying so
            logger.info(
                "built %s from %s/config.json; its weights come from the checkpoint resumed", type(model).__name__, path
            )
        else:
            logger.info("initialised %s randomly from %s/config.json (seed %d)", type(model).__name__, path, seed)
    else:
        if os.path.isdir(path) and not any(os.path.exists(os.path.join(path, f)) for f in WEIGHT_FILES):
            raise UserError(
                f"model_name_or_path {path}: no weights found ({', '.join(WEIGHT_FILES)}); "
                "for a random tiny model set init_from_config true"
            )
        extra = {"distributed_config": parallel} if parallel is not None else {}
        if quantization_config is not None:
            extra["quantization_config"] = quantization_config
        try:
            if gguf:
                # dequantised to ``dtype``; a GGUF file is one process's whole model (no sharded reading)
                model = load_gguf_model(
                    auto_class, path, config=config, attn_implementation=attn_implementation, dtype=dtype
                )
            else:
                model, info = auto_class.from_pretrained(
                    path,
                    config=config,
                    attn_implementation=attn_implementation,
                    dtype=dtype,
                    output_loading_info=True,
                    **extra,
                )
                check_weights_match(model, info.get("missing_keys", ()), path)
        except (SafetensorError, OSError, EOFError, json.JSONDecodeError, pickle.UnpicklingError) as err:
            if not os.path.isdir(path):
                raise _not_found("model_name_or_path", path, "the weights", err) from None
            raise UserError(
                f"{weights_file(path)}: cannot read the weights, the file is corrupt or truncated "
                f"({type(err).__name__}: {err}); save or download the model again"
            ) from None
        except UserError:
            raise
        except ValueError as err:
            if parallel is None:
                raise UserError(
                    f"model_name_or_path {path}: cannot build a {config.model_type} model from its config.json ({err}); "
                    "put the config.json that was saved with these weights back"
                ) from None
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


def check_weights_match(model: torch.nn.Module, missing: Iterable[str], path: str) -> None:
    """Stop when the checkpoint supplies fewer than half of the model's parameters: its config.json describes
    another architecture or layout than its weights (a gpt2 config over Llama weights), and transformers would
    only warn, then train a randomly initialised model. A new head (``score`` on a causal-LM checkpoint) is a
    few parameters and passes."""
    sizes = dict(model.named_parameters())
    total = sum(p.numel() for p in sizes.values())
    absent = sum(sizes[name].numel() for name in missing if name in sizes)
    if total and absent * 2 > total:
        names = sorted(missing)
        raise UserError(
            f"model_name_or_path {path}: {weights_file(path)} lacks {absent:,} of the {total:,} parameters "
            f"that its config.json ({model.config.model_type}) describes (e.g. {', '.join(names[:3])}): the config "
            "and the weights are of different models; put the config.json that was saved with these weights back"
        )


def weights_file(path: str) -> str:
    """The weights file of model directory ``path`` (the first of ``WEIGHT_FILES`` there), for messages."""
    found = [os.path.join(path, f) for f in WEIGHT_FILES if os.path.exists(os.path.join(path, f))]
    return found[0] if found else path


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
