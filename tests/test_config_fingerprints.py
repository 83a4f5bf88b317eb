"""Every config file in the tree keeps its run fingerprint: a checkpoint written before a change to the
configuration code still resumes. ``tests/data/config_fingerprints.json`` holds the fingerprint values (what the
digest hashes) of each file in llm/config as the code before the llm/settings refactor computed them, with the
repository root written as ``<repo>``; equal values give equal digests (``run_fingerprint`` hashes the values and
the fingerprint version only). A change that must alter a fingerprint updates the file in the same commit and
says why and how old checkpoints resume."""

from __future__ import annotations

import dataclasses
import glob
import json
import os

import pytest

from llm.settings.critiques import CRITIQUE_ARGUMENT_TYPES
from llm.settings.dpo import DPO_ARGUMENT_TYPES
from llm.settings.fingerprint import FINGERPRINT_VERSION, run_fingerprint
from llm.settings.label import LABEL_ARGUMENT_TYPES
from llm.settings.load import parse_arguments, parse_ppo_config, parse_search_config
from llm.settings.reward import REWARD_ARGUMENT_TYPES
from llm.settings.search import SEARCH_SECTIONS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAVED = os.path.join(ROOT, "tests", "data", "config_fingerprints.json")
CONFIGS = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "llm", "config", "*", "*.json")))


def values_of(path: str) -> dict:
    kind = os.path.basename(path).split("_")[0]
    if kind == "search":  # evaluation only, nothing trained: its settings as read, which must keep their meaning
        config = parse_search_config([path])
        values = {name: dataclasses.asdict(getattr(config, name)) for name in SEARCH_SECTIONS}
        return portable(json.loads(json.dumps(values, sort_keys=True).replace(os.path.realpath(ROOT), "<repo>")))
    if kind in ("ppo", "grpo"):
        fingerprint = run_fingerprint(parse_ppo_config([path]))
    else:
        types = {
            "dpo": DPO_ARGUMENT_TYPES,
            "rm": REWARD_ARGUMENT_TYPES,
            "prm": REWARD_ARGUMENT_TYPES,
            "genprm": REWARD_ARGUMENT_TYPES,  # prm_kind generative
            "critiques": CRITIQUE_ARGUMENT_TYPES,  # llm/run_critiques.py: the settings its critiques are made with
            "implicit": REWARD_ARGUMENT_TYPES,  # implicit_prm_argument.json: an implicit PRM (run_reward.py)
            "label": LABEL_ARGUMENT_TYPES,  # llm/run_label.py: the settings its labels are made with (resume check)
        }
        fingerprint = run_fingerprint(*parse_arguments([path], *[types[kind]] if kind in types else []))
    return portable(
        json.loads(json.dumps(fingerprint.values, sort_keys=True).replace(os.path.realpath(ROOT), "<repo>"))
    )


def portable(values: dict) -> dict:
    """Paths inside the repository as relative ones: a model directory that exists is fingerprinted by its real
    path, one not made yet (models/SmolLM2-135M-Instruct before its conversion) as written, so the comparison
    does not depend on which of them this checkout has."""
    return json.loads(json.dumps(values, sort_keys=True).replace('"<repo>/', '"'))


def test_every_config_file_is_covered():
    with open(SAVED, encoding="utf-8") as f:
        saved = json.load(f)
    assert sorted(saved) == CONFIGS, "a config file was added or removed: add its values to the saved file"
    assert FINGERPRINT_VERSION == 1


@pytest.mark.parametrize("path", CONFIGS)
def test_fingerprint_of_an_unchanged_config_is_unchanged(path, monkeypatch):
    monkeypatch.chdir(ROOT)
    with open(SAVED, encoding="utf-8") as f:
        saved = portable(json.load(f)[path])
    assert values_of(path) == saved
