"""``use_chat_template`` follows the tokenizer when unset, and the PRM placeholder message suggests a token that is
one token of *that* tokenizer. SmolLM2-135M-Instruct's tokenizer only (ChatML template; its weights are not loaded)."""

import json
import logging
import os
import shutil

import pytest
from transformers import AutoTokenizer

from llm.alignment.context import RunContext
from llm.alignment.ppo.build import PPOContext, load_prompts
from llm.alignment.sft.build import build_sft_trainer
from llm.data import encoding
from llm.data.encoding import placeholder_token_id, render_prompt, resolve_chat_template, usable_placeholder
from llm.settings.fingerprint import run_fingerprint
from llm.settings.flat import validate_arguments
from llm.settings.load import parse_arguments, parse_ppo_config
from llm.utils.checkpoints import differing_fields
from llm.utils.errors import UserError
from llm.utils.gguf import smollm2_dir
from tests.helpers import ROOT, TOKENIZER_DIR, tokenizer
from tests.test_ppo_run import config as ppo_config

MESSAGES = [{"role": "user", "content": "What is 2 + 3?"}]


@pytest.fixture(scope="module")
def smol():
    return AutoTokenizer.from_pretrained(smollm2_dir())


@pytest.fixture(scope="module")
def plain_dir(tmp_path_factory):
    """The tiny tokenizer without its chat template (a base model's tokenizer)."""
    path = tmp_path_factory.mktemp("plain_tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(TOKENIZER_DIR, name), path / name)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert AutoTokenizer.from_pretrained(path).chat_template is None
    return str(path)


def test_unset_follows_the_tokenizer_and_a_setting_wins(smol, plain_dir, caplog):
    caplog.set_level(logging.INFO, "llm.data.encoding")
    start = smol.convert_tokens_to_ids("<|im_start|>")
    assert resolve_chat_template(None, smol) is True
    assert "use_chat_template: on (the tokenizer has a chat template; set use_chat_template false" in caplog.text
    ids = render_prompt(MESSAGES, smol, resolve_chat_template(None, smol))
    assert ids[0] == start and smol.decode(ids).endswith("<|im_start|>assistant\n")
    off = render_prompt(MESSAGES, smol, resolve_chat_template(False, smol))
    assert start not in off and off == smol("What is 2 + 3?\n")["input_ids"]
    plain = AutoTokenizer.from_pretrained(plain_dir)
    caplog.clear()
    assert resolve_chat_template(None, plain) is False
    assert "use_chat_template: off (the tokenizer has no chat template)" in caplog.text
    with pytest.raises(UserError, match="data.use_chat_template is true but the tokenizer .* has no chat_template"):
        resolve_chat_template(True, plain, "data.use_chat_template")
    # the bundled tiny tokenizer has a chat template (llm/assets/tiny_tokenizer/chat_template.jinja): auto is on
    assert tokenizer().chat_template is not None and resolve_chat_template(None, tokenizer()) is True


def ppo(tmp_path, tok_dir, **data):
    data = {"use_chat_template": None, **data}  # unset (the tiny config says false)
    c = parse_ppo_config([ppo_config(tmp_path, actor_rollout={"tokenizer_name_or_path": tok_dir}, data=data)])
    run = PPOContext.load(c)
    return c, run, load_prompts(c, run)


def test_ppo_prompts_follow_the_actor_tokenizer(tmp_path, smol, plain_dir):
    start = smol.convert_tokens_to_ids("<|im_start|>")
    c, run, prompts = ppo(tmp_path, smollm2_dir())
    assert run.use_chat_template is True and all(p.ids[0] == start for p in prompts)
    assert c.data.use_chat_template is None  # the config stays as written
    c, run, prompts = ppo(tmp_path, smollm2_dir(), use_chat_template=False)
    assert run.use_chat_template is False and not any(start in p.ids for p in prompts)
    c, run, prompts = ppo(tmp_path, plain_dir)
    bos = tokenizer().bos_token_id
    assert run.use_chat_template is False and all(p.ids[0] == bos for p in prompts)


def test_ppo_fingerprint_of_an_unset_setting_is_the_resolved_one(tmp_path, smol, plain_dir):
    """The run's fingerprint (the resume check's, made before the prompts load) holds the tokenizer's answer for an
    unset setting, so a config without the field and a template-less tokenizer matches the checkpoints saved when
    the default was false."""

    def fingerprint(tok_dir, **data):
        return ppo(tmp_path, tok_dir, **data)[1].fingerprint

    assert fingerprint(plain_dir).digest == fingerprint(plain_dir, use_chat_template=False).digest
    auto, old = fingerprint(smollm2_dir()), fingerprint(smollm2_dir(), use_chat_template=False)
    assert auto.values["data.use_chat_template"] is True
    assert differing_fields(old.values, auto.values) == ["data.use_chat_template (false -> true)"]


def sft_args(tmp_path, **overrides):
    with open(os.path.join(ROOT, "llm", "config", "tiny", "sft_argument.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    for key in ("model_name_or_path", "tokenizer_name_or_path", "train_dataset_path", "dev_dataset_path"):
        if key in cfg and not os.path.isabs(cfg[key]):
            cfg[key] = os.path.join(ROOT, cfg[key])
    cfg.pop("use_chat_template", None)  # unset unless given (the tiny config says false)
    cfg.update(output_dir=str(tmp_path / "out"), report_to="none", do_eval=False, **overrides)
    path = tmp_path / f"sft_{len(list(tmp_path.glob('sft_*')))}.json"
    path.write_text(json.dumps(cfg))
    args = parse_arguments([str(path)])
    validate_arguments(*args)
    return args


def test_sft_build_resolves_it_once_and_the_fingerprint_sees_the_choice(tmp_path, plain_dir):
    user = tokenizer().convert_tokens_to_ids("<|user|>")
    model_args, data_args, training_args = sft_args(tmp_path)
    run = RunContext.load(model_args, data_args, training_args)
    assert run.use_chat_template is True  # the tiny tokenizer has a template
    _, train, _ = build_sft_trainer(run)
    assert data_args.use_chat_template is None  # the arguments stay as written
    assert set(first_ids(train)) == {user}
    _, train, _ = build_sft_trainer(RunContext.load(*sft_args(tmp_path, use_chat_template=False)))
    assert set(first_ids(train)) == {tokenizer().bos_token_id}
    # a template-less tokenizer: unset and false fingerprint alike (the run's choice is fingerprinted)
    unset = RunContext.load(*sft_args(tmp_path, tokenizer_name_or_path=plain_dir))
    false = RunContext.load(*sft_args(tmp_path, tokenizer_name_or_path=plain_dir, use_chat_template=False))
    assert unset.fingerprint.digest == false.fingerprint.digest
    assert unset.fingerprint.values["use_chat_template"] is False
    # the setting as written differs (null): only the run's record knows the choice
    assert run_fingerprint(*sft_args(tmp_path, tokenizer_name_or_path=plain_dir)).values["use_chat_template"] is None


def first_ids(train) -> list[int]:
    """The first token of every example in the packed rows (examples restart their positions at 0)."""
    return [row.input_ids[i] for row in train.rows for i, p in enumerate(row.position_ids) if p == 0]


# --- the PRM placeholder ------------------------------------------------------------------------------------
def test_placeholder_message_suggests_a_token_of_this_tokenizer(smol):
    with pytest.raises(UserError) as err:
        placeholder_token_id(smol, "ки", "placeholder_token")
    text = str(err.value)
    assert "'ки' must be exactly one token, but the tokenizer splits it into 2" in text
    assert "e.g. placeholder_token: '§'" in text and "add_placeholder_token: true" in text
    assert "'ки')" not in text  # the failing placeholder is never the suggestion
    assert placeholder_token_id(smol, "§", "placeholder_token") == 31854
    assert placeholder_token_id(tokenizer(), "ки", "placeholder_token") == 647  # one token there: no error
    with pytest.raises(UserError, match=r"'<step>' must be .*e\.g\. placeholder_token: 'ки'"):
        placeholder_token_id(tokenizer(), "<step>", "placeholder_token")


def test_no_usable_candidate_says_so(monkeypatch):
    monkeypatch.setattr(encoding, "PLACEHOLDER_CANDIDATES", ("§", "†"))  # neither is one tiny token
    with pytest.raises(UserError) as err:
        placeholder_token_id(tokenizer(), "<step>", "placeholder_token")
    assert "(none of '§', '†' is one token of this tokenizer)" in str(err.value) and "e.g." not in str(err.value)


class MergingTokenizer:
    """'§' is one token alone but merges with the newline after it (as some vocabularies hold '§\\n')."""

    def encode(self, text, add_special_tokens=False):
        return {"§": [5], "§\nStep": [9, 7]}.get(text, [1, 2])


def test_a_candidate_that_merges_with_the_newline_is_not_usable(smol):
    assert not usable_placeholder(MergingTokenizer(), "§")
    assert usable_placeholder(smol, "§") and usable_placeholder(smol, "†") and not usable_placeholder(smol, "ки")
