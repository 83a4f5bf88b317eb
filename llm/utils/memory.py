"""Resident memory that follows the live tensors: glibc's freed heap handed back between decoder layers.

On Linux, PyTorch's CPU tensors come from glibc's ``malloc``. Once a large tensor has been freed, glibc serves
every request below 32 MiB from its heap and keeps freed chunks resident for reuse; a training step's mix of
long-lived activations, short-lived temporaries and small kept tensors leaves holes that later requests do not
fit, so the heap, and the process's resident memory, grows well past what its tensors use. Measured (issue 30,
bench/README.md "LoRA memory"): one step of a 45M-parameter Llama on 4 x 1024 tokens with activation
checkpointing held 0.66 GiB of live tensors (LoRA; 1.07 GiB full fine-tuning) in a 2.0 GiB heap, 2.3 GiB of
resident memory, about as much as without checkpointing's saving.

``release_between_layers(model)`` calls glibc's ``malloc_trim(0)`` at every decoder layer boundary of a training
forward and backward (after a layer's forward, before its backward), which hands the free pages inside the heap
back to the kernel: resident memory then stays near the live tensors, within one layer's work. The price: a
page handed back and used again is faulted in and zeroed again (on 2 shared cores, ~20% more CPU time per step).
Evaluation, generation and frozen forwards (no gradients, or the model in eval mode) are left alone. Elsewhere
(another C library, another OS) it does nothing.

The other way round, for runs that do not save memory (no activation checkpointing, no LoRA):
``keep_freed_memory()`` tells glibc to keep freed memory for reuse (``mallopt``): its heap's top is never
trimmed, and every request under 32 MiB is served from the heap (glibc's own dynamic threshold only gets there
after a 32 MiB chunk has been freed, and its trimming hands the top back, 64 MiB at a time, after every large
free). By default each step's activations are handed back to the kernel at the end of the step and faulted in
and zeroed page by page again in the next: on SmolLM2-135M, 8 SFT steps (1 thread, 1024-token rows) took 13.7M
page faults and 104 s, with the setting 2.7M and 80 s (1.31x), at 4.29 GB peak resident memory against 3.91 GB
(bench/README.md "The allocator"). Requests of 32 MiB and more (a vocabulary-sized gradient) are still mapped
and unmapped each time; ``MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=100000000000`` in the environment keeps
those too (SFT 75 s, 4.70 GB: large holes the next requests do not fit). A
process whose environment already chooses the allocator (``MALLOC_*_`` variables, ``GLIBC_TUNABLES`` with
malloc settings, an ``LD_PRELOAD``ed jemalloc / tcmalloc / mimalloc) is left as it is, and so is one where
``release_between_layers`` is active (memory first).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform
import sys

import torch

logger = logging.getLogger(__name__)


@functools.cache
def _glibc():
    """glibc, or None where the C library is another one."""
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def _malloc_trim():
    """glibc's ``malloc_trim``, or None where there is none."""
    return getattr(_glibc(), "malloc_trim", None)


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MAX_MMAP_THRESHOLD = 32 << 20  # glibc's largest (64-bit): the limit of its dynamic threshold
KEEP_TRIM_THRESHOLD = 2**31 - 1  # the largest an int takes: the heap's top is never trimmed
DEFAULT_TRIM_THRESHOLD, DEFAULT_MMAP_THRESHOLD = 128 * 1024, 128 * 1024  # glibc's (fixed from then on)
_ALLOCATOR_ENV = ("MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")
_policy: dict[str, str] = {}  # "mode": "keep" | "release", once chosen in this process


def allocator_chosen_by_environment(env: dict | None = None) -> str | None:
    """The environment variable that already chooses how this process allocates, or None."""
    env = os.environ if env is None else env
    for name in _ALLOCATOR_ENV:
        if env.get(name):
            return name
    if "malloc" in env.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES"
    if any(lib in env.get("LD_PRELOAD", "") for lib in ("jemalloc", "tcmalloc", "mimalloc")):
        return "LD_PRELOAD"
    return None


def keep_environment() -> dict[str, str]:
    """The environment variables that give any program on glibc the settings ``keep_freed_memory`` makes (for a
    benchmark's reference side)."""
    return {"MALLOC_MMAP_THRESHOLD_": str(MAX_MMAP_THRESHOLD), "MALLOC_TRIM_THRESHOLD_": str(KEEP_TRIM_THRESHOLD)}


def keep_freed_memory(role: str = "run") -> bool:
    """Keep freed memory in glibc's heap for reuse (module docstring); True when set now or before. Nothing
    where glibc is missing, the environment chooses the allocator, or ``release_between_layers`` is active."""
    if _policy.get("mode") == "keep":
        return True
    mallopt = getattr(_glibc(), "mallopt", None)
    chosen = allocator_chosen_by_environment()
    reason = None
    if mallopt is None:
        reason = "no glibc mallopt here"
    elif _policy.get("mode") == "release":
        reason = "its freed heap already goes back between layers (memory first)"
    elif chosen:
        reason = f"{chosen} chooses the allocator"
    if reason:
        logger.info("%s: freed memory is not kept for reuse: %s", role, reason)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    if not (mallopt(M_MMAP_THRESHOLD, MAX_MMAP_THRESHOLD) and mallopt(M_TRIM_THRESHOLD, KEEP_TRIM_THRESHOLD)):
        logger.info("%s: glibc refused the mallopt settings; freed memory is not kept for reuse", role)
        return False
    _policy["mode"] = "keep"
    logger.info(
        "%s: freed memory stays in the process for reuse (glibc: tensors under 32 MiB from the heap, its top never "
        "trimmed; MALLOC_* variables in the environment choose otherwise)",
        role,
    )
    return True


def release_free_heap() -> bool:
    """Hand the free pages of glibc's heap back to the kernel now; False where that is not available."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def _after_layer(module: torch.nn.Module, args, output) -> None:
    if not (module.training and torch.is_grad_enabled()):
        return
    release_free_heap()
    hidden = output[0] if isinstance(output, (tuple, list)) else output
    if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
        hidden.register_hook(_before_backward)  # runs when this layer's output gradient is ready


def _before_backward(grad: torch.Tensor) -> None:
    release_free_heap()


def release_between_layers(model: torch.nn.Module, role: str = "model") -> int:
    """Hand glibc's free heap back at every decoder layer boundary of ``model``'s training steps (module docstring);
    returns the number of decoder layers hooked (0 where glibc's ``malloc_trim`` is missing, or no layers). A
    second call on the same model adds nothing."""
    if _malloc_trim() is None:
        logger.info("%s: no glibc malloc_trim here; freed memory stays with the allocator", role)
        return 0
    if _policy.get("mode") == "keep":  # memory first: glibc's default thresholds back (fixed, not dynamic)
        _glibc().mallopt(M_MMAP_THRESHOLD, DEFAULT_MMAP_THRESHOLD)
        _glibc().mallopt(M_TRIM_THRESHOLD, DEFAULT_TRIM_THRESHOLD)
    _policy["mode"] = "release"
    layers = _decoder_layers(model)
    for layer in layers:
        if _after_layer not in layer._forward_hooks.values():  # once per layer, however often asked
            layer.register_forward_hook(_after_layer)
    if layers:
        logger.info(
            "%s: freed heap memory goes back to the system at each of its %d decoder layers' boundaries in training",
            role,
            len(layers),
        )
    return len(layers)
