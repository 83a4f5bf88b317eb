"""OpenLLaMA2's memory savers for PPO, in plain torch.

- ``HostAdamW``: AdamW whose fp32 master weights and moments live in host memory; a step copies the
  device gradients to the host (D2H), steps there, and copies the new weights back (H2D). The device
  then holds only the model's weights and gradients (``training.adam_offload``).
- ``OffloadedTrainableRole``: a ``TrainableRole`` over a ``HostAdamW``, with checkpoints in the same
  name-keyed format as the plain role (either loads the other's ``optimizer.json`` + ``.safetensors``).
- ``offload_when_idle``: a frozen role (reference, reward model) sits in host memory between calls and
  moves to its device for each forward (``ref.offload`` / ``reward.offload``).

On a CPU-only run the builders skip all of this (there is nothing to move) and say so in the log;
the copy logic itself runs whatever the devices are, so tests on the CPU exercise it.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch.distributed.tensor import DTensor

from llm.alignment.ppo.optim import TrainableRole, fused_if_possible, trainable, warmup_schedule
from llm.utils.precision import load_keeping_implementation

logger = logging.getLogger(__name__)

HOST = torch.device("cpu")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class HostAdamW(torch.optim.AdamW):
    """AdamW over fp32 master copies of ``params`` kept on ``host``; ``step`` updates the model's own
    (device) parameters. With fp32 parameters the updates equal ``torch.optim.AdamW(fused=True)``'s exactly (the
    plain role's: ``optim.fused_if_possible``); with
    bf16 parameters the master copies make it mixed precision (bf16 weights, fp32 state)."""

    def __init__(self, params, *, host: torch.device | str = HOST, **adamw) -> None:
        self.host = torch.device(host)
        self.params = [p for p in params if p.requires_grad]
        # copy=True: the master is a separate tensor even when the model is already fp32 on the host.
        self.masters = [
            torch.nn.Parameter(_local(p).detach().to(self.host, torch.float32, copy=True)) for p in self.params
        ]
        # fused as the plain role's AdamW, whose MasterWeightAdamW steps bf16 parameters' masters with the same
        # fused kernel (so either resumes the other's state exactly)
        super().__init__(self.masters, **fused_if_possible(self.masters), **adamw)
        self.host_grads: list[torch.Tensor | None] = [None] * len(self.params)  # fp32 gradients, reused

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("HostAdamW.step takes no closure")
        for i, (p, m) in enumerate(zip(self.params, self.masters)):
            if p.grad is None:
                m.grad = None
                continue
            g = _local(p.grad)
            if self.host_grads[i] is None or self.host_grads[i].shape != g.shape:
                self.host_grads[i] = torch.empty(g.shape, dtype=torch.float32, device=self.host)
            m.grad = self.host_grads[i].copy_(g)  # D2H and upcast into a buffer kept across steps (no page faults)
        super().step()
        for p, m in zip(self.params, self.masters):
            _local(p).copy_(m, non_blocking=True)  # H2D (cast to the model's dtype)
        if any(p.device.type == "cuda" for p in self.params):
            torch.cuda.synchronize()

    def load_state_dict(self, state_dict: dict) -> None:
        load_keeping_implementation(self, super().load_state_dict, state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def state_by_name(self, names: dict[int, str]) -> dict:
        """The state in ``get_optimizer_state_dict``'s full format: keyed by parameter name. A half-precision
        parameter's state also holds its fp32 ``master``, as ``MasterWeightAdamW``'s does (either loads the other's)."""
        sd = self.state_dict()
        key = [names[id(p)] for p in self.params]
        groups = [{**g, "params": [key[i] for i in g["params"]]} for g in sd["param_groups"]]
        state = {key[i]: s for i, s in sd["state"].items()}
        for i, (p, m) in enumerate(zip(self.params, self.masters)):
            if p.dtype != torch.float32 and key[i] in state:
                state[key[i]] = {**state[key[i]], "master": m.detach()}
        return {"state": state, "param_groups": groups}

    def load_state_by_name(self, state: dict, names: dict[int, str]) -> None:
        index = {names[id(p)]: i for i, p in enumerate(self.params)}
        groups = [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]]
        per_param = {n: {k: v for k, v in s.items() if k != "master"} for n, s in state["state"].items()}
        self.load_state_dict({"state": {index[n]: s for n, s in per_param.items()}, "param_groups": groups})
        with torch.no_grad():  # saved fp32 masters replace the ones rounded from the loaded weights
            for n, s in state["state"].items():
                if "master" in s:
                    self.masters[index[n]].copy_(s["master"])


class OffloadedTrainableRole(TrainableRole):
    """``TrainableRole`` with its optimizer state on the host (``HostAdamW``); checkpoints as the plain role's
    (checkpoint.py), so either loads the other's."""

    def __init__(self, model, lr, weight_decay, betas, eps, max_grad_norm, warmup_steps, host=HOST) -> None:
        super().__init__(model, lr, weight_decay, betas, eps, max_grad_norm, warmup_steps)
        # Replaces the plain AdamW before its first step, so no device state was ever allocated.
        self.optimizer = HostAdamW(trainable(model), host=host, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.scheduler = warmup_schedule(self.optimizer, warmup_steps)

    def _names(self) -> dict[int, str]:
        return {id(p): n for n, p in self.model.named_parameters()}

    def optimizer_state(self) -> dict:
        return self.optimizer.state_by_name(self._names())

    def load_optimizer_state(self, state: dict) -> None:
        """After the weights were loaded (strictly, ``checkpoint.load_weights``): the masters follow them,
        then the saved state (with its fp32 masters, when it has them) replaces them."""
        with torch.no_grad():
            for p, m in zip(self.optimizer.params, self.optimizer.masters):
                m.copy_(_local(p))
        self.optimizer.load_state_by_name(state, self._names())


def offload_when_idle(role, model: torch.nn.Module, device: torch.device | str, methods: tuple[str, ...]):
    """Keep ``model`` on the host between calls of ``role``'s ``methods``: each call moves it to
    ``device`` first and back to the host after. ``role.offload_moves`` counts the moves (onload,
    offload) and ``role.offloaded`` says where the model is now."""
    device = torch.device(device)
    role.offload_moves = [0, 0]

    def place(where: torch.device, k: int) -> None:
        model.to(where)
        role.offload_moves[k] += 1
        role.offloaded = where == HOST
        if where == HOST and device.type == "cuda":
            torch.cuda.empty_cache()

    for name in methods:
        method = getattr(role, name)

        @functools.wraps(method)
        def call(*args, _method=method, **kwargs):
            place(device, 0)
            try:
                return _method(*args, **kwargs)
            finally:
                place(HOST, 1)

        setattr(role, name, call)
    place(HOST, 1)
    role.offload_moves = [0, 0]
    return role
