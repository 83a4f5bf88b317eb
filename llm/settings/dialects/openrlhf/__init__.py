"""OpenLLaMA2 / OpenRLHF launch scripts read as configs (``script.py`` finds the command, ``launch.py`` translates it,
the flag table: ``flags.py``)."""

from llm.settings.dialects.openrlhf.launch import LAUNCH_SCRIPT_EXTENSIONS, read_launch_script

__all__ = ["LAUNCH_SCRIPT_EXTENSIONS", "read_launch_script"]
