"""A PRM-guided search run: the problems, the policy and the PRM of a ``SearchConfig``, every method at every
budget, and what is written.

``output_dir/search_results.jsonl``: one line per problem, ``{"index", "problem", "reference", "results"}``, with
``results["<method>@<N>"]`` = the chosen solution, its answer and correctness, its step scores and score, and
the tree (every node: parent, step text, step scores of its path, score, kept, done); best-of-N's results at
each N are the first N of one draw of max(budgets) solutions (as the reward-model evaluation's best-of-N).

``output_dir/search_metrics.json``: the share of problems answered right, ``beam_search@N``, ``dvts@N`` and
best-of-N's ``best_of_n@N`` (the best-scored of N), ``weighted_vote@N`` (the answer with the highest summed
score), ``majority_vote@N`` and ``pass@N`` (``llm.alignment.rm.evaluation``), each at every budget N; and the
step counts (``steps``, ``steps_capped``: steps cut at ``max_step_tokens`` without the marker).
"""

from __future__ import annotations

import functools
import json
import logging
import os

import torch
from transformers import AutoModelForCausalLM

from llm.alignment.ppo.rewards.rule import import_function
from llm.alignment.rm.evaluation import AGGREGATIONS, Candidate, best_of_n_metrics
from llm.alignment.rm.scoring import DTYPES, problem_text
from llm.alignment.search import tree
from llm.alignment.search.policy import PRMScore, StepPolicy
from llm.data.encoding import render_prompt, resolve_chat_template
from llm.data.readers import PromptRecord, load_dataset_records
from llm.settings.registry import STEP_SCORERS
from llm.settings.search import SearchConfig
from llm.utils.checkpoints import write_json_atomic
from llm.utils.errors import UserError
from llm.utils.modeling import load_model, load_tokenizer, model_stop_ids

logger = logging.getLogger(__name__)
RESULTS, METRICS = "search_results.jsonl", "search_metrics.json"


def load_problems(c: SearchConfig) -> list[PromptRecord]:
    d = c.data
    records = list(load_dataset_records(d.problems_path, "prompt", seed=c.search.seed, map_keys=d.map_keys))
    records = records[: d.max_problems] if d.max_problems else records
    missing = next((r for r in records if r.reference is None), None)
    if missing is not None:
        raise UserError(
            f"{missing.source}: record {missing.index}: no reference answer (tgt / answer): the search's accuracy "
            "needs one for every problem"
        )
    return records


def build_policy(c: SearchConfig, tok, prompt_ids: list[list[int]]) -> StepPolicy:
    """The policy model on the configured engine, as ``expand`` (``StepPolicy``)."""
    p = c.policy
    model = load_model(
        AutoModelForCausalLM,
        p.model_name_or_path,
        init_from_config=p.init_from_config,
        seed=c.search.seed,
        dtype=DTYPES[p.dtype],
        pad_token_id=tok.pad_token_id,
    )
    if torch.cuda.is_available():
        model = model.to("cuda")
    model.eval()
    stop_ids = model_stop_ids(model, tok)  # the tokenizer's EOS and the model's generation-config EOS ids
    sampling = {"do_sample": p.temperature > 0, "top_p": p.top_p, "top_k": 0, "stop_ids": stop_ids}
    if p.engine == "vllm":
        from llm.alignment.ppo.vllm_rollout import VLLMRollout

        engine = VLLMRollout(
            model,
            tok,
            p.temperature or 1.0,
            max_model_len=p.max_prompt_length + p.max_new_tokens,
            seed=c.search.seed,
            sync_timeout=600.0,
            gpu_memory_utilization=p.vllm_gpu_memory_utilization,
            max_num_seqs=p.batch_size,
            sleep=False,
            where="the search's vLLM engine",
        )
        engine.load_weights(model.state_dict())  # the engine starts on dummy weights
        generate = functools.partial(engine.generate, **sampling)
    else:
        from llm.alignment.ppo.generation import generate as hf_generate

        generate = functools.partial(hf_generate, model, tok, p.temperature or 1.0, **sampling)
    return StepPolicy(
        generate,
        tok,
        prompt_ids,
        c.search.step_marker,
        max_step_tokens=p.max_step_tokens,
        max_new_tokens=p.max_new_tokens,
        batch_size=p.batch_size,
        stop_ids=stop_ids,
    )


def prompt_ids_of(c: SearchConfig, records: list[PromptRecord], tok) -> list[list[int]]:
    """Each problem's prompt ids (the chat template per ``data.use_chat_template``); too long stops the run."""
    chat = resolve_chat_template(c.data.use_chat_template, tok, "data.use_chat_template")
    out = []
    for rec in records:
        ids = render_prompt(rec.prompt, tok, chat)
        if len(ids) > c.policy.max_prompt_length:
            raise UserError(
                f"{rec.source}: record {rec.index}: the prompt has {len(ids)} tokens, more than "
                f"policy.max_prompt_length={c.policy.max_prompt_length}: raise it or shorten the prompt"
            )
        out.append(ids)
    return out


