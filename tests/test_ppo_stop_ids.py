"""The ids that end a response (``PPOContext.stop_ids``): the tokenizer's EOS and the actor model's
generation-config EOS ids, as TRL's GRPO stops on (Qwen2.5-Instruct lists two, Llama-3-Instruct three). Every
generation (Hugging Face ``generate``, the vLLM engine's sampling params), the samples' ``ended`` and an episode's
end of turn use them; a run used to stop at the tokenizer's EOS only, running past the end of a turn."""

import json
import logging
import os
from types import SimpleNamespace

import pytest

from bench.bench_grpo_eos import ours_config, run_ours
from llm.alignment.label.completer import ModelCompleter, Prefix, Sampling
from llm.alignment.ppo.prompts import Prompt, make_samples
from llm.alignment.ppo.vllm_rollout import VLLMRollout
from llm.alignment.search.policy import StepPolicy
from llm.utils.errors import UserError
from llm.utils.modeling import generation_eos_ids, stop_token_ids
from tests.helpers import ROOT, SECOND_EOS, tokenizer, two_eos_model

SECOND = SECOND_EOS  # the generation config's second EOS id of two_eos_model (an ordinary token of the tokenizer)


def test_union_in_order_with_the_tokenizers_eos_first():
    qwen = SimpleNamespace(eos_token_id=151645)  # Qwen2.5-Instruct: <|im_end|>; generation config adds <|endoftext|>
    assert stop_token_ids(qwen, [151645, 151643]) == (151645, 151643)
    llama3 = SimpleNamespace(eos_token_id=128009)  # Llama-3-Instruct: <|eot_id|>; the config lists three
    assert stop_token_ids(llama3, [128001, 128008, 128009]) == (128009, 128001, 128008)
    smollm2 = SimpleNamespace(eos_token_id=2)  # both name <|im_end|>
    assert stop_token_ids(smollm2, [2]) == stop_token_ids(smollm2) == (2,)
    assert stop_token_ids(SimpleNamespace(eos_token_id=None), [5, 5, 6]) == (5, 6)


def test_generation_eos_ids_read_from_the_directory(tmp_path):
    with open(os.path.join(ROOT, "llm/assets/tiny-llama/config.json"), encoding="utf-8") as f:
        config = json.load(f)
    (tmp_path / "config.json").write_text(json.dumps({**config, "eos_token_id": 9}))
    assert generation_eos_ids(str(tmp_path)) == [9]  # no generation_config.json: the config's, as transformers does
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [128001, 128008, 128009]}))
    assert generation_eos_ids(str(tmp_path)) == [128001, 128008, 128009]
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(UserError, match="generation_config.json: cannot read it"):
        generation_eos_ids(str(tmp_path))


def test_rollout_stops_at_the_generation_configs_second_eos(tmp_path, caplog):
    """Step 0's rollout of a GRPO run (bench_grpo_eos.run_ours: context, prompts, actor and sampling settings as
    a run builds them) on the two-EOS model: every completion ends at its first stop id, SECOND among them. With
    the tokenizer's EOS only, completions ran past SECOND (it showed up inside them)."""
    model_dir = str(tmp_path / "model")
    eos = two_eos_model(model_dir)
    rows = [{"src": f"{a} plus {a} is"} for a in range(4)]
    new_tokens = 12
    with caplog.at_level(logging.INFO, logger="llm.utils.modeling"):
        ours = run_ours(
            ours_config(
                model_dir, rows, str(tmp_path), seed=3, samples=4, new_tokens=new_tokens, temperature=1.0, chat=False
            )
        )
    assert ours["stop_ids"] == [eos, SECOND]
    assert f"responses end at any of the token ids [{eos}, {SECOND}]" in caplog.text
    completions = ours["completions"]
    for c in completions:  # no stop id before the last token; without one, the cap
        assert not {eos, SECOND} & set(c[:-1]), c
        assert c[-1] in (eos, SECOND) or len(c) == new_tokens, c
    assert sum(c[-1] == SECOND for c in completions) >= 2, completions


