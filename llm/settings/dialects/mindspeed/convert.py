"""``translate``: the entry ``llm.settings.load`` calls, one MindSpeed-layout config into this project's
layout: merge, pool, every name through ``RULES``, then precision, sampling and MindSpeed's defaults."""

from __future__ import annotations

import os

from llm.settings.dialects.mindspeed.architecture import check_architecture
from llm.settings.dialects.mindspeed.files import model_files
from llm.settings.dialects.mindspeed.merge import merge, ours, translate_pool
from llm.settings.dialects.mindspeed.names import RULES
from llm.settings.dialects.mindspeed.rule_types import ACTOR, MINDSPEED_SECTIONS, ROLE_PLACES, TRAINED, Translation
from llm.utils.errors import closest


def _precision(t: Translation) -> None:
    def bf16(role: str) -> bool:
        g = t.given(role, "bf16")
        return bool(g is not None and g.value)

    if bf16("actor_rollout") != bf16("critic"):
        raise t.fail("bf16", "actor_rollout and critic differ: the trained models share training.bf16 here")
    t.set("training", "bf16", bf16("actor_rollout"), "bf16 of actor_rollout and critic")
    for role in ("ref", "reward"):
        if bf16(role) != bf16("actor_rollout"):
            t.set(role, "dtype", "bfloat16" if bf16(role) else "float32", f"{ROLE_PLACES[role]}.bf16")


def _sampling(t: Translation) -> None:
    """MindSpeed's generation samples at ``temperature`` (default 0.7) only with do_sample (default false);
    its log-probs are always at temperature 1."""
    t.default("actor_rollout", "do_sample", False, "MindSpeed default: --do-sample not given")
    g = t.given("actor_rollout", "temperature")
    if not t.out["actor_rollout"]["do_sample"]:
        if g is not None:
            t.note(g.where, f"{g.value}: no effect with do_sample false (greedy), as in MindSpeed")
        t.set("actor_rollout", "temperature", 1.0, "greedy generation (log-probs at temperature 1, as MindSpeed's)")
        return
    value = g.value if g is not None else 0.7
    t.set("actor_rollout", "temperature", value, g.where if g else "MindSpeed default temperature 0.7")
    if value != 1.0:
        t.note(
            "temperature",
            f"{value}: sampling and log-probs at {value} here (MindSpeed samples at it but scores log-probs at 1)",
        )


def translate(raw: dict, path: str, found: str, notes: list[str]) -> dict:
    """A MindSpeed-layout config (hydra YAML or the same in JSON) as a dict in this project's layout."""
    t = Translation(path, notes)
    for key in raw:
        if key not in MINDSPEED_SECTIONS:
            inside = (
                " (in MindSpeed's layout it goes inside actor_rollout_ref)" if key in ("actor_rollout", "ref") else ""
            )
            raise t.fail(key, f"unknown section{inside}; closest valid names: {closest(str(key), MINDSPEED_SECTIONS)}")
    merge(t, raw, model_files(t, raw.get("defaults"), os.path.dirname(os.path.abspath(found))))
    translate_pool(t, raw.get("resource_pool"))
    for role, merged in t.merged.items():
        # the parallel sizes first: a refused one explains the settings that depend on it (sequence_parallel)
        for name, g in sorted(merged.items(), key=lambda item: not item[0].endswith("_parallel_size")):
            rule = RULES[name]
            if role not in rule.roles:
                if g.own:
                    readers = " and ".join(ROLE_PLACES[r] for r in rule.roles)
                    raise t.fail(
                        g.where, f"MindSpeed's PPO reads {name} only in {readers}: move it there (or to training)"
                    )
                continue  # merged in from training or a model file for the roles that read it
            rule.apply(t, role, g)
    seq = t.given("actor_rollout", "seq_length")
    if seq is not None:
        length = t.typed(seq, int) - t.out["actor_rollout"].get("max_prompt_length", 512)
        if length < 1:
            raise t.fail(seq.where, f"{seq.value} leaves no room for a response after max_prompt_length")
        t.set("actor_rollout", "max_response_length", length, f"{seq.where} - max_prompt_length")
    _precision(t)
    _sampling(t)
    # MindSpeed's defaults where they differ from ours (mindspeed_llm/training/arguments.py, Megatron arguments.py)
    t.default("actor_rollout", "shuffle_minibatch", False, "MindSpeed default: --shuffle-minibatch not given")
    t.default("actor_rollout", "ppo_mini_batch_size", t.ranks["actor_rollout"], "MindSpeed default 1 per rank")
    t.default("critic", "critic_mini_batch_size", t.ranks["critic"], "MindSpeed default 1 per rank")
    t.default("training", "seed", 1234, "Megatron default")
    algorithm = raw.get("algorithm") if isinstance(raw.get("algorithm"), dict) else {}
    for role in TRAINED if algorithm.get("adv_estimator", "gae") == "gae" else ACTOR:
        t.default(role, "weight_decay", 0.01, "Megatron default")
        if t.given(role, "lr_decay_style") is None:
            raise t.fail(
                ROLE_PLACES[role],
                "lr_decay_style is not set, and Megatron's default is linear decay, which this trainer does not do: "
                "set lr_decay_style: constant",
            )
    if "reward" not in t.models and ("reward", "type") not in t.origin:
        raise t.fail("reward", "give load (the reward model), or our type: rule with rule: module:function")
    check_architecture(t)
    if t.kernels:
        t.note(
            "kernels",
            f"{', '.join(sorted(t.kernels))}: Megatron/Ascend kernel choices; the Hugging Face model "
            "computes the same function with its own",
        )
    for section in ("algorithm", "data"):
        values = raw.get(section) or {}
        if not isinstance(values, dict):
            raise t.fail(section, "must be a mapping")
        for key, value in values.items():
            if key in ours(t, section):
                t.set(section, key, value, f"{section}.{key}")
            else:
                t.out[section][key] = value  # the section's own check names the closest valid keys
    return {name: values for name, values in t.out.items() if values}
