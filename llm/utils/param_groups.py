"""Parameters at their own learning rate in an optimizer already built (``own_learning_rate``): an ORM's new
score head at ``head_learning_rate`` while the pretrained layers keep ``learning_rate``."""

from __future__ import annotations

import torch


def own_learning_rate(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], lr: float) -> list[torch.Tensor]:
    """Move ``params`` out of the groups of ``optimizer`` (which has not stepped) into groups of their own at
    peak learning rate ``lr``: one new group per group they came from, with its other settings (weight decay,
    betas, fused, ...). A learning-rate schedule built afterwards scales every group by the same factor, so the
    new groups follow the same warmup and decay. Returns the parameters moved."""
    if optimizer.state:
        raise RuntimeError("own_learning_rate: the optimizer has stepped already (its state is keyed by group)")
    wanted = {id(p) for p in params}
    moved: list[torch.Tensor] = []
    new_groups = []
    for group in optimizer.param_groups:
        own = [p for p in group["params"] if id(p) in wanted]
        if not own:
            continue
        group["params"] = [p for p in group["params"] if id(p) not in wanted]
        new_groups.append({**group, "params": own, "lr": lr})
        moved.extend(own)
    optimizer.param_groups[:] = [g for g in optimizer.param_groups if g["params"]]
    for group in new_groups:
        optimizer.add_param_group(group)
    if len(moved) != len(wanted):
        raise RuntimeError(
            f"own_learning_rate: {len(wanted) - len(moved)} of the {len(wanted)} parameters are not in the optimizer"
        )
    return moved
