"""PPO/GRPO samples a user can read: every ``logging_steps`` step, the first ``training.log_samples`` samples
(prompt, decoded response, score, reward, KL, ...; a multi-turn episode's environment reward and its record,
``Samples.episodes``) go to ``output_dir/samples.jsonl`` and TensorBoard text."""

from __future__ import annotations

import json
import os

from llm.alignment.ppo.interfaces import Experience

SAMPLES_FILE = "samples.jsonl"


def sample_rows(exp: Experience, step: int, limit: int) -> list[dict]:
    """The first ``limit`` samples of a step as JSON-able rows: what the policy was asked and answered and what
    it was paid, so a run can be read, not only its means (``score`` as the reward returned it, before any
    penalty, normalisation or clipping; ``reward`` the summed per-token reward the advantages saw)."""
    s, samples = exp.scored, exp.scored.samples
    rows = []
    for i in range(min(limit, len(samples))):
        row = {
            "step": step,
            "sample": i,
            "prompt": samples.prompts[i],
            "response": samples.responses[i],
            "response_ids": samples.response_ids[i],
            "response_length": len(samples.response_ids[i]),
            "ended": bool(samples.ended[i]),
            "score": s.raw_scores[i].item(),
            "score_shaped": s.scores[i].item(),
            "reward": exp.rewards[i].sum().item(),
            "kl": s.kl[i].sum().item(),
        }
        if s.dense is not None:
            row["step_reward"] = s.dense[i].sum().item()
        if s.components is not None:  # several rewards: each one's, unweighted (score is their weighted sum)
            row["rewards"] = {name: values[i].item() for name, values in s.components.items()}
        if s.env_rewards is not None:  # a multi-turn episode: its environment rewards, and the episode itself
            row["env_reward"] = (s.env_rewards[i] * s.mask[i]).sum().item()
        if samples.episodes is not None:
            row["episode"] = samples.episodes[i]
        if samples.references[i] is not None:
            row["reference"] = samples.references[i]
        rows.append(row)
    return rows


def samples_markdown(rows: list[dict]) -> str:
    """The rows as TensorBoard text (markdown): texts in indented code blocks, so nothing in them renders."""

    def block(text: str) -> str:
        return "\n".join("    " + line for line in (text or "(empty)").splitlines() or [""])

    parts = []
    for r in rows:
        head = (
            f"**sample {r['sample']}**: score {r['score']:.4g}, reward {r['reward']:.4g}, "
            f"{r['response_length']} tokens, {'ended with EOS' if r['ended'] else 'no EOS'}"
        )
        parts.append(f"{head}\n\nprompt:\n\n{block(r['prompt'])}\n\nresponse:\n\n{block(r['response'])}")
        if "reference" in r:
            parts[-1] += f"\n\nreference:\n\n{block(r['reference'])}"
        for turn in r.get("episode", {}).get("turns", []):
            parts[-1] += f"\n\n{turn.get('role', '?')}:\n\n{block(str(turn.get('text', '')))}"
    return "\n\n---\n\n".join(parts)


def sample_step(line: str) -> float:
    """The step of a ``samples.jsonl`` line; a line that is not one of ours counts as after every step."""
    try:
        return float(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return float("inf")


def append_samples(path: str, rows: list[dict]) -> None:
    """``rows`` as JSON lines at the end of ``path`` (its folder made when missing)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


def trim_samples(path: str, step: int) -> None:
    """Before training: ``path`` keeps only the lines of steps up to ``step`` (none for a fresh run, those up to the
    checkpoint when resuming), so a run that trains on after a stop, or afresh in the same output_dir, never
    lists a step twice."""
    if not os.path.isfile(path):
        return
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    kept = [line for line in lines if sample_step(line) <= step]
    if len(kept) != len(lines):
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(kept)
