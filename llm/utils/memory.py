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
"""

from __future__ import annotations

import ctypes
import functools
import logging
import platform
import sys

import torch

logger = logging.getLogger(__name__)


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim``, or None where there is none."""
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


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
