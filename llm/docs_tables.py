"""The documentation's tables that mirror code, made from that code.

    python -m llm.docs_tables            # rewrite every generated block in the pages
    python -m llm.docs_tables --check    # only list the stale ones (exit 1 if any)

A page (README.md, ARCHITECTURE.md, docs/*.md, bench/README.md) holds a generated block between
``<!-- generated: NAME -->`` and ``<!-- end generated -->``; ``BLOCKS`` makes each NAME's text:

- ``mindspeed-names``: MindSpeed-LLM's names (``llm/settings/dialects/mindspeed/names.py`` ``RULES``), what each
  becomes here (its handler's docstring) and where MindSpeed-LLM / Megatron reads it;
- ``openrlhf-flags`` and ``openrlhf-defaults``: the OpenRLHF / OpenLLaMA2 flag table and the defaults taken
  from it (``llm/settings/dialects/openrlhf/flags.py``);
- ``data-formats``: the data kinds, their formats and fields (``llm/data/readers/records.py``) and parsers;
- ``flat-fields``, ``reward-fields``, ``dpo-fields``: the fields of the flat scripts' argument dataclasses
  (``llm/settings/flat.py``, ``reward.py``, ``dpo.py``) beyond transformers' ``TrainingArguments``, with their
  defaults and help texts;
- ``registries``: every registry a config chooses a variant by (``llm/settings/registry.py``) with its names.

tests/test_docs.py fails when a block is stale. Like the run scripts, this module sits above the layers: it
imports the implementations that fill the registries.
"""

from __future__ import annotations

import dataclasses
import glob
import inspect
import json
import os
import re
import sys
from collections.abc import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMAND = "python -m llm.docs_tables"
BLOCK = re.compile(r"<!-- generated: ([\w-]+) -->\n(.*?)<!-- end generated -->", re.DOTALL)


def pages() -> list[str]:
    """The Markdown pages that may hold generated blocks (and that tests/test_docs.py checks for links)."""
    names = ["README.md", "ARCHITECTURE.md", "bench/README.md", *sorted(glob.glob("docs/*.md", root_dir=ROOT))]
    return [os.path.join(ROOT, n) for n in names if os.path.exists(os.path.join(ROOT, n))]


def cell(text: str) -> str:
    """One table cell: on one line, ``|`` escaped (GitHub splits cells on it even inside code) and, outside code
    spans, ``<`` (``<output dir>`` would read as an HTML tag)."""
    parts = " ".join(str(text).split()).replace("|", "\\|").split("`")
    return "`".join(p if i % 2 else p.replace("<", "&lt;") for i, p in enumerate(parts))


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def module_path(module: str) -> str:
    """``llm.a.b`` -> ``llm/a/b.py`` (a package: ``llm/a/b/``)."""
    base = os.path.join(*module.split("."))
    return base.replace(os.sep, "/") + ("/" if os.path.isdir(os.path.join(ROOT, base)) else ".py")


def first_paragraph(obj: object) -> str:
    doc = inspect.getdoc(obj) or ""
    return " ".join(doc.split("\n\n")[0].split())


# --- MindSpeed-LLM -------------------------------------------------------------------------------------------
def mindspeed_names() -> str:
    from llm.settings.dialects.mindspeed.names import RULES
    from llm.settings.dialects.mindspeed.rule_types import ALL

    rows: list[list[str]] = []
    for name, rule in RULES.items():
        here = first_paragraph(rule.apply)
        if not here:
            raise ValueError(f"MindSpeed name {name!r}: its handler has no docstring (what the name becomes here)")
        if len(rule.roles) == 1:
            here = here.replace("<role>", rule.roles[0])
        roles = "every role" if rule.roles == ALL else ", ".join(rule.roles)
        names, previous = f"`{name}`", rows[-1] if rows else None
        if previous and previous[1:] == [roles, here, f"`{rule.source}`"]:  # a family (model file, kernels): one row
            previous[0] += f", {names}"
            continue
        rows.append([names, roles, here, f"`{rule.source}`"])
    return table(["MindSpeed name", "read by", "here", "where MindSpeed-LLM / Megatron reads it"], rows)


