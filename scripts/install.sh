#!/usr/bin/env bash
# Creates a virtual environment with the builds of torch, fbgemm-gpu and torchrec that fit this
# machine, then installs this project into it (editable, so `components.dlrm:train` resolves
# from any directory).
#
#   bash scripts/install.sh            # .venv, GPU stack if `nvidia-smi` sees a GPU, else CPU
#   DEVICE=cuda bash scripts/install.sh    # force the CUDA stack (e.g. in a Docker build)
#   VENV=/opt/venv WITH_TESTS=1 bash scripts/install.sh
#   bash scripts/install.sh stack      # only the dependencies: reads scripts/ and requirements*.txt
#   bash scripts/install.sh project    # only this project, into a VENV that has the stack
#
# The Dockerfile installs the stack before it copies the sources and the project after, so that
# a source edit reruns only the cheap second step.
#
# Why not one `pip install`: torchrec declares a dependency on the CUDA build of fbgemm-gpu
# (2.7 GB), which cannot even load on a CPU-only machine. On CPU machines we install
# fbgemm-gpu-cpu instead and torchrec with --no-deps (its real dependencies are in
# requirements.txt).
#
# The closing check imports what was installed. The CUDA build of fbgemm-gpu links the NVIDIA
# driver's libnvidia-ml.so.1, so it cannot be imported where there is no driver, as in any
# Docker build: there the check reads the installed versions and torch's CUDA, and that the
# driver's libraries are the only ones fbgemm-gpu's libraries lack, and says so.
set -euo pipefail

# The version matrix (docs/development.md), a row per torch: VERSION_ROW picks one. 2.13 is the one used here;
# 2.11 is what the lent GPU machines have, which scripts/gpu_row.sh installs and tests on CPU.
case "${VERSION_ROW:=2.13}" in
  2.13) TORCH_VERSION=2.13.0 FBGEMM_VERSION=1.8.0 TORCHREC_VERSION=1.8.0 ;;
  2.11) TORCH_VERSION=2.11.0 FBGEMM_VERSION=1.6.0 TORCHREC_VERSION=1.6.1 ;;
  *) echo "install.sh: VERSION_ROW=$VERSION_ROW is not a row of the version matrix: use 2.13 or 2.11" >&2; exit 2 ;;
esac
# The CUDA of PyPI's torch and fbgemm-gpu builds (DEVICE=cuda): hosts need an NVIDIA driver
# >= 580 for CUDA 13.0, and the Dockerfile's CUDA base is this version.
TORCH_CUDA=13.0

cd "$(dirname "$0")/.."
PART=${1:-all}
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
DEVICE=${DEVICE:-$(nvidia-smi -L >/dev/null 2>&1 && echo cuda || echo cpu)}
case "$DEVICE" in
  cuda) FBGEMM=fbgemm-gpu ;;
  cpu) FBGEMM=fbgemm-gpu-cpu ;;
  *) echo "install.sh: DEVICE=$DEVICE is not a device: use cpu or cuda" >&2; exit 2 ;;
esac
case "$PART" in
  all | stack | project) ;;
  *) echo "install.sh: '$PART' is not a part: use stack, project or nothing (both)" >&2; exit 2 ;;
esac
pip=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)

