"""The per-name handlers that map a MindSpeed value onto this project's fields: plain copies (``to``),
accepted names with no effect here (``no_effect``, ``kernel``), and the names that need work (the model and
data paths, output, tokenizer, per-rank batch sizes, the warmup in Megatron's samples).

A handler's docstring (the first paragraph; set by the factories for the handlers they make) says what the name
becomes here, for users: ``python -m llm.docs_tables`` writes it into docs/dialects.md's name table."""

from __future__ import annotations

import glob
import os
from collections.abc import Callable
from typing import Any

from llm.settings.dialects.mindspeed.rule_types import Given, Translation
from llm.utils.paths import resolve_input_path, search_dirs, tried


def to(field: str, section: str | None = None, convert: Callable[[Any], Any] | None = None):
    """Copy the value to our ``section.field`` (default: the role's own section)."""

    def apply(t: Translation, role: str, g: Given) -> None:
        t.set(section or role, field, g.value if convert is None else convert(g.value), g.where)

    how = f" ({convert.__doc__.strip()})" if convert is not None else ""
    apply.__doc__ = f"`{section or '<role>'}.{field}`{how}"
    return apply


def later(what: str):
    """Read after every name is (the value depends on other names): ``what`` says how."""

    def apply(t: Translation, role: str, g: Given) -> None:
        return None

    apply.__doc__ = what
    return apply


def negated(value: bool) -> bool:
    """negated"""
    return not value


def kernel(t: Translation, role: str, g: Given) -> None:
    """Accepted, one line in the log: a Megatron / Ascend kernel choice; the Hugging Face model computes the same
    function with its own kernels."""
    t.typed(g, bool | str | int | float)
    t.kernels.add(g.name)


def no_effect(why: str, annotation: Any = bool):
    """Accepted (typed) with ``why`` in the log: in MindSpeed's PPO it changes nothing that differs here."""

    def apply(t: Translation, role: str, g: Given) -> None:
        t.typed(g, annotation)
        t.note(g.where, f"{g.value!r}: {why}")

    apply.__doc__ = f"accepted, no effect (a line in the log): {why}"
    return apply


def load(t: Translation, role: str, g: Given) -> None:
    """`<role>.model_name_or_path`: a Hugging Face directory; a Megatron checkpoint
    (`latest_checkpointed_iteration.txt`, `iter_*`) stops, asking for the converted one. `reward.load` makes
    `reward.type` `orm`."""
    value = t.typed(g, str)
    found = resolve_input_path(value)
    if found is None:
        raise t.fail(g.where, f"{value!r} does not exist (looked in: {tried(value)})")
    found = os.path.abspath(found)
    megatron = [n for n in ("latest_checkpointed_iteration.txt", "release") if os.path.exists(os.path.join(found, n))]
    if megatron or glob.glob(os.path.join(found, "iter_*")):
        raise t.fail(
            g.where,
            f"{value!r} is a Megatron checkpoint ({(megatron or ['iter_*'])[0]}); this trainer loads Hugging Face "
            "models: convert it back (MindSpeed-LLM's checkpoint conversion, Megatron-mcore -> Hugging Face) and "
            "give that directory",
        )
    if not os.path.isfile(os.path.join(found, "config.json")):
        raise t.fail(g.where, f"{value!r} has no config.json: give a Hugging Face model directory")
    t.set(role, "model_name_or_path", found, g.where)
    t.models[role] = found
    if role == "reward" and ("reward", "type") not in t.origin:
        t.set("reward", "type", "orm", g.where)
        t.note(g.where, "the reward model (reward.type orm: its score at the last response token, as MindSpeed's)")


def save(t: Translation, role: str, g: Given) -> None:
    """`training.output_dir` (one, with `actor/` and `critic/` inside, Hugging Face format)."""
    t.set("training", "output_dir", t.typed(g, str), g.where)
    label = "actor" if role == "actor_rollout" else role
    t.note(g.where, f"training.output_dir: the {label} is written to {os.path.join(g.value, label)}/ (Hugging Face)")


def tokenizer_name(t: Translation, role: str, g: Given) -> None:
    """The actor's and the reward's `tokenizer_name_or_path`; ref and critic must use the actor's."""
    value = t.typed(g, str)
    if role in ("actor_rollout", "reward"):
        t.set(role, "tokenizer_name_or_path", value, g.where)
        return
    actor = t.given("actor_rollout", "tokenizer_name_or_path")
    if g.own and (actor is None or actor.value != value):
        raise t.fail(g.where, f"{role} reads the actor's token ids, so it uses the actor's tokenizer: remove it")


