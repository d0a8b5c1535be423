#!/usr/bin/env bash
# Creates a virtual environment with the builds of torch, fbgemm-gpu and torchrec that fit this
# machine, then installs this project into it (editable, so `components.dlrm:train` resolves
# from any directory).
#
#   bash scripts/install.sh            # .venv, GPU stack if `nvidia-smi` sees a GPU, else CPU
#   DEVICE=cuda bash scripts/install.sh    # force the CUDA stack (e.g. in a Docker build)
#   VENV=/opt/venv WITH_TESTS=1 bash scripts/install.sh
#
# Why not one `pip install`: torchrec declares a dependency on the CUDA build of fbgemm-gpu
# (2.7 GB), which cannot even load on a CPU-only machine. On CPU machines we install
# fbgemm-gpu-cpu instead and torchrec with --no-deps (its real dependencies are in
# requirements.txt).
set -euo pipefail

# The version matrix (README.md): torch 2.13 <-> fbgemm-gpu 1.8.0 <-> torchrec 1.8.0.
TORCH_VERSION=2.13.0
FBGEMM_VERSION=1.8.0
TORCHREC_VERSION=1.8.0

cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
DEVICE=${DEVICE:-$(nvidia-smi -L >/dev/null 2>&1 && echo cuda || echo cpu)}
case "$DEVICE" in
  cuda) FBGEMM=fbgemm-gpu ;;
  cpu) FBGEMM=fbgemm-gpu-cpu ;;
  *) echo "install.sh: DEVICE=$DEVICE is not a device: use cpu or cuda" >&2; exit 2 ;;
esac

echo "install.sh: $DEVICE stack (torch $TORCH_VERSION, $FBGEMM $FBGEMM_VERSION, torchrec $TORCHREC_VERSION) into $VENV"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
# TORCH_INDEX_URL (e.g. https://download.pytorch.org/whl/cpu) picks a torch build from another
# index; without it pip takes PyPI's (or a local file's) build of this exact version.
"${pip[@]}" "torch==$TORCH_VERSION" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
"${pip[@]}" "$FBGEMM==$FBGEMM_VERSION"
"${pip[@]}" -r requirements.txt
# Last, so that pip's resolver never sees (and complains about) its declared dependencies.
"${pip[@]}" --no-deps "torchrec==$TORCHREC_VERSION"
if [ "${WITH_TESTS:-0}" = 1 ]; then
  "${pip[@]}" -r requirements-test.txt
fi
# compat mode: a plain path entry, which also lets TorchX discover our torchx_plugins packages.
"${pip[@]}" --no-deps --no-build-isolation -e . --config-settings editable_mode=compat
"$VENV/bin/python" -c "import torch, fbgemm_gpu, torchrec, torchx, apps.dlrm.train, components.dlrm; print('install.sh: ready, torch', torch.__version__, 'cuda' if torch.cuda.is_available() else 'cpu')"
