"""Every built-in step scorer, registered on import: the module the registry ``STEP_SCORERS`` loads
(``llm.settings.registry``). ``scoring.py`` holds the interface and the discriminative and ORM kinds; a kind in a
module of its own is imported here: the generative PRM (``generative.py``), the implicit PRM (``implicit.py``)."""

from llm.alignment.rm import generative, implicit, scoring

__all__ = ["generative", "implicit", "scoring"]
