"""GRPO step 0: our rollout and TRL's current ``GRPOTrainer`` sample the same completions from the same prompts.

The GRPO benchmark against TRL (bench/bench_grpo.py) once gave TRL the bare prompt text while ours rendered it with
a newline after it (``llm.data.encoding.plain_prompt_text``): on SmolLM2 TRL's completions then stopped at EOS far
more often than ours (bench/README.md, "GRPO: completion lengths at step 0"). Here, on a tiny Llama whose EOS is
likely enough that some completions stop and some reach the cap, our step-0 rollout (bench/bench_grpo_eos.py's
``run_ours``: the config parsed, prompts, actor and sampling settings as a run builds them) and TRL's own
``_tokenize_prompts`` + ``_generate_single_turn`` (in a subprocess with TRL's current release first on the path),
given the texts bench_grpo.py gives each side and the same torch seed, must see the same prompt ids, stop on the
same ids and return token-for-token the same completions.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from bench.bench_grpo import prompt_texts, trl_prompt_texts
from bench.bench_grpo_eos import ours_config, run_ours
from tests.helpers import ROOT, tiny_model, tokenizer


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


def test_grpo_step0_completions_equal_trls(tmp_path):
    path = trl_current()
    if path is None:
        if os.environ.get("CI") or os.environ.get("REQUIRE_TRL_CURRENT"):
            pytest.fail("TRL's current release is not installed in .trl-current: run bash scripts/setup.sh")
        pytest.skip("TRL's current release is not installed in .trl-current (bash scripts/setup.sh installs it)")
    model_dir = str(tmp_path / "model")
    eos = eos_prone_model(model_dir)
    n, settings = 4, {"samples": 4, "new_tokens": 12, "temperature": 1.0}
    ours = run_ours(
        ours_config(model_dir, [{"src": t} for t in prompt_texts(n)], str(tmp_path), chat=False, seed=3, **settings)
    )
    spec = {
        "model_dir": model_dir,
        "texts": trl_prompt_texts(n),
        "seed": 3,
        "generator_seed": ours["seed"],
        "workdir": str(tmp_path),
        **settings,
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": ROOT, "TRL_CURRENT_PATH": path, "OMP_NUM_THREADS": "1"}
    script = os.path.join(ROOT, "bench", "bench_grpo_eos.py")
    done = subprocess.run(  # noqa: PLW1510 - the return code is asserted below, with its stderr
        [sys.executable, script, "--trl-worker", str(tmp_path / "spec.json"), str(tmp_path / "trl.json")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = json.loads((tmp_path / "trl.json").read_text())
    assert theirs["trl_version"] >= "1.16"
    assert theirs["prompt_ids"] == ours["prompt_ids"]
    assert theirs["stop_ids"] == ours["stop_ids"] == [eos]
    lengths = [len(c) for c in ours["completions"]]
    assert [len(c) for c in theirs["completions"]] == lengths
    assert theirs["completions"] == ours["completions"]
    # the batch exercises both ends: completions cut after EOS and completions at the cap
    ended = [c[-1] == eos for c in ours["completions"]]
    assert any(ended) and not all(ended), lengths
    assert all(n == settings["new_tokens"] for n, e in zip(lengths, ended) if not e)