# --- OpenRLHF / OpenLLaMA2 -----------------------------------------------------------------------------------
def openrlhf_side(action: str, ppo: bool) -> str:
    """What one side (flat scripts or PPO) of a ``TABLE`` action does, in words (the syntax: flags.py)."""
    if action == "*":
        return "its own translation ([below](#flags-with-their-own-translation))"
    kind = "->" if action.startswith("->") else action[0]
    if kind not in ("->", "=", "~", "!"):
        raise ValueError(f"openrlhf TABLE: unknown action {action!r}")
    body, _, why = action[len(kind) :].partition(" ~ ") if kind in ("->", "=") else ("", "", action[1:].strip())
    why, _, fix = why.partition(" ! ")
    why, fix = why.strip(), fix.strip()
    if kind == "!":
        return f"refused: {why}"
    if kind == "~":
        return f"noted: {why}"
    if kind == "=":
        values = ", ".join(f"`{v}`" for v in body.strip().split(","))
        return f"only {values} ({why}); else refused: {fix}"
    side = body.split("|")[1 if ppo else 0].strip() if "|" in body else body.strip()
    if side.startswith("!"):
        return f"refused: {side[1:].strip()}"
    if not side:
        return f"noted: {why}" if why else "noted"
    out = []
    for target in side.split():
        field, eq, const = target.partition("=")
        if not eq:
            out.append(f"`{field}`")
        elif const.startswith("%"):
            pairs = (p.partition(":") for p in const[1:].split(","))
            choices = ", ".join(f"`{k}` -> `{v}`" if v else f"`{k}`" for k, _, v in pairs)
            out.append(f"`{field}`: {choices} (another value is refused)")
        elif const.startswith("@"):
            out.append(f"`{field}` = the value of `--{const[1:]}`")
        else:
            out.append(f"`{field}` = `{const}`")
    return ", ".join(out) + (f" ({why})" if why else "")


def openrlhf_flags() -> str:
    from llm.settings.dialects.openrlhf.flags import SCRIPTS, TABLE

    rows = []
    for line in TABLE.strip().replace("\\\n", " ").splitlines():
        names, _type, scripts, action = line.split(None, 3)
        kinds = SCRIPTS.get(scripts) or tuple(scripts.split(","))
        flat = [k for k in kinds if k != "ppo"]
        flags = ", ".join(f"`--{n}`" for n in names.split(","))
        where = "all" if scripts == "all" else ", ".join(kinds)
        flat_cell = openrlhf_side(action, False) if flat else "-"
        ppo_cell = openrlhf_side(action, True) if "ppo" in kinds else "-"
        rows.append([flags, where, flat_cell, ppo_cell])
    return table(["OpenRLHF flag", "scripts", "SFT / RM / DPO (flat fields)", "PPO (section.field)"], rows)


def openrlhf_defaults() -> str:
    from llm.settings.dialects.openrlhf.flags import DEFAULTS

    rows = [
        [f"train_{kind}" if kind != "all" else "every script", ", ".join(f"`--{k}` {v}" for k, v in values.items())]
        for kind, values in DEFAULTS.items()
    ]
    return table(["OpenRLHF script", "defaults taken when the script leaves the flag out"], rows)


# --- data ------------------------------------------------------------------------------------------------------
def data_formats() -> str:
    from llm.data.readers.reading import PARSERS
    from llm.data.readers.records import FIELDS, FORMATS, KINDS, SUPPORTED_FORMATS

    rows = [
        [
            f"`{kind}`",
            f"`{FORMATS[kind]}`",
            ", ".join(f"`{f}`" for f in FIELDS[kind]),
            f"`{module_path(PARSERS[kind].__module__)}`",
        ]
        for kind in KINDS
    ]
    files = f"Files: {SUPPORTED_FORMATS}."
    return files + "\n\n" + table(["kind", "accepted formats", "fields (what `map_keys` may map onto)", "parser"], rows)


# --- fields ---------------------------------------------------------------------------------------------------
def default_text(f) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    return json.dumps(value) if isinstance(value, (bool, int, float, str, type(None), list, dict)) else str(value)


