"""Configuration and path errors appear before the model code is imported or any model loads, name the config
file and the field, and suggest the nearest existing file for a mistyped path."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from llm.settings.flat import validate_arguments
from llm.settings.load import parse_arguments, parse_ppo_config
from llm.settings.reward import REWARD_ARGUMENT_TYPES
from llm.utils import run_files
from llm.utils.errors import UserError
from tests.helpers import ROOT

PRM = "llm/config/tiny/prm_argument.json"


def test_a_mistyped_data_path_names_the_file_the_field_and_the_nearest_file(monkeypatch):
    monkeypatch.chdir(ROOT)
    args = parse_arguments([PRM, "--train_dataset_path", "llm/data/sample/prm_trian.jsonl"], REWARD_ARGUMENT_TYPES)
    with pytest.raises(UserError) as err:
        validate_arguments(*args)
    text = str(err.value)
    assert text.startswith(f"{PRM}: train_dataset_path 'llm/data/sample/prm_trian.jsonl' does not exist")
    assert text.endswith("did you mean 'llm/data/sample/prm_train.jsonl'?")


def test_a_far_name_gets_no_suggestion(monkeypatch):
    monkeypatch.chdir(ROOT)
    args = parse_arguments([PRM, "--dev_dataset_path", "llm/data/sample/zzz.jsonl", "--do_eval"], REWARD_ARGUMENT_TYPES)
    with pytest.raises(UserError, match=r"dev_dataset_path 'llm/data/sample/zzz.jsonl' does not exist") as err:
        validate_arguments(*args)
    assert "did you mean" not in str(err.value)


def test_a_mistyped_config_file_gets_the_nearest_name(monkeypatch):
    monkeypatch.chdir(ROOT)
    with pytest.raises(UserError, match=r"did you mean 'llm/config/tiny/prm_argument.json'\?"):
        parse_arguments(["llm/config/tiny/prm_argment.json"], REWARD_ARGUMENT_TYPES)
    with pytest.raises(UserError, match=r"did you mean 'llm/config/tiny/ppo_argument.json'\?"):
        parse_ppo_config(["llm/config/tiny/ppo_argumnet.json"])


def test_the_error_comes_before_the_model_code_is_imported():
    """In a fresh interpreter: the run stops with exit 2 and the message, and the trainer's build module (model code,
    data pipeline) was never imported."""
    code = (
        "import sys\n"
        "from llm.run_reward import main\n"
        "from llm.utils.errors import run_cli\n"
        "sys.argv = ['run_reward.py', sys.argv[1], '--train_dataset_path', 'llm/data/sample/prm_trian.jsonl']\n"
        "try:\n"
        "    run_cli(main)\n"
        "except SystemExit as e:\n"
        "    print('exit', e.code, 'llm.alignment.rm.build' in sys.modules, 'llm.alignment.runner' in sys.modules)\n"
    )
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code, PRM], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert "exit 2 False False" in done.stdout, done.stdout + done.stderr
    assert "did you mean 'llm/data/sample/prm_train.jsonl'?" in done.stderr


def test_evaluating_a_random_model_needs_an_explicit_request(monkeypatch):
    """The README's evaluation-only command once evaluated the tiny config's random model (F1 0) and wrote over the
    trained demo's results; now it stops, naming the fix, unless eval_random_init asks for a random baseline."""
    monkeypatch.chdir(ROOT)
    cli = [PRM, "--do_train", "false", "--do_eval", "true", "--output_dir", "/tmp/unused_eval"]
    with pytest.raises(UserError, match=r"prm_argument.json: an evaluation-only run .* random weights .*--init_from"):
        validate_arguments(*parse_arguments(cli, REWARD_ARGUMENT_TYPES))
    validate_arguments(*parse_arguments([*cli, "--eval_random_init", "true"], REWARD_ARGUMENT_TYPES))
    trained = [*cli, "--model_name_or_path", "llm/assets/tiny-llama", "--init_from_config", "false"]
    model_args, data_args, training_args = parse_arguments(trained, REWARD_ARGUMENT_TYPES)
    validate_arguments(model_args, data_args, training_args)  # weights come from the checkpoint: no objection
    assert training_args.do_eval and not training_args.do_train


def test_run_pipeline_again_names_its_own_option(tmp_path):
    """A second run_pipeline.py over the same output_dir used to stop inside a stage, advising settings that the
    pipeline does not accept; it now stops at once naming its own --overwrite."""
    from llm.run_pipeline import main as pipeline

    (tmp_path / "sft").mkdir()
    run_files.record(str(tmp_path / "sft"), ["model.safetensors"])  # the earlier pipeline's SFT stage wrote it
    with pytest.raises(UserError, match=r"holds an earlier pipeline run \(sft\): add --overwrite"):
        pipeline(["--output_dir", str(tmp_path)])