def bf16(t: Translation, role: str, g: Given) -> None:
    """`training.bf16` (actor and critic must agree); `ref.dtype` / `reward.dtype` where they differ."""
    t.typed(g, bool)  # the roles' values are compared in _precision


def mini_batch(field: str):
    """The per-rank size MindSpeed reads, times the role's devices (ours count all ranks)."""

    def apply(t: Translation, role: str, g: Given) -> None:
        per_rank = t.typed(g, int)
        ranks = t.ranks[role]
        t.set(role, field, per_rank * ranks, g.where)
        if ranks > 1:
            t.note(g.where, f"{per_rank} per rank x {ranks} ranks: {field} {per_rank * ranks} (ours counts all ranks)")

    apply.__doc__ = f"`<role>.{field}`: the per-rank value x the role's devices (ours count all ranks)"
    return apply


def warmup_name(t: Translation, role: str, g: Given) -> None:
    """`<role>.lr_warmup_steps`, converted from Megatron's scheduler samples to optimizer steps (MindSpeed
    advances the actor's scheduler by 1 per optimizer step, the critic's by `critic_mini_batch_size`);
    `lr_warmup_fraction` wins over `lr_warmup_iters`, as in Megatron."""
    name = g.name
    if name == "lr_warmup_iters" and t.given(role, "lr_warmup_fraction") is not None:
        t.note(g.where, "no effect: lr_warmup_fraction wins, as in Megatron")
        return
    amount = t.typed(g, float if name == "lr_warmup_fraction" else int)
    iters, batch = t.given(role, "train_iters"), t.given("actor_rollout", "global_batch_size")
    if amount == 0:
        t.set(role, "lr_warmup_steps", 0, g.where)
        return
    if iters is None or batch is None:
        raise t.fail(
            g.where, "a warmup needs training.train_iters and global_batch_size (Megatron counts it in samples)"
        )
    iters, batch = t.typed(iters, int), t.typed(batch, int)
    samples = amount * iters * batch if name == "lr_warmup_fraction" else amount * batch
    # Megatron's scheduler advances by 1 per actor optimizer step, by critic_mini_batch_size per critic step
    mini = t.given("critic", "critic_mini_batch_size")
    increment = 1 if role == "actor_rollout" else (mini.value if mini is not None else 1)
    steps = max(1, round(samples / increment))
    t.set(role, "lr_warmup_steps", steps, g.where)
    t.note(g.where, f"{amount}: {steps} optimizer steps of linear warmup ({samples:g} scheduler samples / {increment})")


def cliprange_or_none(value: float) -> float | None:
    """<= 0: no clipping"""
    return value if value > 0 else None  # critic.py: no clipping unless cliprange_value > 0


def data_path_name(t: Translation, role: str, g: Given) -> None:
    """`data.train_dataset_path` when it is a prompt file this project reads; a Megatron preprocessed prefix
    (`*_packed_*.bin/.idx`) or a blend stops, asking for the file `preprocess_data.py` read (with
    `data.map_keys` for what `--map-keys` said)."""
    value = t.typed(g, str).strip()
    if len(value.split()) > 1:
        raise t.fail(
            g.where,
            f"{value!r} is a Megatron blend (weight prefix ...): give data.train_dataset_path 'a,b' and "
            "data.dataset_probs 'w_a,w_b' instead",
        )
    found = resolve_input_path(value)
    if found is not None and not found.endswith((".bin", ".idx")):
        t.set("data", "train_dataset_path", os.path.abspath(found), g.where)
        return
    bases = [""] if os.path.isabs(value) else search_dirs()
    built = sorted(p for b in bases for p in glob.glob(os.path.join(b, value) + "*") if p.endswith((".bin", ".idx")))
    what = (
        f"is a Megatron preprocessed prefix ({os.path.basename(built[0])}: token ids written by preprocess_data.py)"
        if built
        else f"does not exist (looked in: {tried(value)})"
    )
    raise t.fail(
        g.where,
        f"{value!r} {what}. This trainer reads the prompt records themselves: give as data_path the file that "
        "preprocess_data.py read (JSON lines, JSON, Parquet or a Hugging Face dataset directory: "
        '{"src": prompt, "tgt": reference} or {"prompt", "answer"}), with data.map_keys for other column names '
        "(what --map-keys said)",
    )


def temperature(t: Translation, role: str, g: Given) -> None:
    """`actor_rollout.temperature` when sampling (MindSpeed's default 0.7; the log-probs use it too here, where
    MindSpeed scores at 1); 1 when greedy."""
    t.typed(g, float)  # applied in _sampling, which knows do_sample
