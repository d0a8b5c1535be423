"""TF32 on GPUs (--allow_tf32): float32 matmuls and cuDNN convolutions on TF32 tensor cores.

torch 2.9 moved the switch: its kernels (the GPU row's torch 2.11, this project's 2.13) decide by
per-backend, per-operator ``fp32_precision`` flags (``torch.backends.cuda.matmul.fp32_precision``,
``torch.backends.cudnn.conv.fp32_precision``, ``.rnn``: ``"tf32"`` or ``"ieee"``), earlier ones
by ``allow_tf32`` flags. The old setters still work and set both: cuBLAS's through
``torch.set_float32_matmul_precision`` (``"high"``: TF32), cuDNN's through
``torch.backends.cudnn.allow_tf32``. The new flags alone would not do: they leave the old state
behind, and reading it then raises ("you have used mix of legacy and new API"), which
``torch.get_float32_matmul_precision()`` does wherever torch.compile keys its caches.
"""

import torch


def set_tf32(allow: bool) -> None:
    """TF32 on (or off) for float32 matmuls (cuBLAS) and cuDNN convolutions and RNNs, the old
    and the new flags alike, on every torch version."""
    torch.set_float32_matmul_precision("high" if allow else "highest")
    torch.backends.cudnn.allow_tf32 = allow
