"""The refusals of Megatron-only values: a name is accepted only when its value means what this trainer does
(``same``: a line in the log says so); model parallelism, decaying schedules, data splits, other stages and
partial recomputation stop the run with the fix."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from llm.settings.dialects.mindspeed.rule_types import Given, Translation


def same(annotation: Any, ok: Callable[[Any, Translation, str], bool], meaning: str, fix: str):
    """Accepted when ``ok`` (the value means what this trainer does: ``meaning`` goes to the log); else stop."""

    def apply(t: Translation, role: str, g: Given) -> None:
        value = t.typed(g, annotation)
        if not ok(value, t, role):
            raise t.fail(g.where, f"{value!r} cannot take effect here: {fix}")
        t.note(g.where, f"{value!r}: {meaning}")

    apply.__doc__ = f"accepted (a line in the log) when it means: {meaning}; otherwise stops: {fix}"
    return apply


def parallel(name: str):
    return same(
        int,
        lambda v, t, role: v == 1,
        "no model parallelism, as here",
        f"Megatron's {name} is not available here; set it to 1 and give the role N devices in resource_pool "
        "(with use_ray: N ranks shard its model with FSDP2)",
    )


def tp(t: Translation, role: str) -> int:
    g = t.given(role, "tensor_model_parallel_size")
    return g.value if g is not None and isinstance(g.value, int) else 1


def decay(t: Translation, role: str, g: Given) -> None:
    """`constant` = our schedule (constant after the warmup); `linear`, `cosine` or unset (Megatron's default is
    linear) stop."""
    style = t.typed(g, str)
    if style != "constant":
        raise t.fail(
            g.where,
            f"{style!r}: this trainer's learning rate is constant after the warmup; set lr_decay_style: constant",
        )


def split(t: Translation, role: str, g: Given) -> None:
    """`100,0,0` only (every prompt trains); valid or test parts stop."""
    text = str(g.value)
    parts = [p.strip() for p in re.split(r"[,/]", text)]
    try:
        numbers = [float(p) for p in parts]
    except ValueError:
        raise t.fail(g.where, f"{text!r}: expected train,valid,test weights like 100,0,0") from None
    if not numbers or numbers[0] <= 0 or any(n != 0 for n in numbers[1:]):
        raise t.fail(g.where, f"{text!r}: PPO here trains on every prompt of the file and evaluates none: 100,0,0")


def stage_name(t: Translation, role: str, g: Given) -> None:
    """`ray_ppo` only (GRPO is `algorithm.adv_estimator: grpo`); another stage stops."""
    stage = t.typed(g, str)
    if stage != "ray_ppo":
        hint = " (GRPO: algorithm.adv_estimator grpo with n_samples_per_prompt >= 2)" if stage == "ray_grpo" else ""
        raise t.fail(g.where, f"{stage!r}: this reader runs MindSpeed's PPO (stage ray_ppo){hint}")


def recompute(t: Translation, role: str, g: Given) -> None:
    """`full`: `training.gradient_checkpointing: true`; `selective` stops."""
    value = t.typed(g, str)
    if value != "full":
        raise t.fail(g.where, f"{value!r}: only full recomputation (every decoder layer) is available here")
    t.set("training", "gradient_checkpointing", True, g.where)