class Judge:
    """A solution's final answer (``search.answer``) and whether it equals the reference's."""

    def __init__(self, spec: str, references: list[str]) -> None:
        self.fn = import_function(spec, "search.answer")
        self.spec = spec
        self.expected = [self.answer(r) or r.strip() for r in references]

    def answer(self, text: str) -> str | None:
        try:
            found = self.fn(text)
        except Exception as err:  # noqa: BLE001 - the user's function: its failure is named, not a traceback
            raise UserError(f"search.answer {self.spec} raised {type(err).__name__}: {err} on {text[:80]!r}") from None
        return None if found is None else str(found)

    def correct(self, problem: int, text: str) -> tuple[str | None, bool]:
        found = self.answer(text)
        return found, found is not None and found == self.expected[problem]


def tree_json(t: tree.Tree, judge: Judge) -> dict:
    chosen = t.nodes[t.chosen]
    text = "".join(t.path(t.chosen))
    answer, right = judge.correct(t.problem, text)
    return {
        "solution": text,
        "answer": answer,
        "correct": right,
        "scores": chosen.scores,
        "score": chosen.value,
        "candidates": t.candidates,
        "tree": [
            {
                "id": n.id,
                "parent": n.parent,
                "step": n.text,
                "scores": n.scores,
                "score": n.value,
                "kept": n.kept,
                "done": n.done,
            }
            for n in t.nodes
        ],
    }


def run_search(c: SearchConfig) -> dict[str, float]:
    """Every method of ``c.search`` at every budget on the problems; the outputs written; the metrics returned."""
    s = c.search
    records = load_problems(c)
    judge = Judge(s.answer, [r.reference for r in records])
    tok = load_tokenizer(c.policy.tokenizer_name_or_path or c.policy.model_name_or_path)
    policy = build_policy(c, tok, prompt_ids_of(c, records, tok))
    scorer = STEP_SCORERS[c.prm.kind].from_settings(c.prm, s.seed)
    score = PRMScore(scorer, [problem_text(r.prompt) for r in records], s.step_marker)
    aggregate = AGGREGATIONS[s.aggregation]
    problems = list(range(len(records)))
    results: list[dict] = [{} for _ in records]
    metrics: dict[str, float] = {"problems": float(len(records))}
    for method in s.methods:
        if method == "best_of_n":
            metrics.update(best_of_n_results(c, problems, policy, score, judge, results))
            continue
        search = tree.beam_search if method == "beam_search" else tree.dvts
        for n in s.budgets:
            logger.info("%s with budget %d over %d problems", method, n, len(problems))
            trees = search(problems, policy.expand, score, aggregate, n, s.beam_width, s.max_steps, s.seed)
            for t in trees:
                results[t.problem][f"{method}@{n}"] = tree_json(t, judge)
            metrics[f"{method}@{n}"] = sum(r[f"{method}@{n}"]["correct"] for r in results) / len(records)
    metrics.update(steps=float(policy.counts.steps), steps_capped=float(policy.counts.capped))
    if policy.counts.capped:
        logger.warning(
            "search.step_marker %r did not occur in %d of %d steps the policy wrote: each was cut at "
            "policy.max_step_tokens=%d tokens (a step cap). If the policy never writes the marker, set step_marker "
            "to the text between its steps",
            s.step_marker,
            policy.counts.capped,
            policy.counts.steps,
            c.policy.max_step_tokens,
        )
    write_outputs(s.output_dir, records, results, metrics)
    return metrics


def best_of_n_results(
    c: SearchConfig, problems: list[int], policy: StepPolicy, score: PRMScore, judge: Judge, results: list[dict]
) -> dict[str, float]:
    """One draw of max(budgets) whole solutions per problem; the metrics at every budget N over its first N."""
    s = c.search
    most = max(s.budgets)
    logger.info("best_of_n: %d solutions for each of %d problems", most, len(problems))
    trees = tree.best_of_n(problems, policy.expand, score, AGGREGATIONS[s.aggregation], most, s.seed)
    groups: dict[str, list[Candidate]] = {}
    for t in trees:
        cands = []
        for i in t.candidates:
            answer, right = judge.correct(t.problem, t.nodes[i].text)
            cands.append(Candidate(t.nodes[i].scores, answer or "", right))
        groups[str(t.problem)] = cands
        for n in s.budgets:
            first = t.candidates[:n]
            t.chosen = t.choose(first)
            out = tree_json(t, judge)
            out["candidates"], out["tree"] = first, out["tree"][:n]
            results[t.problem][f"best_of_n@{n}"] = out
    bon = best_of_n_metrics(groups, [s.aggregation], None, ns=s.budgets)
    rename = {f"bon_{s.aggregation}@": "best_of_n@", f"weighted_vote_{s.aggregation}@": "weighted_vote@"}
    out = {}
    for key, value in bon.items():
        for old, new in rename.items():
            key = key.replace(old, new)
        if "@" in key:
            out[key] = value
    return out


def write_outputs(output_dir: str, records: list[PromptRecord], results: list[dict], metrics: dict) -> None:
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, RESULTS)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        for i, (rec, res) in enumerate(zip(records, results)):
            line = {
                "index": i,
                "problem": problem_text(rec.prompt).rstrip("\n"),
                "reference": rec.reference,
                "results": res,
            }
            f.write(json.dumps(line, ensure_ascii=False) + "\n")
    os.replace(path + ".tmp", path)
    write_json_atomic(os.path.join(output_dir, METRICS), metrics)
    logger.info("search: %s", ", ".join(f"{k} {v:.3f}" for k, v in metrics.items() if "@" in k))
