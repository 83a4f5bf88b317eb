"""Checkpoints you can trust (shared by every entry point).

- Atomic: a checkpoint is written into ``checkpoint-N.partial`` (the same name on every rank) and renamed to
  ``checkpoint-N`` only when complete; its marker ``checkpoint.json`` is written last, holding the step, the
  run's fingerprint (``llm.settings.fingerprint``) with the fingerprinted values, and every file with its size.
  A directory without a marker, or whose files are missing or of another size, is incomplete.
- Safe to load: state other than the model is stored as JSON plus safetensors (``save_tree`` / ``load_tree``);
  nothing is unpickled, so a planted file cannot run code.
- ``latest_checkpoint``: ``resume_from_checkpoint`` true/auto/last picks the newest complete checkpoint of
  this run, logging each one it skipped and why; one of another run is refused unless named explicitly.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import shutil
from typing import Any

import torch

from llm.utils import run_files
from llm.utils.errors import UserError

logger = logging.getLogger(__name__)

MARKER = "checkpoint.json"
PARTIAL_SUFFIX = ".partial"
MARKER_FORMAT = 1
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
_PARTIAL_RE = re.compile(r"^checkpoint-(\d+)\.partial$")


# --- JSON + safetensors trees ----------------------------------------------------------------------
def encode_tree(obj: Any, tensors: dict[str, torch.Tensor], path: str = "") -> Any:
    """``obj`` (dicts, lists, tuples, numbers, strings, None, tensors, numpy arrays) as JSON, each tensor
    replaced by ``{"__tensor__": key}`` and put into ``tensors[key]`` (keys are the '/'-joined path)."""
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {"__float__": repr(obj)}
    if isinstance(obj, torch.Tensor):
        key = path or "value"
        tensors[key] = obj
        return {"__tensor__": key}
    try:
        import numpy as np

        if isinstance(obj, np.ndarray):
            key = path or "value"
            tensors[key] = torch.from_numpy(np.ascontiguousarray(obj))
            return {"__ndarray__": key, "dtype": str(obj.dtype)}
        if isinstance(obj, np.generic):
            return encode_tree(obj.item(), tensors, path)
    except ImportError:  # pragma: no cover
        pass
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: encode_tree(v, tensors, f"{path}/{k}" if path else k) for k, v in obj.items()}
        items = []
        for k, v in obj.items():
            if not isinstance(k, (str, int, bool, float)) and k is not None:
                raise TypeError(f"cannot store a dict key of type {type(k).__name__} in a checkpoint")
            items.append([k, encode_tree(v, tensors, f"{path}/{k}" if path else str(k))])
        return {"__items__": items}
    if isinstance(obj, (list, tuple)):
        out = [encode_tree(v, tensors, f"{path}/{i}" if path else str(i)) for i, v in enumerate(obj)]
        return {"__tuple__": out} if isinstance(obj, tuple) else out
    raise TypeError(f"cannot store a {type(obj).__name__} in a checkpoint (at {path or 'the top'})")


def decode_tree(obj: Any, tensors: dict[str, torch.Tensor], where: str) -> Any:
    """The inverse of ``encode_tree``: builds only dicts, lists, tuples, numbers, strings, None and tensors."""
    if isinstance(obj, list):
        return [decode_tree(v, tensors, where) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__tensor__" in obj or "__ndarray__" in obj:
        key = obj.get("__tensor__", obj.get("__ndarray__"))
        if key not in tensors:
            raise UserError(f"{where}: the tensor {key!r} it names is missing; the checkpoint is damaged")
        return tensors[key] if "__tensor__" in obj else tensors[key].numpy()
    if "__float__" in obj:
        return float(obj["__float__"])
    if "__tuple__" in obj:
        return tuple(decode_tree(v, tensors, where) for v in obj["__tuple__"])
    if "__items__" in obj:
        return {k: decode_tree(v, tensors, where) for k, v in obj["__items__"]}
    return {k: decode_tree(v, tensors, where) for k, v in obj.items()}


def save_tree(directory: str, name: str, obj: Any) -> list[str]:
    """``name.json`` (the structure) and, when ``obj`` holds tensors, ``name.safetensors``; returns the files."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    tree = encode_tree(obj, tensors)
    files = [f"{name}.json"]
    if tensors:
        # contiguous CPU copies: safetensors refuses views and tensors that share storage
        save_file(
            {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()},
            os.path.join(directory, f"{name}.safetensors"),
        )
        files.append(f"{name}.safetensors")
    write_json_atomic(os.path.join(directory, f"{name}.json"), {"format": 1, "tree": tree, "tensors": bool(tensors)})
    return files


