"""Mixed precision: which dtype every part of a step runs in, and the AdamW that keeps fp32 master weights.

``fp16_opt_level`` (with ``bf16`` or ``fp16``; PaddleNLP's meaning), for the Trainer-based runs (reward
models, SFT, DPO):

- ``O1``: fp32 weights; the loss computation runs under ``torch.autocast`` to bf16/fp16
  (``AlignmentTrainer.compute_loss_context_manager``, the autocast accelerate also wraps the prepared
  model's forward in): matmuls in half precision, the optimizer steps on the fp32 weights.
- ``O2``: the weights themselves in bf16/fp16 (half the weight memory, half-precision gradients), the
  same autocast, and AdamW on fp32 master copies (``MasterWeightAdamW``): each step updates the fp32
  master and rounds it into the half-precision weight, as PaddleNLP's O2 (multi-precision AdamW) does.
  transformers' ``Trainer`` alone would step torch's AdamW on the bf16 weights (bf16 moments too), where
  an update below half a bf16 spacing of its weight (2^-9 to 2^-8 of it: lr 3e-6 against 6e-5 for a
  weight of 0.02) rounds away. Gradients are half precision and accumulate so over micro-batches (Paddle's
  ``main_grad`` fp32 accumulation is not implemented). Master weights need AdamW (``optim``
  ``adamw_torch`` / ``adamw_torch_fused``, the default); any other ``optim`` steps on the half-precision
  weights themselves (warned).

fp16 (O1 and O2, on every device, CPU included) scales the loss with ``LossScaler``: torch ``GradScaler``'s
dynamic policy (start at 2^16, halve and skip the step on an inf/nan gradient, double after 2000 finite
steps), but it unscales fp16 gradients into fp32 (the masters' gradients) where ``GradScaler.unscale_``
refuses them, clips the unscaled fp32 gradients, and keeps its scale in the optimizer's param groups
(``loss_scale``, ``loss_scale_good_steps``) so a checkpoint carries it. accelerate's own fp16 path is not
used: it needs CUDA and cannot do O2. bf16 needs no loss scale.

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

import math

import torch
from torch.optim.adam import adam

_FP32_STATE = ("master", "exp_avg", "exp_avg_sq")  # the fp32 state of a half-precision parameter


IMPLEMENTATION_FLAGS = ("fused", "foreach", "capturable", "differentiable")


def load_keeping_implementation(optimizer: torch.optim.Optimizer, load, state_dict: dict) -> None:
    """``load(state_dict)`` (an ``Optimizer.load_state_dict``), keeping ``optimizer``'s own implementation
    choices (fused, foreach, ...): torch takes them from the saved param groups, so a state saved by a fused
    AdamW (a plain PPO role on this machine) would make an offloaded role's loop AdamW fused, and a checkpoint
    made on one device would choose the kernels on another. They change how, not what, it computes."""
    own = [{k: g[k] for k in IMPLEMENTATION_FLAGS if k in g} for g in optimizer.param_groups]
    load(state_dict)
    for group, flags in zip(optimizer.param_groups, own):
        group.update(flags)


def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX-512 BF16 or AMX), from /proc/cpuinfo (False elsewhere)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cpu_bf16_hint(bf16: bool, fp16: bool, use_cpu: bool) -> str | None:
    """A log line for an fp32 run on a CPU that has native bf16: the config is followed, never switched (on a CPU
    without it bf16 autocast is slower than fp32, so bf16 is not a default that fits every CPU)."""
    on_cpu = use_cpu or not (torch.cuda.is_available() or hasattr(torch, "npu"))
    if bf16 or fp16 or not on_cpu or not cpu_has_bf16():
        return None
    return (
        "this run is fp32 on a CPU with native bf16 (AVX-512 BF16 / AMX): bf16: true (autocast, O1) trained "
        "SmolLM2-135M 1.5-1.75x faster here at about the same held-out loss (docs/precision.md)"
    )


FUSED_CHUNK = 1 << 24  # master elements per fused call (a larger parameter alone): bounds the fp32 gradient buffer


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
        # fp32 gradients of half-precision parameters, set by LossScaler.unscale_ for the next step only
        self.master_grads: dict[torch.Tensor, torch.Tensor] = {}
        self._grad_buffers: dict[torch.device, torch.Tensor] = {}  # _fp32_grads

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
        chunk: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i, (group, p, grad) in enumerate(half):
            grad = self.master_grads.get(p, grad)
            if not group.get("fused"):
                self._master_step(group, p, grad)
                continue
            if chunk and sum(q.numel() for q, _ in chunk) + p.numel() > FUSED_CHUNK:
                self._fused_master_steps(group, chunk)
                chunk = []
            chunk.append((p, grad))
            if i + 1 == len(half) or half[i + 1][0] is not group:
                self._fused_master_steps(group, chunk)
                chunk = []
        self.master_grads.clear()

    def _master_state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if "master" not in state:  # the first step, or a state saved by torch's AdamW (bf16 moments, no master)
            state["master"] = p.detach().to(torch.float32, copy=True)
            state.setdefault("step", torch.tensor(0.0))
            for name in ("exp_avg", "exp_avg_sq"):
                state[name] = state[name].float() if name in state else torch.zeros_like(state["master"])
        return state

    def _fused_master_steps(self, group: dict, items: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """torch's fused AdamW kernel over the fp32 masters of ``items`` (parameter, gradient) at once, then each
        master copied, rounded, into its parameter: the update of torch's ``AdamW(fused=True)`` on fp32 weights fed
        the same gradients, without the per-parameter loop of ``_master_step`` (on a CPU that loop took as long as
        torch's unfused AdamW, ~0.5 s a step at 135M parameters)."""
        states = [self._master_state(p) for p, _ in items]
        beta1, beta2 = group["betas"]
        adam(
            [s["master"] for s in states],
            self._fp32_grads([g for _, g in items]),
            [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            [],
            [s["step"] for s in states],  # incremented by the call
            fused=True,
            decoupled_weight_decay=True,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )
        for (p, _), s in zip(items, states):
            p.copy_(s["master"])

    def _fp32_grads(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """``grads`` upcast into one reused fp32 buffer per device (grown as needed, never in the state): a fresh
        fp32 copy of every gradient each step cost 5x the copy itself in page faults on a CPU (0.37 s against
        0.06 s for SmolLM2-135M's 154M gradients)."""
        device, total = grads[0].device, sum(g.numel() for g in grads)
        buffer = self._grad_buffers.get(device)
        if buffer is None or buffer.numel() < total:
            buffer = self._grad_buffers[device] = torch.empty(total, dtype=torch.float32, device=device)
        out, offset = [], 0
        for g in grads:  # an fp32 gradient (fp16's unscaled master_grads) is used as it is
            out.append(g if g.dtype == torch.float32 else buffer[offset : offset + g.numel()].view_as(g).copy_(g))
            offset += g.numel()
        return out

    def _master_step(self, group: dict, p: torch.Tensor, grad: torch.Tensor) -> None:
        state = self._master_state(p)
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
        load_keeping_implementation(self, super().load_state_dict, state_dict)
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for k, p in zip(saved_ids, params):
            for name, value in keep.get(k, {}).items():
                self.state[p][name] = value.to(device=p.device, dtype=torch.float32)


def total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all gradients together, the same on every rank: one norm per device mesh for DTensors
    (FSDP2 / tensor-parallel shards, reduced over their mesh), as transformers' ``Trainer`` computes it;
    plain tensors are replicated (DDP) and their local norm is the global one."""
    from torch.distributed.tensor import DTensor
    from torch.nn.utils import get_total_norm

    if not grads:
        return torch.zeros(())
    by_mesh: dict = {}
    for g in grads:
        by_mesh.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
    norms = []
    for part in by_mesh.values():
        norm = get_total_norm(part)
        norms.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).float())
    return torch.linalg.vector_norm(torch.stack(norms))


class LossScaler:
    """Dynamic loss scaling for fp16 training, in the interface accelerate calls (``scale``, ``step``,
    ``update``) plus ``unscale_and_clip`` for the trainer's gradient clipping.

    Per optimizer step: the loss is multiplied by the scale before ``backward``; ``unscale_and_clip`` divides
    the gradients by it (fp32 parameters in place; fp16 parameters of a ``MasterWeightAdamW`` into fp32
    ``master_grads``, of any other optimizer in place), finds inf/nan on any rank, and clips the finite
    unscaled gradients to ``max_norm``; ``step`` skips the optimizer on inf/nan; ``update`` halves the scale
    after a skipped step and doubles it after ``growth_interval`` finite ones. The state lives in every
    param group of the bound optimizer (``loss_scale``, ``loss_scale_good_steps``), so it is saved, resharded
    and restored with the optimizer state.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> None:
        self.init_scale, self.growth_factor, self.backoff_factor = init_scale, growth_factor, backoff_factor
        self.growth_interval = growth_interval
        self.optimizer: torch.optim.Optimizer | None = None
        self._found_inf: bool | None = None  # None: not unscaled yet in this step
        self._norm: torch.Tensor | None = None

    def bind(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        for group in optimizer.param_groups:
            group.setdefault("loss_scale", self.init_scale)
            group.setdefault("loss_scale_good_steps", 0)

    def get_scale(self) -> float:
        if self.optimizer is None:
            return self.init_scale
        return float(self.optimizer.param_groups[0].get("loss_scale", self.init_scale))

    def is_enabled(self) -> bool:
        return True

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.get_scale()

    @torch.no_grad()
    def unscale_and_clip(self, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
        """Unscale this step's gradients (once), return their total 2-norm (inf/nan if any overflowed) and,
        when ``max_norm`` > 0 and the norm is finite, clip them to it."""
        if self._found_inf is None:
            self._unscale(optimizer)
        norm = self._norm
        if max_norm > 0 and not self._found_inf:
            coef = max_norm / (float(norm) + 1e-6)
            if coef < 1:
                for g in self._grads:
                    g.mul_(coef)
        return norm

    def _unscale(self, optimizer: torch.optim.Optimizer) -> None:
        inv = 1.0 / self.get_scale()
        master = getattr(optimizer, "master_grads", None)
        grads = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if master is not None and p.dtype in (torch.float16, torch.bfloat16):
                    g = p.grad.to(torch.float32) * inv
                    master[p] = g
                else:
                    g = p.grad.mul_(inv)
                grads.append(g)
        self._grads = grads
        self._norm = total_norm(grads)
        self._found_inf = not math.isfinite(float(self._norm))

    def step(self, optimizer: torch.optim.Optimizer, closure=None):
        if self._found_inf is None:
            self._unscale(optimizer)
        if self._found_inf:
            getattr(optimizer, "master_grads", {}).clear()
            return None
        return optimizer.step()

    def update(self) -> None:
        skipped = bool(self._found_inf)
        self._found_inf, self._norm, self._grads = None, None, []
        if self.optimizer is None:
            return
        scale = self.get_scale()
        good = int(self.optimizer.param_groups[0].get("loss_scale_good_steps", 0))
        if skipped:
            scale, good = scale * self.backoff_factor, 0
        else:
            good += 1
            if good >= self.growth_interval:
                scale, good = scale * self.growth_factor, 0
        for group in self.optimizer.param_groups:
            group["loss_scale"], group["loss_scale_good_steps"] = scale, good

    def state_dict(self) -> dict:  # the state is in the optimizer's param groups
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