install_stack() {
  echo "install.sh: $DEVICE stack (torch $TORCH_VERSION, $FBGEMM $FBGEMM_VERSION, torchrec $TORCHREC_VERSION) into $VENV"
  [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
  # TORCH_INDEX_URL (e.g. https://download.pytorch.org/whl/cpu) picks a torch build from another
  # index; without it pip takes PyPI's (or a local file's) build of this exact version.
  "${pip[@]}" "torch==$TORCH_VERSION" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
  # Every later install keeps this torch: a requirement that wants another one fails, naming
  # itself, instead of replacing it with gigabytes of another build.
  echo "torch==$TORCH_VERSION" > "$VENV/constraints.txt"
  export PIP_CONSTRAINT=$VENV/constraints.txt
  "${pip[@]}" "$FBGEMM==$FBGEMM_VERSION"
  "${pip[@]}" -r requirements.txt
  # Last, so that pip's resolver never sees (and complains about) its declared dependencies.
  "${pip[@]}" --no-deps "torchrec==$TORCHREC_VERSION"
  if [ "${WITH_TESTS:-0}" = 1 ]; then
    "${pip[@]}" -r requirements-test.txt
  fi
}

install_project() {
  if [ ! -x "$VENV/bin/python" ]; then
    echo "install.sh: $VENV has no python: install the stack first (bash scripts/install.sh stack)" >&2
    exit 1
  fi
  # compat mode: a plain path entry, which also lets TorchX discover our torchx_plugins packages.
  "${pip[@]}" --no-deps --no-build-isolation -e . --config-settings editable_mode=compat
}

# Arguments: the part installed, then the stack it must hold (the FBGEMM build is checked only
# where this run installed it: `project` accepts either). -I: the project must resolve through
# the venv's editable install, not through the current directory.
check() {
  local fbgemm=$FBGEMM
  if [ "$PART" = project ]; then fbgemm=; fi
  "$VENV/bin/python" -I - "$PART" "$PWD" "$TORCH_VERSION" "$TORCH_CUDA" "$fbgemm" "$FBGEMM_VERSION" \
    "$TORCHREC_VERSION" <<'PY'
import ctypes
import glob
import importlib
import importlib.metadata as metadata
import importlib.util
import os
import shutil
import subprocess
import sys

PART, REPO, TORCH, TORCH_CUDA, WANT_FBGEMM, FBGEMM_VERSION, TORCHREC = sys.argv[1:]
FBGEMM_BUILDS = ("fbgemm-gpu", "fbgemm-gpu-cpu")  # both install the package fbgemm_gpu
DRIVER_LIBS = {"libcuda.so.1", "libnvidia-ml.so.1"}  # the NVIDIA driver's, mounted by its runtime


def fail(message):
    sys.exit(f"install.sh: {message}")


def version(dist):
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def installed_stack():
    """The stack's distributions and versions; fails unless they are the pinned ones."""
    fbgemm = [dist for dist in FBGEMM_BUILDS if version(dist)]
    if not fbgemm:
        fail(f"no FBGEMM build in {sys.prefix}: install the stack (bash scripts/install.sh stack)")
    if len(fbgemm) != 1 or WANT_FBGEMM not in ("", fbgemm[0]):
        fail(f"{sys.prefix} holds {' and '.join(fbgemm)}, not {WANT_FBGEMM or 'one of them'} "
             "alone: the builds share the package fbgemm_gpu, so remove the venv and install again")
    stack = {"torch": TORCH, fbgemm[0]: FBGEMM_VERSION, "torchrec": TORCHREC}
    for dist, pinned in stack.items():
        have = version(dist)
        if have is None or have.split("+")[0] != pinned:  # torch's local label: +cpu, +cu130
            fail(f"{dist} {have or '(none)'} is installed in {sys.prefix}, install.sh pins {pinned}")
    return {dist: version(dist) for dist in stack}


def driver_present():
    """Whether the NVIDIA driver's libraries load: its container runtime mounts them into a
    container that has a GPU, never into a build."""
    for lib in DRIVER_LIBS:
        try:
            ctypes.CDLL(lib)
        except OSError:
            return False
    return True


def library_dirs(torch):
    """Where the libraries that `import torch` loads first live: torch/lib and the nvidia wheels'.
    At import, fbgemm_gpu finds libtorch*.so and libcudart.so.* already loaded; ldd has to be
    told where they are."""
    dirs = [os.path.join(os.path.dirname(torch.__file__), "lib")]
    nvidia = importlib.util.find_spec("nvidia")
    for root in nvidia.submodule_search_locations if nvidia else ():
        dirs += sorted(glob.glob(os.path.join(root, "**", "lib"), recursive=True))
    return dirs


def unresolved(package, dirs):
    """soname -> the package's libraries that need it and that ldd cannot resolve."""
    if not shutil.which("ldd"):
        fail("the check without a driver needs ldd (Debian and Ubuntu: apt-get install libc-bin)")
    libraries = sorted(glob.glob(os.path.join(package, "*.so")))
    if not libraries:
        fail(f"no libraries in {package}: the fbgemm-gpu install is broken, install again")
    env = dict(os.environ, LD_LIBRARY_PATH=os.pathsep.join(dirs))
    missing = {}
    for library in libraries:
        out = subprocess.run(["ldd", library], env=env, capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if "=> not found" in line:
                missing.setdefault(line.split()[0], []).append(os.path.basename(library))
    return missing


def check_torch_cuda():
    """fbgemm-gpu's CUDA build needs torch's CUDA to be its own."""
    import torch

    if torch.version.cuda != TORCH_CUDA:
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU"
        fail(f"DEVICE=cuda, but torch {torch.__version__} is a {build} build, not PyPI's CUDA "
             f"{TORCH_CUDA} one that fbgemm-gpu needs: pip took it from TORCH_INDEX_URL or its "
             "find-links; unset them, remove the venv and install again")


def check_stack_without_driver(stack):
    """The CUDA stack where the driver is missing: all that can be checked short of importing it."""
    import torch
    import torchx  # noqa: F401  (needs no GPU)

    package = importlib.util.find_spec("fbgemm_gpu").submodule_search_locations[0]
    missing = unresolved(package, library_dirs(torch))
    beyond = {lib: users for lib, users in missing.items() if lib not in DRIVER_LIBS}
    if beyond:
        fail(f"fbgemm-gpu's libraries need {beyond}, which neither the driver nor torch "
             f"(CUDA {torch.version.cuda}) and its nvidia wheels provide: do the torch and "
             "fbgemm-gpu builds match?")
    print(f"install.sh: no NVIDIA driver here (as in a Docker build), so fbgemm_gpu cannot be "
          f"imported; checked instead: {', '.join(f'{d} {v}' for d, v in stack.items())} are "
          f"installed (CUDA {torch.version.cuda}) and fbgemm_gpu's libraries lack only the driver's "
          f"{', '.join(sorted(missing)) or '(none)'}")


def check_project(importable):
    """The project resolves from the venv to this checkout (its editable install)."""
    components = importlib.import_module("components.dlrm")  # torchx only: no driver needed
    if not os.path.samefile(os.path.dirname(os.path.dirname(components.__file__)), REPO):
        fail(f"components.dlrm resolves to {components.__file__}, not to {REPO}: "
             "another project is installed in the venv; remove it and install again")
    if importable:
        importlib.import_module("apps.dlrm.train")
    elif importlib.util.find_spec("apps.dlrm.train") is None:
        fail("apps.dlrm.train is not found: the editable install failed")
    else:
        print("install.sh: no NVIDIA driver here, so apps.dlrm.train (it imports fbgemm_gpu) "
              "was found, not imported")


stack = installed_stack()
cuda_without_driver = "fbgemm-gpu" in stack and not driver_present()
if PART != "project":
    if "fbgemm-gpu" in stack:
        check_torch_cuda()
    if cuda_without_driver:
        check_stack_without_driver(stack)
    else:
        for module in ("fbgemm_gpu", "torchrec", "torchx"):
            importlib.import_module(module)
if PART != "stack":
    check_project(importable=not cuda_without_driver)
import torch  # noqa: E402

gpus = f"{torch.cuda.device_count()} GPUs" if torch.cuda.is_available() else "no GPU here"
part = "" if PART == "all" else f" ({PART})"
print(f"install.sh: ready{part}, torch {torch.__version__}, {gpus}")
PY
}

[ "$PART" = project ] || install_stack
[ "$PART" = stack ] || install_project
check