def load_tree(directory: str, name: str) -> Any:
    """What ``save_tree`` wrote; a damaged or foreign file stops the run naming it (nothing is executed)."""
    path = os.path.join(directory, f"{name}.json")
    data = read_json(path)
    if not isinstance(data, dict) or "tree" not in data:
        raise UserError(f"{path}: not a checkpoint state file written by this project; the checkpoint is damaged")
    tensors: dict[str, torch.Tensor] = {}
    if data.get("tensors"):
        tensors = read_safetensors(os.path.join(directory, f"{name}.safetensors"))
    return decode_tree(data["tree"], tensors, path)


def read_safetensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if not os.path.isfile(path):
        raise UserError(f"{path}: missing; the checkpoint is incomplete: resume from another checkpoint")
    try:
        return load_file(path)
    except Exception as err:  # noqa: BLE001 - SafetensorError, OSError: a damaged file
        raise UserError(f"{path}: not a valid safetensors file ({err}); the checkpoint is damaged") from None


def read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise UserError(f"{path}: missing; the checkpoint is incomplete: resume from another checkpoint") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"{path}: not valid JSON ({err}); the checkpoint is damaged") from None


def write_json_atomic(path: str, data: Any) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk, a signal: no temporary file left behind
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


# --- writing a checkpoint atomically -----------------------------------------------------------------
def partial_dir(final: str) -> str:
    return final.rstrip("/") + PARTIAL_SUFFIX


def begin_checkpoint(final: str, is_main: bool) -> str:
    """The temporary directory to write ``final`` into. The main process clears what a killed save left
    (``checkpoint-*.partial`` in the same parent); call a barrier after this when distributed."""
    partial = partial_dir(final)
    if is_main:
        parent = os.path.dirname(final) or "."
        if os.path.isdir(parent):
            for name in os.listdir(parent):
                if _PARTIAL_RE.match(name):
                    logger.info("removing %s, left by a save that did not finish", os.path.join(parent, name))
                    shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
        os.makedirs(partial, exist_ok=True)
    return partial


