"""Each role's arguments merged as MindSpeed merges them (model file < ``training`` < its own section), and
``resource_pool`` read into this project's device counts (the actor's training / inference split)."""

from __future__ import annotations

from typing import Any

from llm.settings import fields
from llm.settings.dialects.mindspeed.names import RULES
from llm.settings.dialects.mindspeed.rule_types import ALL, ROLE_PLACES, Given, Translation
from llm.utils.errors import closest


def ours(t: Translation, section: str) -> set[str]:
    return set(fields.init_fields(t.sections[section]))


def merge(t: Translation, raw: dict, models: dict) -> None:
    """Each role's arguments, model file < training < own section; our own names go straight to ``out``."""
    training = raw.get("training") or {}
    if not isinstance(training, dict):
        raise t.fail("training", "must be a mapping of Megatron arguments")
    shared = {}
    for key, value in training.items():
        if key in RULES:
            shared[key] = Given(key, value, f"training.{key}", False)
        elif key in ours(t, "training"):
            t.set("training", key, value, f"training.{key}")
        else:
            valid = [*RULES, *ours(t, "training")]
            raise t.fail(f"training.{key}", f"unknown name; closest valid names: {closest(str(key), valid)}")
    pair = raw.get("actor_rollout_ref")
    if not isinstance(pair, dict) or "actor_rollout" not in pair:
        raise t.fail("actor_rollout_ref", "must hold actor_rollout: {...} (and ref: {...})")
    for key in pair:
        if key not in ("actor_rollout", "ref"):
            raise t.fail(f"actor_rollout_ref.{key}", "unknown role; actor_rollout_ref holds actor_rollout and ref")
    sections = {
        "actor_rollout": pair["actor_rollout"],
        "ref": pair.get("ref"),
        **{r: raw.get(r) for r in ("critic", "reward")},
    }
    for role, own in sections.items():
        place = ROLE_PLACES[role]
        own = {} if own is None else own
        if not isinstance(own, dict):
            raise t.fail(place, "must be a mapping of arguments")
        merged: dict[str, Given] = {}
        if "model" in own:
            name = own["model"]
            if name not in models:
                raise t.fail(f"{place}.model", f"{name!r} is not among the model files in defaults ({sorted(models)})")
            where, values = models[name]
            merged.update({k: Given(k, v, f"{where}.{k}", False) for k, v in values.items()})
        merged.update(shared)
        for key, value in own.items():
            if key == "model":
                continue
            if key in RULES:
                merged[key] = Given(key, value, f"{place}.{key}", True)
            elif key in ours(t, role):
                t.set(role, key, value, f"{place}.{key}")
            else:
                valid = [*RULES, *ours(t, role)]
                raise t.fail(f"{place}.{key}", f"unknown name; closest valid names: {closest(str(key), valid)}")
        for key, g in merged.items():
            if key not in RULES:
                raise t.fail(g.where, f"unknown name; closest valid names: {closest(str(key), RULES)}")
        t.merged[role] = merged


def translate_pool(t: Translation, raw: Any) -> None:
    """``resource_pool``: a list of devices per node for each role (RayResourcePool(process_on_nodes)); the
    actor's split into training and generation devices by num_gpus_for_train / num_gpus_for_infer."""
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise t.fail("resource_pool", "must be a mapping")
    counts: dict[str, float] = {}
    for key, value in raw.items():
        where = f"resource_pool.{key}"
        if key in ALL and isinstance(value, list):
            per_node = fields.check_value(value, list[int], f"{t.path}: {where}")
            if not per_node or min(per_node) < 1:
                raise t.fail(where, f"{value}: devices on each node, each >= 1 (e.g. [2], or [8, 8] on two nodes)")
            counts[key] = sum(per_node)
            if len(per_node) > 1:
                t.note(
                    where, f"{value}: {sum(per_node)} devices; one placement group packs them onto as few nodes as fit"
                )
        elif key in ours(t, "resource_pool"):
            t.set("resource_pool", key, value, where)
            if key in ALL:
                counts[key] = t.out["resource_pool"][key]
        else:
            raise t.fail(where, f"unknown name; closest valid names: {closest(str(key), ours(t, 'resource_pool'))}")
    train, infer = t.given("actor_rollout", "num_gpus_for_train"), t.given("actor_rollout", "num_gpus_for_infer")
    if (train is None) != (infer is None):
        given = train or infer
        raise t.fail(given.where, "give both num_gpus_for_train and num_gpus_for_infer (MindSpeed needs both)")
    actor = counts.get("actor_rollout", 1)
    if train is not None:
        n_train, n_infer = t.typed(train, int), t.typed(infer, int)
        if n_train < 1 or n_infer < 0 or n_train + n_infer != actor:
            raise t.fail(
                train.where,
                f"{n_train} + num_gpus_for_infer {n_infer} must be resource_pool.actor_rollout ({actor}): MindSpeed "
                "splits the actor's devices into a training and an inference group",
            )
        actor = n_train
        if n_infer:
            t.set("resource_pool", "rollout", n_infer, infer.where)
            t.note(infer.where, f"{n_infer}: resource_pool.rollout, a generation copy synced after every update")
    for role in ALL:
        amount = actor if role == "actor_rollout" else counts.get(role, 1)
        t.set("resource_pool", role, amount, f"resource_pool.{role}")
    t.ranks = {role: int(a) if a >= 1 else 1 for role, a in ((r, t.out["resource_pool"][r]) for r in ALL)}
    if ("resource_pool", "device") not in t.origin:
        import torch

        t.default(
            "resource_pool",
            "device",
            "gpu" if torch.cuda.is_available() else "cpu",
            "MindSpeed counts accelerators: gpu when this machine has CUDA, else cpu",
        )
    pool = t.out["resource_pool"]
    spread = pool.get("rollout", 0) > 0 or any(pool[r] != 1 for r in ALL)
    t.default(
        "resource_pool",
        "use_ray",
        pool["device"] == "gpu" or spread,
        "MindSpeed runs its roles on Ray; one process when every role has one CPU device",
    )
