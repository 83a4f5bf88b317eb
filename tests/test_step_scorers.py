"""The step-score interface (llm/alignment/rm/scoring.py) for every registered kind of process reward model: each
kind against a plain forward of its model (the oracle, computed here), built from the same settings a search
config gives, and PPO's PRM reward reading its step scores through it."""

from __future__ import annotations

import json
import math

import pytest
import torch

from llm.alignment.ppo.interfaces import Samples
from llm.alignment.ppo.rewards import PRMReward
from llm.alignment.rm.generative import GenerativePRM
from llm.alignment.rm.implicit import ImplicitPRM
from llm.alignment.rm.scoring import DiscriminativePRM, OutcomeScorer
from llm.settings.registry import STEP_SCORERS
from llm.settings.search import PRMSection
from tests.helpers import ROOT, tokenizer

PROBLEMS = ["Tom has 3 bags of 4 apples. How many apples?\n", "What is 2 + 5?\n"]
STEPS = [["3 * 4 = 12 apples.", "The answer is 12."], ["2 + 5 = 8.", "So 8.", "The answer is 8."]]
MODELS = {
    "discriminative": "llm/assets/tiny-prm",
    "orm": "llm/assets/tiny-llama",
    "generative": "llm/assets/tiny-prm",
    "implicit": "llm/assets/tiny-llama",
}
CRITIQUE_TOKENS = 3  # generative: the most critique tokens per step (a random model writes no verdict before)
IMPLICIT_BETA = 0.5


def implicit_prm_dir(root) -> str:
    """A saved implicit PRM: the tiny model of seed 1, its reference of seed 2, implicit_prm.json."""
    from transformers import AutoModelForCausalLM

    from llm.alignment.rm.implicit import IMPLICIT_FILE
    from llm.utils.modeling import load_model

    for seed, where in ((1, root), (2, root / "reference")):
        model = load_model(AutoModelForCausalLM, f"{ROOT}/{MODELS['implicit']}", init_from_config=True, seed=seed)
        model.save_pretrained(where)
    (root / IMPLICIT_FILE).write_text(json.dumps({"beta": IMPLICIT_BETA, "reference": "reference"}))
    return str(root)


def settings(kind: str, root=None) -> PRMSection:
    return PRMSection(
        kind=kind,
        model_name_or_path=implicit_prm_dir(root) if kind == "implicit" else f"{ROOT}/{MODELS[kind]}",
        tokenizer_name_or_path=f"{ROOT}/llm/assets/tiny_tokenizer",
        init_from_config=kind != "implicit",
        micro_batch_size=2,  # several forwards: the records must come back to their solutions
        max_critique_tokens=CRITIQUE_TOKENS,
    )