def test_ended_is_any_stop_id():
    tok = tokenizer()
    eos = tok.eos_token_id
    responses = [[5, SECOND], [5, eos], [5, 6], []]
    prompts = [Prompt([1, 4], "p", None)]
    assert make_samples(prompts, responses, tok, (eos, SECOND)).ended.tolist() == [True, True, False, False]
    assert make_samples(prompts, responses, tok).ended.tolist() == [False, True, False, False]


class FakeLLM:
    """``vllm.LLM.generate`` stand-in: each request's completion is ``ids``, as given."""

    def __init__(self, ids):
        self.ids = ids

    def generate(self, requests, params, use_tqdm=False):
        completion = SimpleNamespace(token_ids=self.ids, logprobs=None)
        return [SimpleNamespace(outputs=[completion]) for _ in requests]


def fake_engine(ids):
    """A ``VLLMRollout`` without vLLM: its sampling params recorded as keyword dicts, its LLM answering ``ids``."""
    engine = VLLMRollout.__new__(VLLMRollout)
    engine.tokenizer, engine.temperature, engine.sleep_mode, engine.asleep = tokenizer(), 1.0, False, False
    engine._params = lambda **kw: kw
    engine.llm = FakeLLM(ids)
    return engine


def test_vllm_sampling_params_carry_the_stop_ids():
    eos = tokenizer().eos_token_id
    settings = {"num_samples": 2, "max_new_tokens": 8, "do_sample": True, "top_p": 1.0, "top_k": 0, "seed": 1}
    engine = fake_engine([5, SECOND, 6, eos])
    seen = []
    engine._params = lambda **kw: seen.append(kw) or kw
    out = engine.generate([[1, 4]], **settings, stop_ids=(eos, SECOND))
    assert [p["stop_token_ids"] for p in seen] == [[eos, SECOND]] * 2
    assert out == [[5, SECOND]] * 2  # cut at the first stop id, as the Hugging Face path does
    seen.clear()
    assert engine.generate([[1, 4]], **settings) == [[5, SECOND, 6, eos]] * 2  # no stop ids given: the EOS only
    assert [p["stop_token_ids"] for p in seen] == [[eos]] * 2
    seen.clear()
    engine.generate([[1, 4]], **settings, stop_ids=(eos, SECOND), ignore_eos=True)
    assert [p["stop_token_ids"] for p in seen] == [None] * 2


def test_label_and_search_end_at_the_stop_ids():
    """``llm/run_label.py``'s completer and ``llm/run_search.py``'s step policy: asked to stop at the stop ids, and a
    completion / step ending at the second one is finished (before, only at the tokenizer's EOS)."""
    tok = tokenizer()
    stops, calls = (tok.eos_token_id, SECOND), []

    def engine(prompt_ids, **settings):
        calls.append(settings.get("stop_ids"))
        return [[5, SECOND]] * (len(prompt_ids) * settings.get("num_samples", 1))

    sampling = Sampling(1.0, 1.0, 0, 8, 4)
    prefix = Prefix([{"role": "user", "content": "Q?"}], [])
    assert [c.finished for c in ModelCompleter(engine, tok, sampling, False, "\n", stops).complete([prefix], 2, 0)[0]]
    assert calls == [stops]
    assert not ModelCompleter(engine, tok, sampling, False, "\n").complete([prefix], 1, 0)[0][0].finished
    settings = {"max_step_tokens": 6, "max_new_tokens": 40, "batch_size": 2}
    prompt = [tok("Q?\n")["input_ids"]]
    assert StepPolicy(engine, tok, prompt, "\n", **settings, stop_ids=stops).expand([(0, ())], [1], 0, False)[0][0].done
    assert not StepPolicy(engine, tok, prompt, "\n", **settings).expand([(0, ())], [1], 0, False)[0][0].done
