#!/usr/bin/env bash
# Create .venv with everything the trainers and tests need. On a machine without torch it installs
# the CPU wheel first (torch==2.13.0): an open range would pull a multi-GB CUDA build. GPU users
# install their own torch build before running this; it is then left alone.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -d .venv ] || python3 -m venv .venv
. .venv/bin/activate
python -c "import torch" 2>/dev/null || python -m pip install --quiet torch==2.13.0
python -m pip install --quiet -r requirements-dev.txt
python -c "import torch, transformers, trl; print('torch', torch.__version__, '| transformers', transformers.__version__, '| trl', trl.__version__)"
