"""The documentation stays true to the code: every table generated from the code (``llm/docs_tables.py``) is
what the code makes now."""

from __future__ import annotations

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

    assert "`margin_only`" not in docs_tables.registries()
    request.addfinalizer(lambda: loss.LOSSES.remove("margin_only"))  # the registry is shared
    loss.register_loss("margin_only", loss.LossSpec(lambda pol, ref, beta, ls, gamma: pol.rejected - pol.chosen, False))
    assert "`sigmoid`, `hinge`, `ipo`, `simpo`, `orpo`, `margin_only`" in docs_tables.registries()


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
