"""OpenLLaMA2 / OpenRLHF launch scripts read as configs (``launch.py``; the flag table: ``flags.py``)."""

from llm.settings.dialects.openrlhf.launch import LAUNCH_SCRIPT_EXTENSIONS, read_launch_script

__all__ = ["LAUNCH_SCRIPT_EXTENSIONS", "read_launch_script"]
