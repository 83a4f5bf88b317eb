"""The documentation stays true to the code: every table generated from the code (``llm/docs_tables.py``) is
what the code makes now, and every relative link (with its anchor), repository path and ``llm.`` module named in
README.md, ARCHITECTURE.md, docs/*.md and bench/README.md exists."""

from __future__ import annotations

import glob
import importlib
import importlib.util
import os
import re

import pytest

from llm import docs_tables

REFRESH = f"run `{docs_tables.COMMAND}` and commit the pages it rewrites"


def read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


# --- generated tables ------------------------------------------------------------------------------------------
def test_every_generated_table_is_up_to_date():
    stale = docs_tables.refresh(check=True)
    assert stale == [], f"the generated tables of {', '.join(stale)} no longer match the code: {REFRESH}"


def test_every_table_kind_is_on_a_page():
    text = "".join(read(p) for p in docs_tables.pages())
    missing = [name for name in docs_tables.BLOCKS if f"<!-- generated: {name} -->" not in text]
    assert missing == [], f"no page holds these generated tables any more: {missing}"


def test_a_stale_table_is_found_and_rewritten(tmp_path, monkeypatch):
    page = tmp_path / "page.md"
    page.write_text("# A page\n\n<!-- generated: registries -->\nold text\n<!-- end generated -->\n\nprose\n")
    monkeypatch.setattr(docs_tables, "ROOT", str(tmp_path))
    monkeypatch.setattr(docs_tables, "pages", lambda: [str(page)])
    assert docs_tables.refresh(check=True) == ["page.md"]
    assert "old text" in page.read_text()  # --check writes nothing
    assert docs_tables.refresh() == ["page.md"]
    text = page.read_text()
    assert "old text" not in text and "| `loss_type` | `DPO_LOSSES` |" in text and text.endswith("\nprose\n")
    assert docs_tables.refresh(check=True) == []
    assert docs_tables.main(["--check"]) == 0


def test_an_unknown_or_unclosed_block_is_an_error(tmp_path, monkeypatch):
    page = tmp_path / "page.md"
    monkeypatch.setattr(docs_tables, "pages", lambda: [str(page)])
    page.write_text("<!-- generated: no-such-table -->\n<!-- end generated -->\n")
    with pytest.raises(ValueError, match="unknown generated block 'no-such-table'"):
        docs_tables.refresh(check=True)
    page.write_text("<!-- generated: registries -->\n")
    with pytest.raises(ValueError, match="without its end marker"):
        docs_tables.refresh(check=True)


def test_a_registered_dpo_loss_shows_in_the_registry_table(request):
    from llm.alignment.dpo import loss

    names = [*loss.LOSSES, "margin_only"]
    assert "`margin_only`" not in docs_tables.registries()
    request.addfinalizer(lambda: loss.LOSSES.remove("margin_only"))  # the registry is shared
    loss.register_loss("margin_only", loss.LossSpec(lambda pol, ref, beta, ls, gamma: pol.rejected - pol.chosen, False))
    assert "| `loss_type` | `DPO_LOSSES` | " + ", ".join(f"`{n}`" for n in names) + " |" in docs_tables.registries()


def test_the_mindspeed_table_says_what_each_name_becomes(monkeypatch):
    from llm.settings.dialects.mindspeed import names
    from llm.settings.dialects.mindspeed.handlers import to
    from llm.settings.dialects.mindspeed.rule_types import ACTOR, Rule

    text = docs_tables.mindspeed_names()
    # to() describes itself; a rule read by one role names that role's section
    assert "| `train_iters` | every role | `training.max_steps` |" in text
    assert "| `ppo_epochs` | actor_rollout | `actor_rollout.ppo_epochs` |" in text
    assert "| `cliprange_value` | critic | `critic.cliprange_value` (&lt;= 0: no clipping) |" in text
    rules = {**names.RULES, "new_name": Rule(ACTOR, to("top_k"), "somewhere.py")}
    monkeypatch.setattr(names, "RULES", rules)
    assert "| `new_name` | actor_rollout | `actor_rollout.top_k` | `somewhere.py` |" in docs_tables.mindspeed_names()
    monkeypatch.setattr(names, "RULES", {"silent": Rule(ACTOR, lambda t, r, g: None, "x.py")})
    with pytest.raises(ValueError, match="'silent': its handler has no docstring"):
        docs_tables.mindspeed_names()


