"""GRPO step 0: our rollout and TRL's current ``GRPOTrainer`` sample the same completions from the same prompts.

The GRPO benchmark against TRL (bench/bench_grpo.py) once gave TRL the bare prompt text while ours rendered it with
a newline after it (``llm.data.encoding.plain_prompt_text``): on SmolLM2 TRL's completions then stopped at EOS far
more often than ours (bench/README.md, "GRPO: completion lengths at step 0"). Here, on a tiny Llama whose EOS is
likely enough that some completions stop and some reach the cap, our step-0 rollout (bench/bench_grpo_eos.py's
``run_ours``: the config parsed, prompts, actor and sampling settings as a run builds them) and TRL's own
``_tokenize_prompts`` + ``_generate_single_turn`` (in a subprocess with TRL's current release first on the path),
given the texts bench_grpo.py gives each side (and, with the chat template, the arithmetic task's conversations) and
the same torch seed, must see the same prompt ids, stop on the same ids and return token-for-token the same
completions; also on a model whose generation_config.json adds a second EOS id (TRL stops on it too).
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from bench.bench_grpo import prompt_texts, trl_prompt_texts
from bench.bench_grpo_eos import ours_config, run_ours
from tests.helpers import ROOT, SECOND_EOS, tiny_model, tokenizer, two_eos_model


def trl_current() -> str | None:
    path = os.environ.get("TRL_CURRENT_PATH") or os.path.join(ROOT, ".trl-current")
    return path if os.path.isdir(os.path.join(path, "trl")) else None


def eos_prone_model(directory: str) -> int:
    """A seeded tiny Llama (with the bundled tokenizer) whose EOS row of the LM head is scaled up, saved to
    ``directory``; returns the EOS id."""
    tok = tokenizer()
    model = tiny_model(attn="sdpa", vocab=len(tok), eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    with torch.no_grad():
        model.lm_head.weight[tok.eos_token_id] *= 40.0
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return tok.eos_token_id


@pytest.fixture(scope="module")
def trl_path():
    path = trl_current()
    if path is None:
        if os.environ.get("CI") or os.environ.get("REQUIRE_TRL_CURRENT"):
            pytest.fail("TRL's current release is not installed in .trl-current: run bash scripts/setup.sh")
        pytest.skip("TRL's current release is not installed in .trl-current (bash scripts/setup.sh installs it)")
    return path


def test_grpo_step0_completions_equal_trls(tmp_path, trl_path):
    """Plain text (bench_grpo.py's prompts, each side's text as the benchmark gives it) and the chat template
    (the arithmetic task's prompts as conversations), both in one TRL process."""
    model_dir, two_eos_dir = str(tmp_path / "model"), str(tmp_path / "two_eos_model")
    eos = eos_prone_model(model_dir)
    assert two_eos_model(two_eos_dir) == eos
    n, settings = 4, {"samples": 4, "new_tokens": 12, "temperature": 1.0}
    with open(os.path.join(ROOT, "llm/data/sample_arith/arith_train.jsonl"), encoding="utf-8") as f:
        arith = [json.loads(line)["src"] for line in f][:n]
    plain = ([{"src": t} for t in prompt_texts(n)], False, trl_prompt_texts(n))
    cases = {  # name: (model, our records, use_chat_template, TRL's prompts)
        "plain": (model_dir, *plain),
        "chat": (model_dir, [{"src": t} for t in arith], True, [[{"role": "user", "content": t}] for t in arith]),
        # generation_config.json lists a second EOS id (as Qwen2.5-Instruct's): both sides stop at either
        "two_eos": (two_eos_dir, *plain),
    }
    stops = {"plain": [eos], "chat": [eos], "two_eos": [eos, SECOND_EOS]}
    ours, specs = {}, []
    for name, (model, rows, chat, texts) in cases.items():
        (tmp_path / name).mkdir()
        ours[name] = run_ours(ours_config(model, rows, str(tmp_path / name), chat=chat, seed=3, **settings))
        specs.append(
            {
                "model_dir": model,
                "texts": texts,
                "seed": 3,
                "generator_seed": ours[name]["seed"],
                "workdir": str(tmp_path / name),
                **settings,
            }
        )
    (tmp_path / "spec.json").write_text(json.dumps(specs))
    env = {**os.environ, "PYTHONPATH": ROOT, "TRL_CURRENT_PATH": trl_path, "OMP_NUM_THREADS": "1"}
    script = os.path.join(ROOT, "bench", "bench_grpo_eos.py")
    done = subprocess.run(  # noqa: PLW1510 - the return code is asserted below, with its stderr
        [sys.executable, script, "--trl-worker", str(tmp_path / "spec.json"), str(tmp_path / "trl.json")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for name, theirs in zip(cases, json.loads((tmp_path / "trl.json").read_text())):
        mine = ours[name]
        assert theirs["trl_version"] >= "1.16"
        assert theirs["prompt_ids"] == mine["prompt_ids"], name
        assert theirs["stop_ids"] == mine["stop_ids"] == stops[name], name
        lengths = [len(c) for c in mine["completions"]]
        assert [len(c) for c in theirs["completions"]] == lengths, name
        assert theirs["completions"] == mine["completions"], name
        # the batch exercises both ends: completions cut after EOS and completions at the cap
        ended = [c[-1] in stops[name] for c in mine["completions"]]
        assert any(ended) and not all(ended), (name, lengths)
        assert all(k == settings["new_tokens"] for k, e in zip(lengths, ended) if not e), name
