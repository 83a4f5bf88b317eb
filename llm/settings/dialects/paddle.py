"""PaddleNLP argument names that this project declares under another name, or that only have a meaning
in Paddle's own engine, translated before the dataclasses are filled.

Each entry reads PaddleNLP's meaning from its ``llm/`` scripts (``run_finetune.py``, the legacy and
flashmask ``run_reward.py``) and maps it onto the field that does the same job here; a value that
cannot take effect here stops the run saying what to change. A name this project declares itself
(DPO's ``loss_type``, say) is never translated.

| PaddleNLP name | here |
|---|---|
| ``dataset_name_or_path`` (a directory with ``train.json`` / ``dev.json``) | ``train_dataset_path`` / ``dev_dataset_path`` |
| ``max_length`` (tokens per example / zero-padding row) | ``max_seq_len`` |
| ``src_length`` (tokens of the source, i.e. prompt) | ``max_prompt_len`` |
| ``train_datasets`` / ``eval_datasets`` (``name[:proportion[:path]]``, comma-separated) | ``train_dataset_path`` / ``dev_dataset_path`` (local paths; proportion 1) |
| ``regularization`` (L2 on the end scores: ``r * (mean s_c^2 + mean s_r^2)``) | ``score_regularization`` |
| ``loss_type`` of the reward scripts: ``sequence-wise`` (the end score) | the ORM loss; ``token-wise`` stops |
| ``eval_with_do_generation``: false (evaluate by loss) | what evaluation does; true stops |
| ``normalize_score_during_training``: false | what training does; true stops |
| ``normalizer_type`` / ``normalizer_momentum`` | read by Paddle only with score normalisation on: noted, no effect |
| ``pipeline_parallel_degree`` <= 1 | no pipeline parallelism; > 1 stops |
| ``pipeline_parallel_config`` | read by Paddle only with pipeline parallelism: noted, no effect |
| ``tensor_parallel_output`` | whether Paddle keeps the vocabulary-split logits split for its loss; here the readouts use the split LM head either way (same numbers): noted |
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from llm.settings.fields import check_value
from llm.utils.errors import UserError
from llm.utils.paths import resolve_input_path, tried

# handler(value, where, notes) -> {our field: value}; ``notes`` collects lines for the log
Handler = Callable[[Any, str, list], dict]


def _rename(target: str, annotation: Any) -> Handler:
    def handle(value: Any, where: str, notes: list) -> dict:
        return {target: check_value(value, annotation, where)}

    return handle


def _dataset_dir(value: Any, where: str, notes: list) -> dict:
    value = check_value(value, str, where)
    found = resolve_input_path(value)
    if found is None or not os.path.isdir(found):
        raise UserError(
            f"{where}: {value!r} is not a directory (looked in: {tried(value)}); PaddleNLP's "
            "dataset_name_or_path is a directory holding train.json and dev.json, or give train_dataset_path / "
            "dev_dataset_path"
        )
    out = {}
    for name, target in (("train.json", "train_dataset_path"), ("dev.json", "dev_dataset_path")):
        if os.path.isfile(os.path.join(found, name)):
            out[target] = os.path.join(found, name)
    if not out:
        raise UserError(f"{where}: {found} holds neither train.json nor dev.json (PaddleNLP's layout)")
    return out


def _paddle_datasets(target: str) -> Handler:
    def handle(value: Any, where: str, notes: list) -> dict:
        paths = []
        for item in check_value(value, str, where).split(","):
            name, _, rest = item.strip().partition(":")
            proportion, _, path = rest.partition(":")
            path = path or name
            if proportion and proportion.strip() not in ("1", "1.0", "1/1"):
                raise UserError(
                    f"{where}: {item!r} asks for a proportion {proportion} of the data set; here a data set is read "
                    "whole: give the proportion 1 (or make a smaller file), or mix files with train_dataset_path and "
                    "dataset_probs"
                )
            if resolve_input_path(path) is None:
                raise UserError(
                    f"{where}: {item!r}: no file {path!r} (looked in: {tried(path)}); PaddleNLP's registered hub data "
                    "sets are not downloaded here: give 'name:1:path/to/file.jsonl' or set "
                    f"{target} to a local file"
                )
            paths.append(path)
        return {target: ",".join(paths)}

    return handle


def _off_only(off: Any, why: str) -> Handler:
    """A switch whose only value that can take effect here is ``off``."""

    def handle(value: Any, where: str, notes: list) -> dict:
        check_value(value, type(off), where)
        if value != off:
            raise UserError(f"{where}: {why}")
        return {}

    return handle


def _pipeline_degree(value: Any, where: str, notes: list) -> dict:
    if check_value(value, int, where) > 1:
        raise UserError(
            f"{where}: pipeline parallelism is not available in this build: set it to 1 and shard with sharding "
            "(FSDP2) and tensor_parallel_degree instead"
        )
    return {}


def _noted(why: str) -> Handler:
    def handle(value: Any, where: str, notes: list) -> dict:
        notes.append(f"{where}={value!r}: {why}")
        return {}

    return handle


def _reward_loss_type(value: Any, where: str, notes: list) -> dict:
    if check_value(value, str, where) != "sequence-wise":
        raise UserError(
            f"{where}: only 'sequence-wise' (the reward of each answer's last token, PaddleNLP's default) is "
            f"available; got {value!r}"
        )
    return {}


PADDLE_NAMES: dict[str, Handler] = {
    "dataset_name_or_path": _dataset_dir,
    "max_length": _rename("max_seq_len", int),
    "src_length": _rename("max_prompt_len", int),
    "train_datasets": _paddle_datasets("train_dataset_path"),
    "eval_datasets": _paddle_datasets("dev_dataset_path"),
    "eval_with_do_generation": _off_only(
        False,
        "evaluation by generation (BLEU/ROUGE of sampled answers) is not available: set it false (evaluation "
        "reports loss, perplexity and token accuracy)",
    ),
    "pipeline_parallel_degree": _pipeline_degree,
    "pipeline_parallel_config": _noted("read by PaddleNLP only with pipeline parallelism; no effect"),
    "tensor_parallel_output": _noted(
        "the readouts use the vocabulary-split LM head under tensor parallelism either way (same numbers)"
    ),
}


# Names of PaddleNLP's reward-model scripts only (run_reward.py accepts them; in DPO ``loss_type`` is its own).
PADDLE_REWARD_NAMES: dict[str, Handler] = {
    **PADDLE_NAMES,
    "regularization": _rename("score_regularization", float),
    "loss_type": _reward_loss_type,
    "normalize_score_during_training": _off_only(
        False, "score normalisation during reward training is not available: set it false"
    ),
    "normalizer_type": _noted("read by PaddleNLP only with normalize_score_during_training true; no effect"),
    "normalizer_momentum": _noted("read by PaddleNLP only with normalize_score_during_training true; no effect"),
}


def translate(config: dict, declared: set[str], path: str, notes: list, names: dict[str, Handler]) -> dict:
    """``config`` with PaddleNLP's names replaced by ours. A translated field given twice (``max_length`` and
    ``max_seq_len``) stops the run: the two would disagree silently."""
    out = {k: v for k, v in config.items() if k in declared or k not in names}
    origin: dict[str, str] = {}
    for key, value in config.items():
        if key in declared or key not in names:
            continue
        for target, new in names[key](value, f"{path}: {key}", notes).items():
            if target in out:
                first = origin.get(target, target)
                raise UserError(f"{path}: {key} (PaddleNLP's name) and {first} both set {target}: keep one of them")
            out[target] = new
            origin[target] = key
    return out
