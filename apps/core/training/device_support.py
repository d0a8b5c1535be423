"""The options that need GPUs, checked in one place before a job or a plan preview builds anything.

On CPU ranks each of them would fail deep inside FBGEMM or TorchRec (or, for --hbm_gb, be
silently ignored); this check names the option and the CPU alternative instead.
"""

from typing import Iterator

from apps.core.common.errors import ConfigError
from apps.core.config import SharedSections

#: Pipelines that fail on CPU ranks, and why.
GPU_PIPELINES = {
    "semi_sync": "orders its steps with CUDA streams and events",
    "fused_sparse_dist": "orders its steps with CUDA streams and events",
    "prefetch": "prefetches rows into FBGEMM's UVM caches, which CPU ranks do not have",
}


def check_device_support(cfg: SharedSections, device_type: str) -> None:
    """Refuses, with the first one's fix, the options of ``cfg`` that ranks on ``device_type``
    ("cuda", "cpu") cannot run. Needs no torch: the components check a job before submitting it."""
    if device_type == "cuda":
        return
    for problem in _gpu_only_options(cfg, device_type):
        raise ConfigError(problem)


def _gpu_only_options(cfg: SharedSections, device_type: str) -> Iterator[str]:
    if cfg.training.embedding_optimizer == "adam":
        yield (
            "--embedding_optimizer adam needs GPUs: FBGEMM's fused Adam has no CPU kernel; "
            "use rowwise_adagrad, adagrad or sgd on CPU"
        )
    for name in ("qcomm_forward_precision", "qcomm_backward_precision"):
        if getattr(cfg.launch, name) == "fp8":
            yield f"--{name} fp8 needs GPUs: FBGEMM's fp8 codec has no CPU kernel; use fp16, bf16 or int8 on CPU"
    if cfg.launch.hbm_gb:
        yield (
            f"--hbm_gb {cfg.launch.hbm_gb:g} is for GPU ranks, but this job runs on {device_type}: "
            "drop it, or run the job on GPUs (-h, or --gpu)"
        )
    if cfg.launch.pipeline in GPU_PIPELINES:
        yield (
            f"--pipeline {cfg.launch.pipeline} needs GPUs: it {GPU_PIPELINES[cfg.launch.pipeline]}; "
            "use sparse_dist or sparse_dist_lite on CPU"
        )
    if cfg.launch.compile_dense == "reduce-overhead":
        yield "--compile_dense reduce-overhead replays CUDA graphs, which needs GPUs: use default or none on CPU"
    yield from cfg.app_gpu_only_options()
