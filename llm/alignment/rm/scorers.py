"""Every step scorer (``STEP_SCORERS``, ``prm.kind``): importing this module registers them all; the registry
imports it on its first lookup. The interface and the discriminative and ORM scorers: ``scoring.py``; the
generative PRM: ``generative.py``."""

from llm.alignment.rm import generative, scoring

__all__ = ["generative", "scoring"]
