#!/usr/bin/env bash
# The tests: the whole suite in .venv, then the vLLM tests (rollout, search) in .venv-vllm (bash scripts/setup.sh and
# bash scripts/setup.sh --vllm make them). Without .venv-vllm the vLLM tests have not run: this says so and fails.
set -euo pipefail
cd "$(dirname "$0")/.."
# REQUIRE_TRL_CURRENT: the GRPO loss parity test fails (never skips) without TRL's current release
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false REQUIRE_TRL_CURRENT=1
.venv/bin/python -m pytest -q tests "$@"
if [ ! -x .venv-vllm/bin/python ]; then
  echo "the vLLM tests did not run: .venv-vllm is missing (bash scripts/setup.sh --vllm makes it)" >&2
  exit 1
fi
# REQUIRE_VLLM: vLLM that does not import is a failure here, not a skip
REQUIRE_VLLM=1 .venv-vllm/bin/python -m pytest -q tests/test_vllm_rollout.py tests/test_search_vllm.py
