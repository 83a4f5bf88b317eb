"""The labelling run's output directory: appended per finished problem, resumable, merged at the end.

::

    output_dir/
      label_run.json          the settings' fingerprint (llm.settings.fingerprint): a run resumes only its own
      parts/rank-R.labels.jsonl   process R's PRM records, appended per finished problem
      parts/rank-R.done.jsonl     one line per finished problem (its index and counts), written after its records
      labels.jsonl            every finished problem's records in problem order (written whole at the end)
      report.json             label statistics and cost (``report``)

A problem counts as finished once its ``done`` line is written; records of a problem without one (a kill between
the two writes) are left out of the merge, and a line cut by a kill is cut off before anything is appended after
it. So a kill loses at most the problem being labelled, and a restart with the same settings labels only the
problems not finished, under any number of processes.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
from collections import Counter
from typing import Any

from llm.utils.checkpoints import differing_fields
from llm.utils.errors import UserError

RUN_FILE = "label_run.json"
LABELS_FILE = "labels.jsonl"
REPORT_FILE = "report.json"
PARTS = "parts"


def _lines(path: str) -> list[dict]:
    """The whole JSON lines of ``path`` (a last line cut by a kill is not one)."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.endswith("\n"):
                out.append(json.loads(line))
    return out


def _cut_torn_tail(path: str) -> None:
    """Cut a last line without its newline (a write stopped by a kill), so appends start on a line of their own."""
    if not os.path.exists(path):
        return
    with open(path, "rb+") as f:
        data = f.read()
        if data and not data.endswith(b"\n"):
            f.truncate(data.rfind(b"\n") + 1)


def _append(path: str, lines: list[dict]) -> None:
    text = "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines)
    with open(path, "a", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _write_whole(path: str, text: str) -> None:
    """Written aside and renamed: the file is either the old one or the whole new one."""
    partial = path + ".partial"
    with open(partial, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)


class LabelStore:
    def __init__(self, output_dir: str) -> None:
        self.dir = output_dir
        self.parts = os.path.join(output_dir, PARTS)

    # --- start ---------------------------------------------------------------------------------------------
    def claim(self, fingerprint: dict[str, Any], overwrite: bool) -> None:
        """Once per run, before any process labels: a directory holding labels of other settings is refused (or
        emptied of them with ``overwrite``); then the settings are recorded."""
        path = os.path.join(self.dir, RUN_FILE)
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                before = json.load(f)
            changed = differing_fields(before, fingerprint)
            # a run that labelled nothing (it stopped at a bad model path, say) loses nothing to new settings
            if changed and not overwrite and self.finished():
                raise UserError(
                    f"output_dir {self.dir} holds labels made with other settings (differing: "
                    f"{', '.join(changed)}): give another output_dir, or set overwrite_output_dir true to delete "
                    "them and start afresh"
                )
            if changed:
                self.clear()
        os.makedirs(self.parts, exist_ok=True)
        _write_whole(path, json.dumps(fingerprint, indent=1, sort_keys=True))

    def clear(self) -> None:
        shutil.rmtree(self.parts, ignore_errors=True)
        for name in (LABELS_FILE, REPORT_FILE, RUN_FILE):
            if os.path.exists(os.path.join(self.dir, name)):
                os.remove(os.path.join(self.dir, name))

    # --- progress ------------------------------------------------------------------------------------------
    def finished(self) -> dict[int, dict]:
        """Problem index -> its counts, over every process's parts (of this run or an earlier one)."""
        done: dict[int, dict] = {}
        for path in sorted(glob.glob(os.path.join(self.parts, "rank-*.done.jsonl"))):
            for line in _lines(path):
                done[line["problem_index"]] = line["counts"]
        return done

    def files(self, rank: int) -> tuple[str, str]:
        return (
            os.path.join(self.parts, f"rank-{rank}.labels.jsonl"),
            os.path.join(self.parts, f"rank-{rank}.done.jsonl"),
        )

    def open(self, rank: int) -> None:
        """Make process ``rank``'s parts ready to append to."""
        for path in self.files(rank):
            _cut_torn_tail(path)

    def append(self, rank: int, problem_index: int, records: list[dict], counts: Counter) -> None:
        """One finished problem: its records, then the line that marks it finished."""
        labels, done = self.files(rank)
        _append(labels, records)
        _append(done, [{"problem_index": problem_index, "counts": dict(counts)}])

    # --- end -----------------------------------------------------------------------------------------------
    def merge(self) -> tuple[int, Counter]:
        """``labels.jsonl``: the records of every finished problem, in problem and solution order (a problem
        labelled twice, once before a kill that cut its ``done`` line, keeps one copy); returns the records
        written and the summed counts."""
        done = self.finished()
        records: dict[tuple[int, int], dict] = {}
        for path in sorted(glob.glob(os.path.join(self.parts, "rank-*.labels.jsonl"))):
            for rec in _lines(path):
                if rec["problem_index"] in done:
                    records[rec["problem_index"], rec["solution_index"]] = rec
        text = "".join(json.dumps(records[key], ensure_ascii=False) + "\n" for key in sorted(records))
        _write_whole(os.path.join(self.dir, LABELS_FILE), text)
        total: Counter = Counter()
        for counts in done.values():
            total.update(counts)
        return len(records), total

    def write_report(self, report: dict[str, Any]) -> None:
        _write_whole(os.path.join(self.dir, REPORT_FILE), json.dumps(report, indent=1, sort_keys=True) + "\n")


def report(counts: Counter, records: int, problems_total: int) -> dict[str, Any]:
    """Label statistics and cost from the summed counts of the finished problems."""
    steps = counts["steps"]
    judged = counts["judged"]
    return {
        "problems_labelled": counts["problems"],
        "problems_total": problems_total,
        "records": records,
        "solutions": counts["solutions"],
        "steps": steps,
        "positive_step_fraction": counts["positive_steps"] / steps if steps else None,
        "solutions_without_error": counts["solutions_without_error"],
        "mean_soft_label": counts["soft_sum"] / counts["soft_values"] if counts["soft_values"] else None,
        "skipped_empty": counts["skipped_empty"],
        "skipped_too_many_steps": counts["skipped_too_many_steps"],
        "skipped_placeholder": counts["skipped_placeholder"],
        "judged": judged,
        "dropped_by_consensus": counts["dropped_by_consensus"],
        "judge_agreement": (judged - counts["dropped_by_consensus"]) / judged if judged else None,
        "judge_no_answer": counts["judge_no_answer"],
        "policy_solutions_generated": counts["generated_solutions"],
        "unfinished_policy_solutions": counts["unfinished_solutions"],
        "completions": counts["generated_completions"],
        "unfinished_completions": counts["unfinished_completions"],
        "estimates": counts["estimates"],
        "completions_per_labelled_step": counts["generated_completions"] / steps if steps else None,
        "estimates_per_labelled_step": counts["estimates"] / steps if steps else None,
    }
