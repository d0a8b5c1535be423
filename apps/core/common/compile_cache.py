"""torch.compile's on-disk caches, keyed by the CPU vector instructions their kernels are written for.

Inductor writes its CPU C++ kernels for one vector instruction set (``pick_vec_isa``: AVX-512,
AVX2, ... as the CPU and ``ATEN_CPU_CAPABILITY`` allow), with that set's vector width in their
loops. torch 2.11 and 2.13 key the FX graph and AOTAutograd caches without it: a cache written on
one CPU and read on another (a ``TORCHINDUCTOR_CACHE_DIR`` on shared storage, an image with a warm
cache) recompiles the first machine's kernels for the second's width. Measured here: TorchRec's
DLRM interaction, compiled in bf16 with AVX-512 and read back with AVX2, segfaults in its backward
(tests/integration/test_compile_cache.py). So the instruction set goes into
``torch.compiler.config.cache_key_tag``, after any tag of the user's (``TORCH_COMPILE_CACHE_KEY_TAG``):
machines of one CPU kind still share their cache, others compile their own.
"""

import torch

ISA_TAG = "cpu_vec_isa="


def key_compile_cache_by_cpu() -> None:
    """Adds this process's CPU vector instruction set to the compile caches' key (once)."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    tag = f"{ISA_TAG}{pick_vec_isa()}"
    current = torch.compiler.config.cache_key_tag
    if tag not in current:
        torch.compiler.config.cache_key_tag = f"{current};{tag}" if current else tag
