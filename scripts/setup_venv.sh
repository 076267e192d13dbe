#!/usr/bin/env bash
# Creates the project venv and installs torch first, then the package (editable, with dev extra).
# torch: the CUDA build where nvidia-smi sees a GPU, else the CPU wheel torch==2.13.0, because an
# unpinned `torch>=2.4` in a fresh venv would pull a multi-GB CUDA build onto a CPU-only machine.
set -euo pipefail
venv=${1:-.venv}
python=${PYTHON:-python3}

if [ ! -x "$venv/bin/python" ]; then
    echo "setup: creating $venv"
    "$python" -m venv "$venv"
fi
pip_install() {  # quiet, minus pip's warnings about missing local find-links directories
    "$venv/bin/python" -m pip install --disable-pip-version-check -q "$@" \
        2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}

if "$venv/bin/python" -c "import torch" 2>/dev/null; then
    echo "setup: torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)') already installed"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q GPU; then
    echo "setup: GPU found, installing the CUDA build of torch"
    pip_install "torch>=2.4"
else
    echo "setup: no GPU found, installing the CPU wheel torch==2.13.0"
    pip_install "torch==2.13.0"
fi

echo "setup: installing mini_grpo (editable, with dev extra)"
pip_install -e ".[dev]"
echo "setup: done"
