"""--allow_tf32 puts TF32 in effect, or out of it, as the running torch decides it: read back from
the flags its kernels read (torch 2.9 and later, such as the GPU row's 2.11 and this project's
2.13: ``fp32_precision`` per backend and operator; earlier: ``allow_tf32``), with the old flags
still readable (torch.compile reads them)."""

import pytest
import torch

from apps.core.training.precision import set_tf32

# Tier (tests/conftest.py): pure logic, fast (flags only: no GPU needed to set or read them).
TIER = "unit"


@pytest.fixture
def restored_flags():
    """The process's TF32 flags as they were, after the test."""
    matmul, cudnn = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    yield
    torch.set_float32_matmul_precision(matmul)
    torch.backends.cudnn.allow_tf32 = cudnn


def tf32_in_effect() -> dict[str, bool]:
    """Whether cuBLAS matmuls and cuDNN convolutions and RNNs use TF32, by the flags this torch's kernels read."""
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    if hasattr(matmul, "fp32_precision"):  # torch >= 2.9
        return {
            op: module.fp32_precision == "tf32"
            for op, module in (("matmul", matmul), ("conv", cudnn.conv), ("rnn", cudnn.rnn))
        }
    return {"matmul": matmul.allow_tf32, "conv": cudnn.allow_tf32, "rnn": cudnn.allow_tf32}


def test_allow_tf32_sets_what_this_torch_reads_and_the_old_flags_agree(restored_flags):
    for allow in (True, False, True):
        set_tf32(allow)
        assert tf32_in_effect() == {"matmul": allow, "conv": allow, "rnn": allow}, allow
        # The old flags say the same and can be read (mixing old and new setters makes reading raise).
        assert torch.get_float32_matmul_precision() == ("high" if allow else "highest")
        assert torch.backends.cuda.matmul.allow_tf32 is allow and torch.backends.cudnn.allow_tf32 is allow