def fields_table(*classes: tuple[type, type | None]) -> str:
    """The fields each ``(class, base)`` declares beyond ``base``'s: name, dataclass, default and help."""
    rows = []
    for cls, base in classes:
        inherited = {f.name for f in dataclasses.fields(base)} if base else set()
        for f in dataclasses.fields(cls):
            if f.init and f.name not in inherited:
                if "help" not in f.metadata:
                    raise ValueError(f"{cls.__name__}.{f.name} has no help text (metadata={{'help': ...}})")
                rows.append([f"`{f.name}`", cls.__name__, f"`{default_text(f)}`", f.metadata["help"]])
    return table(["field", "declared in", "default", "what it does"], rows)


def flat_fields() -> str:
    import transformers

    from llm.settings.flat import DataArgument, ModelArgument, TrainingArguments

    return fields_table(
        (ModelArgument, None), (DataArgument, None), (TrainingArguments, transformers.TrainingArguments)
    )


def reward_fields() -> str:
    from llm.settings.flat import ModelArgument, TrainingArguments
    from llm.settings.reward import RewardModelArgument, RewardTrainingArguments

    return fields_table((RewardModelArgument, ModelArgument), (RewardTrainingArguments, TrainingArguments))


def dpo_fields() -> str:
    from llm.settings.dpo import DPOModelArgument, DPOTrainingArguments
    from llm.settings.flat import ModelArgument, TrainingArguments

    return fields_table((DPOModelArgument, ModelArgument), (DPOTrainingArguments, TrainingArguments))


# --- registries ------------------------------------------------------------------------------------------------
def registries() -> str:
    from llm.settings import registry

    rows = []
    for name, value in vars(registry).items():
        if not isinstance(value, registry.Registry):
            continue
        homes = []
        for entry in value.values():
            for obj in (entry, *(getattr(entry, f, None) for f in getattr(entry, "__dataclass_fields__", {}))):
                module = getattr(obj, "__module__", None) if callable(obj) else None
                if module and module.startswith("llm.") and module_path(module) not in homes:
                    homes.append(module_path(module))
        names = ", ".join(f"`{n}`" for n in value.names())
        if value.what == "algorithm.kl_penalty":
            names += f"; and `{registry.EXACT_KL}` (the exact KL over the vocabulary, not an estimator)"
        where = ", ".join(f"`{h}`" for h in homes)
        rows.append([f"`{value.what}`", f"`{name}`", names, f"`{module_path(value.provider)}`", where])
    return table(["config field", "registry", "names", "filled by importing", "implemented in"], rows)


BLOCKS: dict[str, Callable[[], str]] = {
    "mindspeed-names": mindspeed_names,
    "openrlhf-flags": openrlhf_flags,
    "openrlhf-defaults": openrlhf_defaults,
    "data-formats": data_formats,
    "flat-fields": flat_fields,
    "reward-fields": reward_fields,
    "dpo-fields": dpo_fields,
    "registries": registries,
}


# --- the pages -------------------------------------------------------------------------------------------------
def render(text: str, made: dict[str, str], where: str = "") -> str:
    """``text`` with every generated block replaced by ``made[name]``; an unknown name is an error."""

    def block(m: re.Match) -> str:
        name = m.group(1)
        if name not in made:
            raise ValueError(f"{where}: unknown generated block {name!r}; known: {', '.join(made)}")
        return f"<!-- generated: {name} -->\n\n{made[name]}\n\n<!-- end generated -->"

    return BLOCK.sub(block, text)


def refresh(check: bool = False) -> list[str]:
    """The pages whose generated blocks differ from the code (rewritten unless ``check``)."""
    made = {name: make() for name, make in BLOCKS.items()}
    stale = []
    for path in pages():
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if text.count("<!-- generated:") != text.count("<!-- end generated -->"):
            raise ValueError(f"{path}: a generated block without its end marker (or the reverse)")
        new = render(text, made, path)
        if new != text:
            stale.append(os.path.relpath(path, ROOT))
            if not check:
                with open(path, "w", encoding="utf-8", newline="\n") as f:
                    f.write(new)
    return stale


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    check = args == ["--check"]
    if args and not check:
        print(__doc__)
        return 2
    changed = refresh(check)
    verb = "stale" if check else "rewritten"
    print(f"{verb}: {', '.join(changed)}" if changed else "every generated table is up to date")
    return 1 if check and changed else 0


if __name__ == "__main__":
    sys.exit(main())
