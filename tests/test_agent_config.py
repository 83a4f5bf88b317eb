"""The ``environment`` section of a PPO config (llm/settings/environment.py, environment_validation.py): read from
the file and the command line, absent means None, every wrong value one error naming the file and the field."""

import pytest

from llm.settings.fingerprint import run_fingerprint
from llm.settings.load import parse_ppo_config
from llm.utils.errors import UserError
from tests.helpers import ROOT, ppo_config_file

GRPO = f"{ROOT}/llm/config/tiny/grpo_cispo_argument.json"
ENV = {"name_or_path": "tests.agent_envs:Echo", "kwargs": {"turns": 2}, "max_episode_tokens": 512}


def config(tmp_path, environment=None, *argv, **sections):
    layers = [{"data": {"use_chat_template": None}}, sections]
    if environment is not None:
        layers.append({"environment": environment})
    return parse_ppo_config([ppo_config_file(tmp_path, GRPO, "grpo", *layers), *argv])


def test_absent_section_is_none_and_keeps_the_fingerprint(tmp_path):
    plain = config(tmp_path)
    assert plain.environment is None
    with_env = config(tmp_path, ENV)
    e = with_env.environment
    assert (e.name_or_path, e.kwargs, e.max_turns, e.gamma, e.on_error, e.tools) == (
        "tests.agent_envs:Echo",
        {"turns": 2},
        4,
        1.0,
        "zero",
        [],
    )
    a, b = run_fingerprint(plain), run_fingerprint(with_env)
    assert a.digest != b.digest and not any(k.startswith("environment.") for k in a.values)
    assert b.values["environment.kwargs"] == {"turns": 2}


def test_command_line_sets_environment_fields(tmp_path):
    c = config(tmp_path, ENV, "--environment.max_turns", "3", "--environment.tools", "tests.agent_envs:add")
    assert c.environment.max_turns == 3 and c.environment.tools == ["tests.agent_envs:add"]
    only_cli = config(tmp_path, None, "--environment.tools", "tests.agent_envs:add,tests.agent_envs:divide")
    assert only_cli.environment.tools == ["tests.agent_envs:add", "tests.agent_envs:divide"]


@pytest.mark.parametrize(
    "environment, sections, message",
    [
        ({}, {}, "environment: give name_or_path (an environment class, 'package.module:Class') or tools"),
        ({"name_or_path": "tests/agent_envs.py"}, {}, "environment.name_or_path 'tests/agent_envs.py': must be"),
        ({"tools": ["add"]}, {}, "environment.tools[0] 'add': must be 'package.module:function'"),
        ({**ENV, "on_error": "skip"}, {}, "environment.on_error must be one of zero, drop, stop, got 'skip'"),
        ({**ENV, "gamma": 1.5}, {}, "environment.gamma must be in [0, 1], got 1.5"),
        ({**ENV, "step_timeout": 0}, {}, "environment.step_timeout must be in (0, 3600] seconds"),
        ({**ENV, "max_turns": 0}, {}, "environment.max_turns must be a positive number, got 0"),
        ({**ENV, "tool_call_format": "hermes2"}, {}, "tool_call_format must be one of hermes, qwen3_xml, llama3"),
        ({**ENV, "max_episode_tokens": 128}, {}, "environment.max_episode_tokens=128 leaves no room after a prompt"),
        (ENV, {"actor_rollout": {"ignore_eos": True}}, "actor_rollout.ignore_eos with an environment"),
        (ENV, {"data": {"use_chat_template": False}}, "data.use_chat_template is false, but an environment"),
        ({"tools": ["tests.agent_envs:add"], "kwargs": {"a": 1}}, {}, "environment.kwargs is set but name_or_path"),
        ({**ENV, "max_turn": 3}, {}, "environment: unknown key 'max_turn'; closest valid names: 'max_turns'"),
    ],
)
def test_wrong_values_name_the_file_and_field(tmp_path, environment, sections, message):
    with pytest.raises(UserError) as err:
        config(tmp_path, environment, **sections)
    assert message in str(err.value)
    assert "grpo_" in str(err.value)  # the file