def finish_checkpoint(partial: str, final: str, step: int, fingerprint=None, extra: dict | None = None) -> None:
    """Main process only, after every rank has written its files (a barrier): the marker last, then the
    rename of ``partial`` to ``final`` (replacing an older ``final`` of the same step)."""
    files = {}
    for root, _, names in os.walk(partial):
        for name in names:
            full = os.path.join(root, name)
            files[os.path.relpath(full, partial)] = os.path.getsize(full)
    marker = {
        "format": MARKER_FORMAT,
        "step": step,
        "fingerprint": None if fingerprint is None else fingerprint.digest,
        "config": None if fingerprint is None else fingerprint.values,
        "files": dict(sorted(files.items())),
        **(extra or {}),
    }
    write_json_atomic(os.path.join(partial, MARKER), marker)
    _fsync_dir(partial)
    if os.path.lexists(final):
        old = f"{final}.old{os.getpid()}"
        os.rename(final, old)
        os.rename(partial, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(partial, final)
    _fsync_dir(os.path.dirname(final) or ".")


# --- the final model: written aside, then moved into output_dir ------------------------------------------
FINAL_STAGING = "final.partial"  # inside output_dir; what a stopped final save leaves
FINAL_MARKER = "final_model.json"  # written last: the final model in output_dir is complete


def begin_final(output_dir: str, is_main: bool) -> str:
    """The directory the final model is written into before it is moved into ``output_dir``. The model files
    of ``output_dir`` are never written in place: a save that dies half-way leaves only this directory."""
    staging = os.path.join(output_dir, FINAL_STAGING)
    if is_main:
        shutil.rmtree(staging, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(output_dir, FINAL_MARKER))
        os.makedirs(staging, exist_ok=True)
    return staging


def finish_final(output_dir: str, step: int) -> None:
    """Main process only, after every rank has written its part into the staging directory: each file (a
    folder such as LoRA's ``merged/`` as a whole) is renamed into ``output_dir``, then the marker is written.
    The names are added to ``run_files.json`` first (``llm.utils.run_files``): what this run moves in is its own."""
    staging = os.path.join(output_dir, FINAL_STAGING)
    _fsync_dir(staging)
    names = sorted(os.listdir(staging))
    run_files.record(output_dir, names)
    for name in names:
        src, dst = os.path.join(staging, name), os.path.join(output_dir, name)
        if os.path.isdir(src) and os.path.lexists(dst):
            shutil.rmtree(dst, ignore_errors=True)
        os.replace(src, dst)
    os.rmdir(staging)
    _fsync_dir(output_dir)
    write_json_atomic(os.path.join(output_dir, FINAL_MARKER), {"step": step, "files": names})


def final_model_complete(output_dir: str, step: int) -> bool:
    """Whether ``output_dir`` holds the complete final model of step ``step`` (its marker names that step and
    every file it lists is there)."""
    try:
        with open(os.path.join(output_dir, FINAL_MARKER), encoding="utf-8") as f:
            marker = json.load(f)
    except (OSError, ValueError):
        return False
    files = marker.get("files") if isinstance(marker, dict) else None
    return (
        marker.get("step") == step
        and isinstance(files, list)
        and all(os.path.exists(os.path.join(output_dir, name)) for name in files)
    )


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# --- reading checkpoints -----------------------------------------------------------------------------
def read_marker(directory: str) -> dict | None:
    """The marker of a checkpoint directory, or None when it has none (or it is unreadable)."""
    try:
        with open(os.path.join(directory, MARKER), encoding="utf-8") as f:
            marker = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return marker if isinstance(marker, dict) and isinstance(marker.get("files"), dict) else None


def checkpoint_problem(directory: str) -> str | None:
    """Why ``directory`` is not a complete checkpoint, or None when it is."""
    if not os.path.isfile(os.path.join(directory, MARKER)):
        return f"incomplete: no {MARKER} (the save did not finish, or an older version wrote it)"
    marker = read_marker(directory)
    if marker is None:
        return f"incomplete: {MARKER} is not valid"
    missing, changed = [], []
    for name, size in marker["files"].items():
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            missing.append(name)
        elif os.path.getsize(path) != size:
            changed.append(name)
    if missing:
        return f"incomplete: file(s) missing: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}"
    if changed:
        return f"damaged: file(s) of another size than saved: {', '.join(changed[:5])}"
    return None


def checkpoint_dirs(output_dir: str) -> list[tuple[int, str]]:
    """``checkpoint-N`` directories of ``output_dir``, newest (highest N) first."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        m = _CHECKPOINT_RE.match(name)
        if m and os.path.isdir(os.path.join(output_dir, name)):
            found.append((int(m.group(1)), os.path.join(output_dir, name)))
    return sorted(found, reverse=True)


def fingerprint_mismatch(directory: str, fingerprint) -> list[str] | None:
    """The differing fields (``name (saved -> now)``) when ``directory``'s marker is of another run; None: same
    run (or nothing to compare)."""
    marker = read_marker(directory)
    if fingerprint is None or marker is None or marker.get("fingerprint") in (None, fingerprint.digest):
        return None
    saved = marker.get("config") if isinstance(marker.get("config"), dict) else {}
    return differing_fields(saved, fingerprint.values) or ["(the fingerprint differs)"]


def rotate_checkpoints(output_dir: str, limit: int | None, fingerprint=None, keep: tuple[str | None, ...] = ()) -> None:
    """Keep the newest ``limit`` complete checkpoints of this run (and those in ``keep``, e.g. the best one);
    incomplete ones and other runs' are never counted nor deleted here."""
    if not limit or limit <= 0:
        return
    keep_real = {os.path.realpath(k) for k in keep if k}
    ours = [
        path
        for _, path in checkpoint_dirs(output_dir)
        if checkpoint_problem(path) is None and not fingerprint_mismatch(path, fingerprint)
    ]
    for path in ours[limit:]:
        if os.path.realpath(path) in keep_real:
            continue
        logger.info("deleting %s (save_total_limit=%d)", path, limit)
        shutil.rmtree(path, ignore_errors=True)


def checkpoint_step(directory: str) -> int | None:
    marker = read_marker(directory)
    if marker is not None and isinstance(marker.get("step"), int):
        return marker["step"]
    m = _CHECKPOINT_RE.match(os.path.basename(os.path.normpath(directory)))
    return int(m.group(1)) if m else None


def latest_checkpoint(value: str | None, output_dir: str, fingerprint=None) -> str | None:
    """``resume_from_checkpoint``: None/false, a checkpoint directory, or true/auto/last: the newest complete
    checkpoint of this run in ``output_dir`` (``fingerprint``: ``llm.settings.fingerprint.run_fingerprint``)."""
    if value is None or str(value).lower() in ("", "false", "none"):
        return None
    if str(value).lower() in ("true", "auto", "last"):
        return _auto(value, output_dir, fingerprint)
    if not os.path.isdir(value):
        raise UserError(f"resume_from_checkpoint: {value} is not a directory")
    if os.path.isfile(os.path.join(value, MARKER)):
        problem = checkpoint_problem(value)
        if problem:
            raise UserError(f"resume_from_checkpoint: {value} is {problem}: name a complete checkpoint")
        differ = fingerprint_mismatch(value, fingerprint)
        if differ:
            logger.warning(
                "resume_from_checkpoint: %s was saved by a run with other settings (%s); resuming from it as asked",
                value,
                "; ".join(differ),
            )
    else:
        logger.warning(
            "resume_from_checkpoint: %s has no %s: it cannot be checked to be complete or of this run; "
            "resuming from it as asked",
            value,
            MARKER,
        )
    return value


def _auto(value: str, output_dir: str, fingerprint) -> str:
    skipped = []
    for _, path in checkpoint_dirs(output_dir):
        problem = checkpoint_problem(path)
        if problem:
            logger.warning("resume_from_checkpoint=%s: skipping %s: %s", value, path, problem)
            skipped.append(f"{os.path.basename(path)} ({problem})")
            continue
        differ = fingerprint_mismatch(path, fingerprint)
        if differ:
            raise UserError(
                f"resume_from_checkpoint={value}: the newest complete checkpoint {path} was saved by another run: "
                f"its settings differ in {'; '.join(differ)}. To resume from it anyway name it "
                f"(resume_from_checkpoint: {path}); to start this run afresh instead use another output_dir, or "
                "set overwrite_output_dir true without resume_from_checkpoint"
            )
        logger.info("resume_from_checkpoint=%s: resuming from %s", value, path)
        return path
    why = f"; skipped: {'; '.join(skipped)}" if skipped else ""
    raise UserError(f"resume_from_checkpoint={value!r}: no complete checkpoint-* directory in {output_dir}{why}")


def differing_fields(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Fields whose values differ (or that only one side has), as ``name (saved -> now)`` texts, sorted."""
    out = []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key, "<absent>"), current.get(key, "<absent>")
        if canonical_json(a) != canonical_json(b):
            out.append(f"{key} ({short_value(a)} -> {short_value(b)})")
    return out


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def short_value(value: Any, limit: int = 80) -> str:
    if isinstance(value, list) and value and all(isinstance(v, dict) and "path" in v for v in value):
        text = ", ".join(
            f"{v['path']} [{v.get('size', '?')} bytes, sha256 {str(v.get('sha256') or v.get('sha256_sampled') or '-')[:12]}]"
            for v in value
        )
    else:
        text = json.dumps(value, sort_keys=True) if not isinstance(value, str) else value
    return text if len(text) <= limit else text[: limit - 3] + "..."
