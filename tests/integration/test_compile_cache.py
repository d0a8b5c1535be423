"""--compile_dense with a compile cache shared by machines of different CPUs (apps/core/common/compile_cache.py).

Two processes share one ``TORCHINDUCTOR_CACHE_DIR``: the first compiles with this CPU's widest
vector instructions, the second as a CPU with the next narrower ones would (``ATEN_CPU_CAPABILITY``,
which inductor's choice follows). Without the instruction set in the cache key, the second read
the first's kernels: on an AVX-512 CPU it segfaulted in the bf16 interaction's backward, on an
AVX2 one it failed to compile them.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO, TINY

# One bf16 training step of the compiled dense part; prints its loss and its gradients' largest
# difference from the same step uncompiled.
STEP = """
import dataclasses, json, sys, torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from apps.dlrm.config import parse_train_config
from apps.dlrm.model import build_model, feature_names, speed_up_dense

cfg = parse_train_config(sys.argv[1:])
cpu = torch.device("cpu")
torch.manual_seed(0)
eager = build_model(cfg.model, cpu, table_device=cpu)
compiled = build_model(cfg.model, cpu, table_device=cpu)
compiled.load_state_dict(eager.state_dict())
speed_up_dense(dataclasses.replace(cfg.launch, compile_dense="none"), eager, cpu)
speed_up_dense(cfg.launch, compiled, cpu)
rows, keys = 64, feature_names(cfg.model.num_sparse_features)
batch = Batch(
    dense_features=torch.randn(rows, cfg.model.num_dense_features),
    sparse_features=KeyedJaggedTensor.from_lengths_sync(
        keys, torch.randint(0, 100, (rows * len(keys),)), torch.ones(rows * len(keys), dtype=torch.int32)
    ),
    labels=torch.randint(0, 2, (rows,)).float(),
)
grads = []
for model in (eager, compiled):
    loss = model(batch)[0]
    loss.backward()
    grads.append(torch.cat([p.grad.flatten() for n, p in model.named_parameters() if "embedding" not in n]))
print(json.dumps({"loss": loss.item(), "grad_difference": (grads[0] - grads[1]).abs().max().item()}))
"""

TIER = "integration"

NARROWER = {"AVX512": "avx2", "AVX2": "default"}


def _step(capability: str, cache: str, bf16: list[str]) -> dict[str, float]:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "ATEN_CPU_CAPABILITY": capability}
    result = subprocess.run(
        [sys.executable, "-c", STEP, *TINY, *bf16], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, (
        f"ATEN_CPU_CAPABILITY={capability}: exit {result.returncode}\n{result.stderr[-3000:]}"
    )
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() not in NARROWER, reason="needs an x86-64 CPU with AVX2 or AVX-512"
)
def test_a_compile_cache_written_on_a_wider_cpu_is_not_read_on_a_narrower_one(tmp_path):
    widest = torch.backends.cpu.get_cpu_capability()
    bf16 = ["--dense_precision", "bf16", "--compile_dense", "default"]
    steps = [_step(capability, str(tmp_path / "cache"), bf16) for capability in (widest.lower(), NARROWER[widest])]
    for step in steps:
        assert step["grad_difference"] < 1e-2 and torch.isfinite(torch.tensor(step["loss"]))
    assert any((tmp_path / "cache").iterdir())
