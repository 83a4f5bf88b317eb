"""One episode: its tokens, which of them the policy sampled, its per-turn rewards, and a record a user can read.

    prompt_ids | response_ids ..........................................................
               | turn 1 (sampled)  | env / tool message + generation prompt | turn 2 (sampled) |
    action_mask| 1 1 1 ... 1 (EOS) | 0 0 0 ............................. 0 | 1 1 ... 1 (EOS)  |
    turn_ends  |               ^k1                                                      ^k2
    turn_rewards  r1 (the environment's reward for turn 1; 0.0 for a turn that called tools)   r2

The model's tokens are appended exactly as sampled (never decoded and encoded again); everything else is what the
chat template renders for the new messages (chat.py). The response starts and ends with a model turn, but for an
episode whose environment failed before the first turn: a stand-in EOS the policy did not sample (mask 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

CUTS = ("max_turns", "max_episode_tokens", "max_response_length")  # why an episode was cut (``Episode.cut``)


@dataclass
class Task:
    """What an episode starts from: the prompt record (``record``: its fields, ``messages``, ``reference``, the
    environment's ``reset`` argument), its conversation, and its prompt ids as the data rendered them (used for an
    episode that failed before it had a prompt of its own)."""

    record: dict[str, Any]
    messages: list[dict[str, Any]]
    prompt_ids: list[int]


@dataclass
class Episode:
    index: int  # in the batch: group x samples per task + sample
    group: int  # the task's index in the batch (the episodes of one task form a group)
    task: Task
    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    action_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # the engine's, per response token (0.0 off the model's)
    turn_ends: list[int] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    turns: list[dict[str, Any]] = field(default_factory=list)  # the readable record (``record()``)
    errors: list[str] = field(default_factory=list)  # environment faults (at most one: it ends the episode)
    cut: str | None = None
    failed: bool = False
    finished: bool = False  # no more turns: done, cut or failed
    env: Any = None
    env_seconds: float = 0.0
    tool_calls: int = 0
    tool_errors: int = 0

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def model_turns(self) -> int:
        return len(self.turn_ends)

    def add_model_turn(self, ids: list[int], logprobs: list[float] | None = None) -> None:
        self.response_ids.extend(ids)
        self.action_mask.extend([1] * len(ids))
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))
        self.turn_ends.append(len(self.response_ids) - 1)
        self.turn_rewards.append(0.0)

    def add_context(self, ids: list[int]) -> None:
        """Tokens the policy did not sample: a rendered message and the next generation prompt."""
        self.response_ids.extend(ids)
        self.action_mask.extend([0] * len(ids))
        self.logprobs.extend([0.0] * len(ids))

    def end(self, cut: str | None = None) -> None:
        self.finished, self.cut = True, cut

    def fail(self, cause: str, stand_in: int) -> None:
        """An environment fault: the episode ends here; before any model turn its response is ``[stand_in]`` (EOS)
        with mask 0, so nothing of it is trained."""
        self.errors.append(f"turn {self.model_turns}: {cause}")
        self.failed, self.finished = True, True
        if not self.prompt_ids:
            self.prompt_ids = list(self.task.prompt_ids)
        if not self.response_ids:
            self.add_context([stand_in])

    def note(self, role: str, text: str, **extra: Any) -> dict[str, Any]:
        self.turns.append({"role": role, "text": text, **extra})
        return self.turns[-1]

    def record(self) -> dict[str, Any]:
        """CONTRACT's ``episodes`` entry: each turn's role and text (tool calls and results, the reward of a model
        turn the environment answered), why it was cut, the environment's faults, its seconds in the environment
        and the tools."""
        return {
            "turns": self.turns,
            "cut": self.cut,
            "errors": self.errors,
            "env_seconds": round(self.env_seconds, 6),
        }


def episode_metrics(episodes: list[Episode], dropped: int = 0) -> dict[str, float]:
    """Per step: means per episode (turns, tool calls, tool errors, environment reward) and counts (cut, failed,
    dropped)."""
    n = max(len(episodes), 1)
    out = {
        "episode/turns": sum(e.model_turns for e in episodes) / n,
        "episode/tool_calls": sum(e.tool_calls for e in episodes) / n,
        "episode/tool_errors": sum(e.tool_errors for e in episodes) / n,
        "episode/env_reward": sum(sum(e.turn_rewards) for e in episodes) / n,
        "episode/env_errors": float(sum(e.failed for e in episodes)),
        "episode/dropped": float(dropped),
        "episode/env_seconds": sum(e.env_seconds for e in episodes) / n,
        "episode/episodes": float(len(episodes)),
    }
    for cut in CUTS:
        out[f"episode/cut_{cut}"] = float(sum(e.cut == cut for e in episodes))
    return out


def merge_episode_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    """The ``episode/...`` metrics of several rounds of one step (DAPO's refill) as one step's: the counts summed,
    the means per episode weighted by each round's episodes (kept + dropped). Other keys are left out."""
    parts = [p for p in parts if "episode/turns" in p]
    if not parts:
        return {}
    counts = {"episode/env_errors", "episode/dropped", *(f"episode/cut_{cut}" for cut in CUTS)}
    # a round's episodes: its samples are not known here, but its mean turns times episodes is; the weights are the
    # round's episode counts, recorded by episode_metrics
    weights = [p["episode/episodes"] for p in parts]
    total = sum(weights) or 1.0
    out = {}
    for key in parts[0]:
        if key in counts or key == "episode/episodes":
            out[key] = float(sum(p[key] for p in parts))
        else:
            out[key] = sum(p[key] * w for p, w in zip(parts, weights)) / total
    return out
