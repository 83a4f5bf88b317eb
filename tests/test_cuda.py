"""The CUDA paths: FlexAttention (compiled) and flash-attn varlen packed attention against the exact
block-wise SDPA, and a bf16 reward-model run. Each test says why it is skipped where there is no CUDA
(or no flash-attn); on a GPU machine: ``python -m pytest -q -rs tests/test_cuda.py``."""

import importlib.util
import json

import pytest
import torch

from llm.data.packing import collate, pack
from tests.helpers import tiny_model
from tests.test_packing import make_examples

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA: the CPU path is block-wise SDPA, tested elsewhere")
needs_flash = pytest.mark.skipif(
    not CUDA or importlib.util.find_spec("flash_attn") is None, reason="needs CUDA and the flash-attn package"
)


def _logits(model, rows, kernel, dtype):
    batch = collate(rows, pad_token_id=0, pad_to=64, kernel=kernel).to("cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=dtype):
        return model(**batch.model_inputs()).logits.float()


@pytest.mark.parametrize(
    "kernel", [pytest.param("flex", marks=needs_cuda), pytest.param("flash_varlen", marks=needs_flash)]
)
def test_cuda_kernels_equal_blockwise_sdpa(kernel):
    """Document-causal rows (flash varlen takes only those; pairs fall back to block-wise SDPA)."""
    gen = torch.Generator().manual_seed(5)
    examples = make_examples(gen)[0][:-1]  # the causal examples
    model = tiny_model("llama").to("cuda").eval()
    rows, _ = pack(examples, 64, "greedy")
    dtype = torch.bfloat16 if kernel == "flash_varlen" else torch.float32  # flash-attn has no fp32
    ours = _logits(model, rows, "sdpa", dtype)
    other = _logits(model, rows, kernel, dtype)
    # bf16: both kernels round activations to bf16 (~4e-3 relative) in every layer, on logits of size ~1-3;
    # fp32: the same math in another reduction order (CPU tests hold 1e-5; CUDA kernels tile differently).
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    for r, row in enumerate(rows):
        assert (ours[r, : len(row)] - other[r, : len(row)]).abs().max() <= tol, (kernel, r)


@needs_cuda
def test_flex_pair_rows_equal_blockwise_sdpa():
    """The shared-prompt pair layout, which only FlexAttention (of the CUDA kernels) expresses."""
    gen = torch.Generator().manual_seed(6)
    examples = make_examples(gen)[0]
    model = tiny_model("qwen2").to("cuda").eval()
    rows, _ = pack(examples, 64, "greedy")
    ours, flex = _logits(model, rows, "sdpa", torch.float32), _logits(model, rows, "flex", torch.float32)
    for r, row in enumerate(rows):  # fp32 tolerance as in test_cuda_kernels_equal_blockwise_sdpa
        assert (ours[r, : len(row)] - flex[r, : len(row)]).abs().max() <= 1e-4


@needs_cuda
def test_bf16_prm_run_on_cuda(tmp_path):
    from llm.run_reward import main
    from tests.test_run_reward import config, read_json, small_split

    train, dev = small_split(tmp_path, "prm_train.jsonl", 64), small_split(tmp_path, "prm_dev.jsonl", 24)
    flash = importlib.util.find_spec("flash_attn") is not None
    main(
        [
            config(
                tmp_path,
                "prm_argument.json",
                train_dataset_path=train,
                dev_dataset_path=dev,
                max_steps=6,
                bf16=True,
                use_flash_attention=flash,
                flash_mask=not flash,
                save_strategy="no",
            )
        ]
    )
    results = read_json(tmp_path / "out" / "all_results.json")
    assert torch.isfinite(torch.tensor([results["train_loss"], results["eval_loss"]])).all(), json.dumps(results)
