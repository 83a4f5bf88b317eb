"""The PRM-guided search on the vLLM engine (``policy.engine: vllm``): steps end at the marker as on the Hugging Face
engine, and a greedy search gives the same trees on both; the critique maker's judge (``engine: vllm``) writes the
same critiques on both. Run in ``.venv-vllm`` by scripts/test.sh (as
tests/test_vllm_rollout.py: there a missing vLLM fails, elsewhere these tests skip saying so)."""

from __future__ import annotations

import json
import os

import pytest

from llm.alignment.ppo import generation
from llm.run_search import main
from tests.helpers import ROOT, read_jsonl, tiny_model, tokenizer

try:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import vllm  # noqa: F401

    HAVE_VLLM = True
except ImportError:
    HAVE_VLLM = False
    if os.environ.get("REQUIRE_VLLM") == "1":
        raise

pytestmark = pytest.mark.skipif(
    not HAVE_VLLM, reason="vLLM is not installed here: scripts/test.sh runs these in .venv-vllm (setup.sh --vllm)"
)


def cut(text: str, marker: str) -> str:
    at = text.find(marker)
    return text if at < 0 else text[: at + len(marker)]


def test_both_engines_stop_a_step_at_the_marker():
    from llm.alignment.ppo.vllm_rollout import VLLMRollout

    tok, model = tokenizer(), tiny_model(seed=0, head_dim=32)  # vLLM's CPU attention has no kernel for 16
    prompts = [tok(p)["input_ids"] for p in ("Tom has 3 apples.", "What is 2 + 5?\n", "hi")]
    greedy = {"num_samples": 1, "max_new_tokens": 16, "do_sample": False, "top_p": 1.0, "top_k": 0}
    free = generation.generate(model, tok, 1.0, prompts, **greedy)
    marker = tok.decode(free[0][5:6])  # a text greedy decoding writes at the sixth token of the first prompt
    assert marker.strip()
    hf = generation.generate(model, tok, 1.0, prompts, stop=marker, **greedy)
    eng = VLLMRollout(model, tok, 1.0, max_model_len=128, seed=0, sync_timeout=60, sleep=False)
    eng.load_weights(model.state_dict())
    vl = eng.generate(prompts, stop=marker, **greedy)
    texts = [[cut(tok.decode(r, skip_special_tokens=True), marker) for r in rs] for rs in (free, hf, vl)]
    assert texts[1] == texts[2] == texts[0]  # the same steps, cut at the marker's first occurrence
    assert texts[1][0].endswith(marker) and len(hf[0]) <= 6 and len(vl[0]) <= 6  # stopped there, not at 16


def test_a_greedy_search_is_the_same_on_both_engines(tmp_path):
    model_dir = tmp_path / "policy"
    tiny_model(head_dim=32).config.save_pretrained(model_dir)  # weights drawn from the seed in each run
    runs = {}
    for engine in ("hf", "vllm"):
        out = tmp_path / engine
        main([
            f"{ROOT}/llm/config/tiny/search_argument.json",
            "--policy.model_name_or_path", str(model_dir),
            "--policy.engine", engine,
            "--policy.temperature", "0",
            "--data.max_problems", "2",
            "--search.budgets", "[2]",
            "--search.methods", '["beam_search", "best_of_n"]',
            "--search.output_dir", str(out),
        ])  # fmt: skip
        runs[engine] = [{k: (v["solution"], v["scores"]) for k, v in r["results"].items()}
                        for r in read_jsonl(out / "search_results.jsonl")]  # fmt: skip
        assert json.loads((out / "search_metrics.json").read_text())["problems"] == 2
    assert runs["hf"] == runs["vllm"]


def test_a_greedy_judge_writes_the_same_critiques_on_both_engines(tmp_path):
    """The critique maker's judge (llm/run_critiques.py, issue 29 item 1): greedy on vLLM it writes what it writes on
    Hugging Face generate, prompt by prompt (the raw texts, before a verdict token or an empty first line sends a
    critique back to its template); and a run of the maker on each engine writes the same file."""
    from llm.alignment.critique.run import build_judge
    from llm.run_critiques import main as make_critiques
    from llm.settings.critiques import CritiqueArguments

    judge_dir = tmp_path / "judge"
    tiny_model(head_dim=32).config.save_pretrained(judge_dir)  # weights drawn from the seed in each run
    tokenizer().save_pretrained(judge_dir)
    prompts = ["Is the step 2 + 3 = 5 right?", "Check: 4 - 1 = 3.", "hi"]
    texts = {}
    for engine in ("hf", "vllm"):
        args = CritiqueArguments(
            judge_model_name_or_path=str(judge_dir), init_from_config=True, engine=engine, temperature=0.0,
            max_new_tokens=8, output_dir=str(tmp_path / f"unused_{engine}"),
        )  # fmt: skip
        texts[engine] = build_judge(args)(prompts, 7)
    assert len(texts["hf"]) == 3 and all(t.strip() for t in texts["hf"])
    assert texts["hf"] == texts["vllm"]
    rows = [
        {"src": ["What is 2 + 3?"], "tgt": [], "responses": ["2 + 3 = 5.", "The answer is 6."], "labels": ["+", "-"]},
        {"src": ["Tom has 4 apples and eats 1."], "tgt": [], "responses": ["4 - 1 = 3."], "labels": ["+"]},
    ]
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    made, reports = {}, {}
    for engine in ("hf", "vllm"):
        out = tmp_path / engine
        make_critiques([
            f"{ROOT}/llm/config/tiny/critiques_argument.json",
            "--data_path", str(data),
            "--judge_model_name_or_path", str(judge_dir),
            "--init_from_config", "true",
            "--engine", engine,
            "--temperature", "0",
            "--max_new_tokens", "8",
            "--output_dir", str(out),
        ])  # fmt: skip
        made[engine] = [r["critiques"] for r in read_jsonl(out / "critiques.jsonl")]
        reports[engine] = json.loads((out / "report.json").read_text())
    assert [len(c) for c in made["hf"]] == [2, 1] and made["hf"] == made["vllm"]
    assert reports["hf"] == reports["vllm"] and "template_critiques" not in reports["hf"]  # every step judged
