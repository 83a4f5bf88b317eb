"""A tiny OpenEnv environment server for tests/test_agent_openenv.py, built from openenv-core's own classes: a
counter that ends the episode after ``target`` steps (``seed % 5 + 1``, 3 without a seed) and pays the step count
then. ``uvicorn tests.openenv_counter:app`` serves it; the action "huge" answers a 3 MB observation."""

from __future__ import annotations

from openenv.core.env_server import Action, Environment, Observation, State, create_fastapi_app


class CounterAction(Action):
    message: str


class CounterObservation(Observation):
    text: str = ""
    count: int = 0


class CounterEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(step_count=0)
        self.count, self.target = 0, 3

    def reset(self, seed=None, episode_id=None, **kwargs) -> CounterObservation:
        self.count, self.target = 0, 3 if seed is None else seed % 5 + 1
        self._state = State(episode_id=episode_id, step_count=0)
        return CounterObservation(text=f"count to {self.target}")

    def step(self, action: CounterAction, timeout_s=None, **kwargs) -> CounterObservation:
        self.count += 1
        self._state.step_count = self.count
        if action.message == "huge":
            return CounterObservation(text="x" * 3_000_000)
        done = self.count >= self.target
        return CounterObservation(
            text=f"{action.message} #{self.count}",
            count=self.count,
            done=done,
            reward=float(self.count) if done else None,
        )

    @property
    def state(self) -> State:
        return self._state


app = create_fastapi_app(CounterEnvironment, CounterAction, CounterObservation, max_concurrent_envs=4)
