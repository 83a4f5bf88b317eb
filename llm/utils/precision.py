"""Mixed precision: which dtype every part of a step runs in, and the AdamW that keeps fp32 master weights.

``fp16_opt_level`` (with ``bf16`` or ``fp16``; PaddleNLP's meaning), for the Trainer-based runs (reward
models, SFT, DPO):

- ``O1``: fp32 weights; the loss computation runs under ``torch.autocast`` to bf16/fp16
  (``AlignmentTrainer.compute_loss_context_manager``, the autocast accelerate also wraps the prepared
  model's forward in): matmuls in half precision, the optimizer steps on the fp32 weights.
- ``O2``: the weights themselves in bf16 (half the weight memory, bf16 gradients), the same autocast,
  and AdamW on fp32 master copies (``MasterWeightAdamW``): each step updates the fp32 master and rounds
  it into the bf16 weight, as PaddleNLP's O2 (multi-precision AdamW) does. transformers' ``Trainer``
  alone would step torch's AdamW on the bf16 weights (bf16 moments too), where an update below half a
  bf16 spacing of its weight (2^-9 to 2^-8 of it: lr 3e-6 against 6e-5 for a weight of 0.02) rounds
  away. Gradients are bf16 and accumulate in bf16 over micro-batches (Paddle's ``main_grad`` fp32
  accumulation is not implemented). Master weights need AdamW (``optim`` ``adamw_torch`` /
  ``adamw_torch_fused``, the default); any other ``optim`` steps on the bf16 weights themselves (warned).
  fp16 with O2 stops at start-up (``weights_dtype``): accelerate's fp16 runs use torch's ``GradScaler``,
  whose ``unscale_`` refuses fp16 gradients. fp16 (CUDA only) has not run in this project yet.

Heads applied outside the model's forward (the LM head at the readouts, a PRM's two reward-token rows,
the ORM / critic ``score`` head) get the hidden states cast to the head weight's dtype (accelerate hands
the forward's outputs back in fp32); under the autocast above their matmul runs in bf16/fp16, in PPO
(no autocast) in the weights' dtype. Logits are upcast to fp32 before every log-softmax, cross-entropy,
softmax and log-sigmoid, so per-item losses, log-probs, scores and metrics are fp32.

PPO has only ``training.bf16``: the trained and frozen models in bf16 (frozen ones: ``ref.dtype`` /
``reward.dtype`` may say otherwise), no autocast, and the actor's and critic's AdamW on fp32 masters:
the O2 scheme.
"""

from __future__ import annotations

import torch

_FP32_STATE = ("master", "exp_avg", "exp_avg_sq")  # the fp32 state of a half-precision parameter


class MasterWeightAdamW(torch.optim.AdamW):
    """AdamW that keeps an fp32 master copy of every half-precision (bf16/fp16) parameter.

    A half-precision parameter's state holds ``master`` (fp32 weights) and fp32 moments; ``step`` applies
    AdamW (decoupled weight decay, bias-corrected moments: torch's formula) to the master with the gradient
    upcast to fp32, then copies the master, rounded, into the parameter. The state is keyed by the model's
    own parameters, so ``torch.distributed.checkpoint`` saves and reshards it by parameter name, and FSDP2 /
    tensor-parallel parameters (DTensors) get sharded masters. fp32 parameters go through torch's AdamW
    unchanged (bit-identical updates).
    """

    def __init__(self, params, **adamw) -> None:
        if adamw.get("amsgrad") or adamw.get("maximize"):
            raise ValueError("MasterWeightAdamW: amsgrad and maximize are not implemented for half-precision weights")
        super().__init__(params, **adamw)

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("MasterWeightAdamW.step takes no closure")
        half = [
            (group, p, p.grad)
            for group in self.param_groups
            for p in group["params"]
            if p.grad is not None and p.dtype in (torch.bfloat16, torch.float16)
        ]
        for _, p, _ in half:  # torch's step skips parameters without a gradient
            p.grad = None
        try:
            super().step()
        finally:
            for _, p, grad in half:
                p.grad = grad
        for group, p, grad in half:
            self._master_step(group, p, grad)

    def _master_step(self, group: dict, p: torch.Tensor, grad: torch.Tensor) -> None:
        state = self.state[p]
        if "master" not in state:  # the first step, or a state saved by torch's AdamW (bf16 moments, no master)
            state["master"] = p.detach().to(torch.float32, copy=True)
            state.setdefault("step", torch.tensor(0.0))
            for name in ("exp_avg", "exp_avg_sq"):
                state[name] = state[name].float() if name in state else torch.zeros_like(state["master"])
        master, exp_avg, exp_avg_sq = state["master"], state["exp_avg"], state["exp_avg_sq"]
        state["step"] += 1
        step = float(state["step"])
        lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
        g = grad.to(torch.float32)
        master.mul_(1 - lr * group["weight_decay"])
        exp_avg.lerp_(g, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (exp_avg_sq.sqrt() / (1 - beta2**step) ** 0.5).add_(eps)
        master.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1**step))
        p.copy_(master)

    def load_state_dict(self, state_dict: dict) -> None:
        # Optimizer.load_state_dict casts every floating state tensor to its parameter's dtype, which would
        # round the masters and moments of half-precision parameters to bf16: put the fp32 ones back.
        keep = {
            k: {name: s[name] for name in _FP32_STATE if name in s}
            for k, s in state_dict["state"].items()
            if "master" in s
        }
        super().load_state_dict(state_dict)
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for k, p in zip(saved_ids, params):
            for name, value in keep.get(k, {}).items():
                self.state[p][name] = value.to(device=p.device, dtype=torch.float32)
