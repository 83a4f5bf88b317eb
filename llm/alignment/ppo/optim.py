"""A trained role's optimizer: AdamW with fp32 master weights of bf16 ones (``training.bf16``,
``llm.utils.precision``), a linear-warmup LR schedule and gradient clipping; ``step`` applies the
accumulated gradients. Checkpoints go through checkpoint.py; offload.py's ``OffloadedTrainableRole``
keeps the same interface with the state in host memory."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from llm.alignment.ppo import checkpoint
from llm.alignment.ppo.fsdp import FULL, GATHER
from llm.utils.precision import MasterWeightAdamW


def trainable(model) -> list[torch.Tensor]:
    """The parameters an optimizer steps: all of a fully trained model, the adapters (and head) of a LoRA one."""
    return [p for p in model.parameters() if p.requires_grad]


FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def fused_if_possible(params: list[torch.Tensor]) -> dict:
    """``{"fused": True}`` where torch's fused AdamW takes these parameters (plain tensors on the CPU or a CUDA
    device, floating point), else ``{}`` (torch's default; FSDP2's DTensors). On a CPU torch's default is the
    per-parameter loop, which on SmolLM2-135M took 0.5 s of every PPO step's two AdamW steps; transformers'
    ``Trainer`` (so TRL, and our SFT / DPO / reward trainers) has used the fused one since torch 2.8. The
    two compute the same update up to float rounding."""
    ok = all(
        not isinstance(p, DTensor) and p.device.type in ("cpu", "cuda") and p.dtype in FUSED_DTYPES for p in params
    )
    return {"fused": True} if ok and params else {}


def warmup_schedule(optimizer, warmup_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda n: min(1.0, (n + 1) / warmup_steps) if warmup_steps else 1.0
    )


class TrainableRole:
    """Owns a model's optimizer and LR schedule; ``step`` applies accumulated gradients."""

    def __init__(
        self,
        model: PreTrainedModel,
        lr: float,
        weight_decay: float,
        betas: tuple[float, float],
        eps: float,
        max_grad_norm: float,
        warmup_steps: int,
    ) -> None:
        self.model = model
        params = trainable(model)
        self.optimizer = MasterWeightAdamW(
            params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **fused_if_possible(params)
        )
        self.scheduler = warmup_schedule(self.optimizer, warmup_steps)
        self.max_grad_norm = max_grad_norm
        self.lora_merge = False  # a LoRA role's final save also writes the merged model (lora_merge)

    def step(self) -> float:
        norm = 0.0
        if self.max_grad_norm and self.max_grad_norm > 0:
            total = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
            norm = float(total.full_tensor() if isinstance(total, DTensor) else total)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def optimizer_state(self) -> dict:
        """The full state keyed by parameter name (FSDP2: gathered to the first rank, {} on the others)."""
        return get_optimizer_state_dict(self.model, self.optimizer, options=GATHER)

    def load_optimizer_state(self, state: dict) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state, options=FULL)

    def save(self, directory: str, tokenizer: PreTrainedTokenizerBase, with_optimizer: bool) -> None:
        """The model in Hugging Face format (+ tokenizer); the optimizer state beside it for a checkpoint."""
        state = self.optimizer_state if with_optimizer else None
        merged = self.lora_merge and not with_optimizer  # the final save, not a checkpoint
        checkpoint.save(directory, self.model, tokenizer, self.scheduler, state, merged)

    def load(self, directory: str) -> None:
        checkpoint.load_weights(self.model, directory)
        state = checkpoint.load_optimizer_state(directory)
        self.load_optimizer_state(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