@pytest.mark.parametrize(
    "action, ppo, words",
    [
        ("-> output_dir | training.output_dir ~ the final model", False, "`output_dir` (the final model)"),
        ("-> output_dir | training.output_dir ~ the final model", True, "`training.output_dir` (the final model)"),
        ("-> bf16=true fp16_opt_level=O2 | training.bf16=true", False, "`bf16` = `true`, `fp16_opt_level` = `O2`"),
        ("-> zero_padding=true | ~ exact packing", True, "noted: exact packing"),
        ("-> weight_quantize_algo=nf4 | !no QLoRA in PPO", True, "refused: no QLoRA in PPO"),
        ("-> | a.kl_penalty=%k1:kl,k3:low_var_kl", True, "`a.kl_penalty`: `k1` -> `kl`, `k3` -> `low_var_kl`"),
        ("-> | a.kl_loss_coef=@init_kl_coef", True, "`a.kl_loss_coef` = the value of `--init_kl_coef`"),
        ("=score ~ named score here too ! the head is 'score'", True, "only `score` (named score here too); else"),
        ("~ speed only", False, "noted: speed only"),
        ("! remove it", True, "refused: remove it"),
        ("*", False, "its own translation"),
    ],
)
def test_openrlhf_actions_in_words(action, ppo, words):
    assert docs_tables.openrlhf_side(action, ppo).startswith(words)


def test_every_data_kind_has_a_row_with_its_parser():
    from llm.data.readers.reading import PARSERS
    from llm.data.readers.records import KINDS

    assert set(PARSERS) == set(KINDS)
    text = docs_tables.data_formats()
    for kind in KINDS:
        assert f"| `{kind}` |" in text
    assert "| `sft` | `PaddleNLP" in text and "`llm/data/readers/sft.py` |" in text


def test_every_flat_field_has_help_and_a_row():
    text = docs_tables.flat_fields() + docs_tables.reward_fields() + docs_tables.dpo_fields()
    for row in ("| `max_seq_len` | DataArgument | `4096` |", "| `process_reward` | RewardTrainingArguments |"):
        assert row in text
    assert "| `learning_rate` |" not in text  # transformers' own fields are not repeated


# --- links and repository paths --------------------------------------------------------------------------------
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
# a repository path: starts with a top folder of the repository, not inside another path or a URL
PATH = re.compile(r"(?<![\w./$~-])((?:llm|tests|bench|scripts|docs)/[\w./{},*<>-]*)")
# ARCHITECTURE.md names the layers' files relative to llm/
LLM_RELATIVE = re.compile(r"(?<![\w./$~-])((?:alignment|data|settings|utils)/[\w./{},*<>-]*)")
MODULE = re.compile(r"(?<![\w./-])(llm(?:\.\w+)+)")
FENCE = re.compile(r"^(```|~~~)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    found, seen, fenced = set(), {}, False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6} (.+)", line)):
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def expand(path: str) -> list[str]:
    """``a_{x,y}.json`` -> ``a_x.json``, ``a_y.json``."""
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [q for part in m.group(1).split(",") for q in expand(path[: m.start()] + part + path[m.end() :])]


def path_exists(path: str) -> bool:
    full = os.path.join(docs_tables.ROOT, path)
    return bool(glob.glob(full)) if "*" in path else os.path.exists(full)