def oracle(kind: str, scorer, problem: str, steps: list[str]) -> list[float]:
    """A plain forward of the whole sequence (stock attention, no packing, no readout shortcut)."""
    tok, model = scorer.tokenizer, scorer.model
    p = tok(problem)["input_ids"]
    if kind == "discriminative":
        # Math-Shepherd's input: every step followed by " ки", joined by newlines
        ids = p + tok(" ки\n".join(steps) + " ки", add_special_tokens=False)["input_ids"]
        ph, plus, minus = (tok.convert_tokens_to_ids(t) for t in ("ки", "+", "-"))
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0]
        marks = [i for i, t in enumerate(ids) if t == ph]
        return torch.softmax(logits[marks][:, [plus, minus]], -1)[:, 0].tolist()
    if kind == "generative":
        # for each step: its text and a newline, then greedy tokens until "+" / "-" or the cap, read there; the
        # likelier verdict and a newline follow (whole-sequence forwards, no KV cache)
        plus, minus = tok.convert_tokens_to_ids("+"), tok.convert_tokens_to_ids("-")
        ids, out = list(p), []
        for step in steps:
            ids += tok(step + "\n", add_special_tokens=False)["input_ids"]
            for written in range(CRITIQUE_TOKENS + 1):
                with torch.no_grad():
                    logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
                token = int(logits.argmax())
                if token in (plus, minus) or written == CRITIQUE_TOKENS:
                    break
                ids.append(token)
            out.append(torch.softmax(logits[[plus, minus]], -1)[0].item())
            ids += [plus if logits[plus] >= logits[minus] else minus] + tok("\n", add_special_tokens=False)["input_ids"]
        return out
    if kind == "implicit":  # sigmoid of beta x the log-ratio to the reference summed up to each step's end
        ends, ids = [], list(p)
        for step in steps:  # each step followed by a newline, tokenised on its own
            ids += tok(step + "\n", add_special_tokens=False)["input_ids"]
            ends.append(len(ids))
        with torch.no_grad():
            ratio = [
                torch.log_softmax(m(input_ids=torch.tensor([ids])).logits[0].double(), -1)
                for m in (scorer.model, scorer.reference)
            ]
        token = [float(ratio[0][t - 1, ids[t]] - ratio[1][t - 1, ids[t]]) for t in range(len(ids))]
        return [1 / (1 + math.exp(-IMPLICIT_BETA * sum(token[len(p) : e]))) for e in ends]
    out = []
    for k in range(len(steps)):  # the ORM's logit of the solution cut after step k, at its last token
        ids = p + tok("\n".join(steps[: k + 1]), add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logit = model(input_ids=torch.tensor([ids])).logits[0, 0].item()  # pooled at the last token
        out.append(1 / (1 + math.exp(-logit)))
    return out


@pytest.fixture(scope="module", params=sorted(MODELS))
def scorer(request, tmp_path_factory):
    built = STEP_SCORERS[request.param].from_settings(settings(request.param, tmp_path_factory.mktemp("m")), seed=3)
    return request.param, built


def test_every_registered_kind_is_tested_here():
    assert sorted(STEP_SCORERS) == sorted(MODELS)
    assert STEP_SCORERS["discriminative"] is DiscriminativePRM and STEP_SCORERS["orm"] is OutcomeScorer
    assert STEP_SCORERS["generative"] is GenerativePRM
    assert STEP_SCORERS["implicit"] is ImplicitPRM


def test_step_scores_equal_a_plain_forward_of_the_model(scorer):
    kind, s = scorer
    got = s.score_steps(PROBLEMS, STEPS)
    assert [len(g) for g in got] == [2, 3]
    for problem, steps, scores in zip(PROBLEMS, STEPS, got):
        assert scores == pytest.approx(oracle(kind, s, problem, steps), abs=1e-5)
        assert all(0 < x < 1 for x in scores)
    # random weights still give different scores to different steps: the comparison above is not of constants
    assert len({round(x, 6) for g in got for x in g}) == 5


def test_a_step_is_scored_from_the_problem_and_the_steps_before_it(scorer):
    _, s = scorer
    whole = s.score_steps(PROBLEMS, STEPS)
    cut = s.score_steps(PROBLEMS, [steps[:1] for steps in STEPS])
    assert [c[0] for c in cut] == pytest.approx([w[0] for w in whole], abs=1e-6)
    other = s.score_steps(["Another problem?\n"], [STEPS[0]])  # the problem is read
    assert other[0][0] != pytest.approx(whole[0][0], abs=1e-4)


def test_an_empty_solution_has_no_step_scores_and_a_mismatch_is_refused(scorer):
    _, s = scorer
    assert s.score_steps(PROBLEMS, [[], STEPS[1]])[0] == []
    with pytest.raises(ValueError, match="2 problems and 1 solutions"):
        s.score_steps(PROBLEMS, STEPS[:1])


def test_ppo_prm_reward_reads_its_step_scores_through_the_interface():
    s = DiscriminativePRM.from_settings(settings("discriminative"), seed=3)
    tok = tokenizer()
    plus, minus, ph = (tok.convert_tokens_to_ids(t) for t in ("+", "-", "ки"))
    responses = ["\n".join(STEPS[0]), "\n\n".join(STEPS[1]) + "\n"]  # empty steps are dropped
    samples = Samples(
        [tok(p)["input_ids"] for p in PROBLEMS],
        [tok(r, add_special_tokens=False)["input_ids"] for r in responses],
        PROBLEMS,
        responses,
        [None, None],
        torch.tensor([True, True]),
    )
    reward = PRMReward(s.model, tok, tok, "\n", "ки", (plus, minus), ph, "min", 4)
    got, spans = reward.step_scores(samples)
    for g, expected in zip(got, s.score_steps(PROBLEMS, STEPS), strict=True):
        assert g == pytest.approx(expected, abs=1e-6)
    assert [len(x) for x in spans] == [2, 3]
    assert reward.score(samples).scores.tolist() == pytest.approx([min(g) for g in got], abs=1e-6)


def test_the_evaluation_reads_a_step_scorer_as_it_reads_the_prm_trainer(tmp_path):
    """An eval-only run of the tiny PRM on ProcessBench solutions and best-of-N candidates, and the same records
    scored by the discriminative step scorer over the same weights: the same step scores, the same metrics
    (``step_score_metrics``, the evaluation of any kind)."""
    from llm.alignment.rm.evaluation import step_score_metrics
    from llm.alignment.rm.scoring import score_records
    from llm.data.readers import load_dataset_records
    from llm.run_reward import main
    from tests.helpers import read_json, read_jsonl
    from tests.test_run_reward import SAMPLE, config

    lines = []
    for name, n in (("processbench_dev.jsonl", 16), ("bon_dev.jsonl", 16)):
        with open(f"{SAMPLE}/{name}", encoding="utf-8") as f:
            lines += [next(f) for _ in range(n)]
    dev = tmp_path / "dev.jsonl"
    dev.write_text("".join(lines))
    main([config(tmp_path, dev_dataset_path=str(dev), do_train=False, do_eval=True, prm_threshold_subset="short")])
    rows = read_jsonl(tmp_path / "out" / "eval_scores.jsonl")
    results = read_json(tmp_path / "out" / "eval_results.json")

    s = DiscriminativePRM.from_settings(settings("discriminative"), seed=42)  # the config's seed: its weights
    records = list(load_dataset_records(str(dev), "prm"))
    scores = score_records(s, records, batch_size=10)
    assert len(rows) == len(records) == 32
    for row in rows:
        assert scores[row["index"]] == pytest.approx(row["step_scores"], abs=1e-5)
    metrics = step_score_metrics(scores, records, 0.5, "short", ["min", "product", "last", "mean"], seed=42)
    assert "processbench_f1" in metrics and "bon_min@2" in metrics and "processbench_best_threshold" in metrics
    for key, value in metrics.items():
        assert results[f"eval_{key}"] == pytest.approx(value, abs=1e-6), key
