"""Reading a config file, the first step of the one configuration path (``llm.settings.load``).

Three kinds of file: JSON (``.json``), YAML (``.yaml`` / ``.yml``, read as hydra reads MindSpeed-LLM's files:
``1e-7`` is a number, dates stay text, a key given twice is an error) and an OpenLLaMA2 / OpenRLHF launch
script (``.sh``: its ``deepspeed train_x.py --flag value ...`` command, translated by
``llm.settings.dialects.openrlhf``; over 1 MB refused unread). A FIFO, device or directory is refused before
``open()`` could wait on it. A file is looked up from the working directory, then the repository
root, so both ``python llm/run_x.py llm/config/...`` and ``cd llm && python run_x.py config/...`` find it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from llm.settings.yaml_files import load_yaml
from llm.utils.errors import UserError
from llm.utils.paths import nearest_hint, read_text_file, resolve_input_path, tried

JSON_EXTENSIONS = (".json",)
LAUNCH_SCRIPT_EXTENSIONS = (".sh",)  # an OpenLLaMA2 / OpenRLHF launch script (dialects/openrlhf/)
YAML_EXTENSIONS = (".yaml", ".yml")


@dataclass
class ConfigFile:
    """What a config file holds: ``raw`` (the object, in whatever layout the file uses), ``path`` as given
    (for messages), ``found`` (the file opened) and ``notes`` (lines for the log from a dialect)."""

    raw: dict
    path: str
    found: str
    notes: list[str] = field(default_factory=list)


def read_config_file(path: str, script: str, extensions: tuple[str, ...], usage: str, shape: str) -> ConfigFile:
    """The object in ``path``. ``script`` names the run script reading it (sft, rm, dpo, ppo: a launch script
    must run the matching OpenRLHF script); ``extensions`` are the kinds it accepts; ``usage`` is the line
    shown when the argument is of another kind; ``shape`` says what the file must hold."""
    if not path.endswith(extensions):
        raise UserError(usage)
    notes: list[str] = []
    if path.endswith(LAUNCH_SCRIPT_EXTENSIONS):
        from llm.settings.dialects.openrlhf import read_launch_script  # read only when a launch script is given

        return ConfigFile(read_launch_script(path, script, notes), path, path, notes)
    found = resolve_input_path(path)
    if found is None:
        raise UserError(f"{path}: no such file (looked in: {tried(path)}){nearest_hint(path)}")
    text = read_text_file(found, path)  # a FIFO or device is refused before open() would wait on it
    if path.endswith(JSON_EXTENSIONS):
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as err:
            raise UserError(f"{path}: not valid JSON ({err.msg} at line {err.lineno}, column {err.colno})") from None
    else:
        raw = load_yaml(text, path)
    if not isinstance(raw, dict):
        raise UserError(f"{path}: must hold {shape}")
    return ConfigFile(raw, path, found, notes)