def broken_paths(text: str, relative_to_llm: bool = False) -> list[str]:
    found = [(m.group(1), "") for m in PATH.finditer(text)]
    if relative_to_llm:
        found += [(m.group(1), "llm/") for m in LLM_RELATIVE.finditer(text)]
    broken = []
    for raw, prefix in found:
        path = raw.rstrip(".,;:")
        if "<" in path or ">" in path:  # a placeholder (llm/config/<model>/)
            continue
        broken += [prefix + p for p in expand(path) if not path_exists(prefix + p)]
    return broken


def is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent is no package
        return False


def broken_modules(text: str) -> list[str]:
    """Dotted names ``llm.a.b`` (or ``llm.a.b.attribute``) that name no module (nor an attribute of one)."""
    from llm.alignment.ppo.rewards.rule import MOVED_MODULES  # old names that configs may still give

    broken = []
    for m in MODULE.finditer(text):
        name = m.group(1)
        parts = name.split(".")
        cut = next(c for c in range(len(parts), 0, -1) if is_module(".".join(parts[:c])))
        rest = parts[cut:]
        if name in MOVED_MODULES:
            continue
        if len(rest) > 1 or (rest and not hasattr(importlib.import_module(".".join(parts[:cut])), rest[0])):
            broken.append(name)
    return broken


def broken_links(path: str, text: str) -> list[str]:
    broken = []
    for m in LINK.finditer(text):
        target = m.group(1)
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        full = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
        if not os.path.exists(full):
            broken.append(target)
        elif anchor and full.endswith(".md") and anchor not in anchors(read(full)):
            broken.append(f"{target} (no such heading)")
    return broken


def test_every_link_and_repository_path_on_the_pages_exists():
    problems = {}
    for path in docs_tables.pages():
        text = read(path)
        name = os.path.relpath(path, docs_tables.ROOT)
        found = broken_links(path, text) + broken_paths(text, name == "ARCHITECTURE.md") + broken_modules(text)
        if found:
            problems[name] = found
    assert problems == {}, f"links, paths or modules that do not exist: {problems}"


def test_the_checkers_find_what_is_missing(tmp_path):
    page = tmp_path / "page.md"
    text = (
        "# Top\n\n## Scaling out: torchrun, FSDP2\n\n```\n# a comment, not a heading\n```\n\n"
        "[ok](#scaling-out-torchrun-fsdp2) [bad](#a-comment-not-a-heading) [gone](nowhere.md) [web](https://x.org/a)\n"
    )
    page.write_text(text)
    assert broken_links(str(page), text) == ["#a-comment-not-a-heading (no such heading)", "nowhere.md"]
    assert anchors("# A\n# A\n") == {"a", "a-1"}
    text = "`llm/run_reward.py`, `llm/run_rewards.py`, llm/config/<model>/x.json, `llm/run_*.py`, tests/nothing_*.py"
    assert broken_paths(text) == ["llm/run_rewards.py", "tests/nothing_*.py"]
    assert broken_paths("bench/results/real_learning_{orm,prm}_long.json, bench/results/x_{a,b}.json.") == [
        "bench/results/x_a.json",
        "bench/results/x_b.json",
    ]
    assert broken_paths("`alignment/ppo/objectives.py`, `alignment/ppo/rules.py`", relative_to_llm=True) == [
        "llm/alignment/ppo/rules.py"
    ]
    text = "`llm.utils.gguf.smollm2_dir()`, llm.data.make_arithmetic, llm.alignment.ppo.rules, llm.utils.gguf.nothing"
    assert broken_modules(text) == ["llm.utils.gguf.nothing"]
    assert broken_modules("llm.no_such_module") == ["llm.no_such_module"]
    assert slug("`bench_packing.py`: padded batches vs packed rows") == "bench_packingpy-padded-batches-vs-packed-rows"


def test_the_readme_stays_a_front_door():
    lines = read(os.path.join(docs_tables.ROOT, "README.md")).count("\n")
    assert lines <= 350, f"README.md has {lines} lines: put reference material in docs/, measurements in bench/"
