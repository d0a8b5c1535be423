# syntax=docker/dockerfile:1
# The image that TorchX's container schedulers (kubernetes, aws_batch) run components.dlrm:train
# in; the component's default --image is torchrec-dlrm:latest.
#
#   docker build -t torchrec-dlrm:latest .
#   docker tag torchrec-dlrm:latest $REGISTRY/torchrec-dlrm:latest && docker push $REGISTRY/torchrec-dlrm:latest
#   torchx run -s kubernetes components.dlrm:train --image $REGISTRY/torchrec-dlrm:latest -j 2x8 --gpu 8
#
# torch, fbgemm-gpu and torchrec are installed by scripts/install.sh with DEVICE=cuda, so they
# are the versions of a GPU machine's `make install` (README.md). PyPI's torch and fbgemm-gpu
# wheels bring their own CUDA libraries: the base image only needs the OS, and the host's
# NVIDIA container runtime provides the driver.
ARG BASE_IMAGE=nvidia/cuda:12.8.1-base-ubuntu24.04
FROM ${BASE_IMAGE}

RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        ca-certificates python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*

# A role runs `bash -c "torchrun ... -m apps.dlrm.train ..."` in the image's working directory
# with the image's PATH: the project is here and the venv's torchrun comes first.
WORKDIR /workspace/torchrec-dlrm
ENV PATH=/opt/venv/bin:$PATH
COPY . .
# No GPU during a build, hence DEVICE=cuda. The cache mount keeps pip's downloads (several GB)
# out of the image and reuses them when a source change reruns this step.
RUN --mount=type=cache,target=/root/.cache/pip DEVICE=cuda VENV=/opt/venv bash scripts/install.sh

CMD ["python", "-m", "apps.dlrm.train", "--help"]
