"""TRL's current GRPOTrainer loss on given inputs, for tests/test_ppo_objectives.py (run in its own process with
TRL's current release first on PYTHONPATH, since the test environment pins TRL 1.12 for the PPO / PRM parity).

python tests/trl_grpo_loss.py DIR: reads DIR/inputs.pt (logps, old, advantages, mask) and DIR/cases.json
(loss_type, level, eps_low, eps_high, max_len), writes DIR/trl_out.pt: TRL's version and, per case, the loss and
its gradient with respect to the per-token log-probs. ``GRPOTrainer._compute_loss`` runs as TRL wrote it; only the
trainer around it is a stand-in (one process, no accumulation, the model's forward replaced by the given log-probs).
"""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict
from types import SimpleNamespace

import torch
import trl
from trl.trainer.grpo_trainer import GRPOTrainer


class OneProcess:
    num_processes = 1
    is_main_process = True
    sync_gradients = True

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x


def trl_loss(inputs: dict, case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    logps = inputs["logps"].clone().requires_grad_(True)
    B, T = logps.shape
    trainer = SimpleNamespace(
        loss_type=case["loss_type"],
        importance_sampling_level=case["level"],
        epsilon_low=case["eps_low"],
        epsilon_high=case["eps_high"],
        max_completion_length=case["max_len"],
        beta=0.0,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        use_vllm=False,
        vllm_importance_sampling_correction=False,
        aux_loss_enabled=False,
        _entropy_bonus_enabled=False,
        current_gradient_accumulation_steps=1,
        model=SimpleNamespace(training=True),
        accelerator=OneProcess(),
        args=SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=1),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, torch.zeros_like(logps), None),
    )
    mask = inputs["mask"]
    batch = {
        "prompt_ids": torch.ones(B, 1, dtype=torch.long),
        "prompt_mask": torch.ones(B, 1, dtype=torch.long),
        "completion_ids": torch.ones(B, T, dtype=torch.long),
        "completion_mask": mask,
        "advantages": inputs["advantages"],
        "old_per_token_logps": inputs["old"],
        "num_items_in_batch": mask.sum(),
    }
    loss = GRPOTrainer._compute_loss(trainer, None, batch)
    (grad,) = torch.autograd.grad(loss, logps)
    return loss.detach(), grad


def main(directory: str) -> None:
    inputs = torch.load(os.path.join(directory, "inputs.pt"))
    with open(os.path.join(directory, "cases.json"), encoding="utf-8") as f:
        cases = json.load(f)
    results = [trl_loss(inputs, case) for case in cases]
    torch.save({"version": trl.__version__, "results": results}, os.path.join(directory, "trl_out.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
