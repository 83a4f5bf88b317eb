"""PPO sample logging (``training.log_samples``): samples.jsonl and TensorBoard text on the tiny config."""

import json
import os

import pytest

from llm.run_ppo import main
from llm.settings.fingerprint import run_fingerprint
from llm.settings.load import parse_ppo_config
from llm.utils import run_files
from llm.utils.errors import run_cli
from tests.helpers import ROOT, tokenizer
from tests.test_ppo_run import config

RULE = "tests.test_ppo_samples:text_rule"


def text_rule(prompt: str, response: str, reference: str | None) -> float:
    """A reward that reads all three texts, so a row whose fields came from different samples shows."""
    return len(response) + 0.01 * len(prompt) + (0.5 if reference else 0.0) + 0.001 * sum(map(ord, response[:5]))


def rows(out) -> list[dict]:
    with open(os.path.join(out, "samples.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_samples_file_holds_the_logged_samples_with_their_rewards(tmp_path):
    out = tmp_path / "out"
    main([config(tmp_path, training={"log_samples": 3, "report_to": "tensorboard"}, reward={"rule": RULE})])
    found = rows(out)
    # 2 steps logged (logging_steps 1), 3 of each step's 8 samples (4 prompts x 2 responses)
    assert [(r["step"], r["sample"]) for r in found] == [(1, 0), (1, 1), (1, 2), (2, 0), (2, 1), (2, 2)]
    tok = tokenizer()
    with open(os.path.join(ROOT, "llm", "data", "sample", "prompts.jsonl"), encoding="utf-8") as f:
        references = {json.loads(line)["tgt"] for line in f}
    for r in found:
        assert r["response"] == tok.decode(r["response_ids"], skip_special_tokens=True)
        assert r["response_length"] == len(r["response_ids"]) >= 1
        assert r["ended"] == (r["response_ids"][-1] == tok.eos_token_id)
        assert r["score"] == pytest.approx(text_rule(r["prompt"], r["response"], r.get("reference")), rel=1e-6)
        assert r["reference"] in references  # every bundled prompt has its reference answer
    # samples 0 and 1 answer the same prompt (num_samples_per_step 2)
    assert found[0]["prompt"] == found[1]["prompt"] != found[2]["prompt"]
    with open(out / "log_history.json", encoding="utf-8") as f:
        logged = json.load(f)
    assert [h["step"] for h in logged] == [1, 2]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "runs"), size_guidance={"tensors": 0}).Reload()
    texts = events.Tensors("ppo/samples/text_summary")
    assert [t.step for t in texts] == [1, 2]
    shown = texts[1].tensor_proto.string_val[0].decode()
    assert shown.count("**sample ") == 3 and found[3]["prompt"].splitlines()[0] in shown


def test_log_samples_zero_writes_nothing_and_a_fresh_run_drops_old_lines(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "samples.jsonl").write_text(json.dumps({"step": 7, "sample": 0}) + "\n")  # left by an earlier run
    run_files.record(str(out), ["samples.jsonl"])  # which wrote it (a run's run_files.json)
    main([config(tmp_path, training={"log_samples": 1, "max_steps": 1, "overwrite_output_dir": True})])
    assert [(r["step"], r["sample"]) for r in rows(out)] == [(1, 0)]
    other = tmp_path / "none"
    main([config(tmp_path, training={"log_samples": 0, "max_steps": 1, "output_dir": str(other)})])
    assert not (other / "samples.jsonl").exists() and (other / "log_history.json").exists()


def test_log_samples_is_checked_and_not_fingerprinted(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        run_cli(main, [config(tmp_path, training={"log_samples": -1})])
    assert e.value.code == 2 and "training.log_samples" in capsys.readouterr().err
    a = run_fingerprint(parse_ppo_config([config(tmp_path, training={"log_samples": 0})]))
    b = run_fingerprint(parse_ppo_config([config(tmp_path, training={"log_samples": 16})]))
    assert a.digest == b.digest and "training.log_samples" not in a.values


def test_samples_are_written_by_the_driver_when_the_roles_run_on_ray(tmp_path):
    """Roles in Ray actors (the rule reward in its own worker): the driver, which holds the samples and their
    scores, writes the file; the scores the worker computed match the rule on the texts the driver wrote."""
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    import ray

    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=200 * 1024**2)
    try:
        pool = {"use_ray": True, "actor_rollout": 0.5, "ref": 0.5, "critic": 0.5, "reward": 0.5}
        pool["colocate"] = [["actor_rollout", "ref"], ["critic", "reward"]]
        main([config(tmp_path, training={"log_samples": 2}, reward={"rule": RULE}, resource_pool=pool)])
    finally:
        ray.shutdown()
    found = rows(tmp_path / "out")
    assert [(r["step"], r["sample"]) for r in found] == [(1, 0), (1, 1), (2, 0), (2, 1)]
    for r in found:
        assert r["score"] == pytest.approx(text_rule(r["prompt"], r["response"], r.get("reference")), rel=1e-6)
