"""Environments backed by other projects, behind the same protocol as the bundled ones (``envs/``):

- ``reasoning_gym.py``: ``ReasoningGymTask``, a reasoning-gym dataset's procedurally generated tasks scored by
  the dataset's own ``score_answer`` (``pip install reasoning-gym``);
- ``openenv.py``: ``OpenEnvEnvironment``, an OpenEnv environment server (``pip install openenv-core``) reached at a
  URL or started here, its answers checked as untrusted input.

Each imports its package when an environment is built, so this package imports without them.
"""
