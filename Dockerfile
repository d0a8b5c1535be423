# The image that TorchX's container schedulers (kubernetes, aws_batch) run components.dlrm:train
# in; the component's default --image is torchrec-dlrm:latest.
#
#   docker build -t torchrec-dlrm:latest .
#   docker tag torchrec-dlrm:latest $REGISTRY/torchrec-dlrm:latest && docker push $REGISTRY/torchrec-dlrm:latest
#   torchx run -s kubernetes components.dlrm:train --image $REGISTRY/torchrec-dlrm:latest -j 2x8 --gpu 8
#
# PyPI's torch 2.13.0 and fbgemm-gpu 1.8.0 are CUDA 13.0 builds that bring their own CUDA
# libraries: the base adds only the OS, and the host's NVIDIA container runtime mounts the
# driver, which for CUDA 13.0 must be version 580 or newer. The base's CUDA is torch's, so that
# the runtime refuses an older driver when the container starts (the base's NVIDIA_REQUIRE_CUDA)
# rather than torch failing at its first CUDA call.
#
# The CPU image (fbgemm-gpu-cpu and PyTorch's CPU build of torch: no CUDA libraries) runs the
# job, and its default command, on any machine:
#
#   docker build --build-arg DEVICE=cpu --build-arg BASE_IMAGE=debian:bookworm-slim -t torchrec-dlrm:cpu .
#   docker run --rm torchrec-dlrm:cpu torchx run -s local_cwd components.dlrm:train -j 1x2
#
# tests/slow/test_container_image.py builds it (with Podman) and runs that job in it.
ARG BASE_IMAGE=nvidia/cuda:13.0.3-base-ubuntu24.04
FROM ${BASE_IMAGE}

RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        ca-certificates python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*

# A role runs `bash -c "torchrun ... -m apps.dlrm.train ..."` in the image's working directory
# with the image's PATH: the project is here and the venv's torchrun comes first.
WORKDIR /workspace/torchrec-dlrm
ENV PATH=/opt/venv/bin:$PATH

# cuda (the stack of a GPU machine's `make install`, README.md) or cpu.
ARG DEVICE=cuda
# The index torch comes from. Unset: PyPI for cuda, PyTorch's CPU index for cpu (PyPI's torch is
# the CUDA build, with 2.7 GB of nvidia wheels); empty (--build-arg TORCH_INDEX_URL=): pip's
# own configuration, e.g. a local wheel.
ARG TORCH_INDEX_URL
# The dependencies first, from the two files that name them, so that a source edit does not rerun
# this step (minutes, gigabytes). The cache mount keeps pip's downloads out of the image and
# reuses them when a new version of those files reruns it.
COPY scripts/install.sh scripts/
COPY requirements.txt .
RUN --mount=type=cache,target=/root/.cache/pip \
    if [ "$DEVICE" = cpu ]; then TORCH_INDEX_URL=${TORCH_INDEX_URL-https://download.pytorch.org/whl/cpu}; fi; \
    DEVICE=$DEVICE TORCH_INDEX_URL=$TORCH_INDEX_URL VENV=/opt/venv bash scripts/install.sh stack

# Then the sources, and the project's editable install: seconds.
COPY . .
RUN VENV=/opt/venv bash scripts/install.sh project

# What `torchx run` takes: the job's options. It needs no GPU (the CUDA image's
# `python -m apps.dlrm.train` does: it imports fbgemm_gpu).
CMD ["torchx", "run", "components.dlrm:train", "--help"]
