"""Sharded training equals unsharded training: the same losses from the same weights and samples.

    python benchmarks/equivalence.py --nproc 2                       # every sharding type
    python benchmarks/equivalence.py --nproc 1 --sharding_types row_wise --json out.json
    python benchmarks/equivalence.py --pooling mean --multi_hot_sizes 3,2,1,2,6,1,1,1,1,7,3,8,1,6,9,5,1,1,1,12,100,27,10,3,1,1

For each sharding type, ``--nproc`` ranks (GPUs when there are, float32 with TF32 off) train the
app's sharded model -- fused FBGEMM optimizers, TorchRec's pipeline and all-to-alls -- for a few
steps from given initial weights, and one process trains the same weights unsharded on the same
global batches, on the CPU, through the kernels that sharding type runs
(``unsharded_reference.py`` says which and why). Their per-step losses must agree to
``TOLERANCE``; on a CPU they agree exactly. Prints one line per sharding type; exits 1 if any
differs.
"""

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from typing import Iterator

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from apps.core.config import SHARDING_TYPES  # noqa: E402
from apps.core.options import to_argv  # noqa: E402
from apps.dlrm.config import POOLINGS, train_config  # noqa: E402
from apps.dlrm.model import build_model  # noqa: E402
from benchmarks.unsharded_reference import reference_losses  # noqa: E402

STEPS = 20
#: Largest difference of a step's loss allowed. On a CPU both sides run the same kernels and agree
#: exactly; on GPUs the sharded side runs CUDA kernels and the reference the CPU's.
TOLERANCE = 1e-4


@dataclass
class Comparison:
    sharding_type: str
    world_size: int
    plan: list[str]  # the sharding type of each table in the plan the ranks used
    sharded: list[float]
    reference: list[float]

    @property
    def max_difference(self) -> float:
        return max(abs(a - b) for a, b in zip(self.sharded, self.reference))

    @property
    def equal(self) -> bool:
        return (
            len(self.sharded) == len(self.reference)
            and set(self.plan) == {self.sharding_type}
            and self.max_difference <= TOLERANCE
            and self.learning
        )

    @property
    def learning(self) -> bool:
        """Whether the loss falls (equal losses from a model that learns nothing prove little): the
        mean of the last quarter of the steps against the first's, since one batch's loss is noisy."""
        quarter = max(1, len(self.reference) // 4)
        return sum(self.reference[-quarter:]) < sum(self.reference[:quarter])


def shard_pieces(tensor: torch.Tensor) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """(offsets, local tensor) of every piece of ``tensor`` this rank holds."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if isinstance(tensor, ShardedTensor):
        return [(tuple(s.metadata.shard_offsets), s.tensor) for s in tensor.local_shards()]
    return [((0,) * tensor.dim(), tensor)]


def copy_into(model: torch.nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Copies whole (unsharded) weights into the pieces of the model this rank holds."""
    state = model.state_dict()
    if set(state) != set(full):
        raise ValueError(f"weights do not match the model: {sorted(set(state) ^ set(full))}")
    with torch.no_grad():
        for name, tensor in state.items():
            for offsets, piece in shard_pieces(tensor):
                index = tuple(slice(o, o + n) for o, n in zip(offsets, piece.shape))
                piece.copy_(full[name][index])


def compare(sharding_type: str, world_size: int, workdir: str, steps: int = STEPS, **options) -> Comparison:
    """Trains ``sharding_type`` on ``world_size`` ranks and the unsharded reference; their losses.

    ``options`` are other TrainConfig fields, the same on both sides (e.g. ``multi_hot_sizes``
    and ``pooling``: the sharded tables' pooling against EmbeddingBagCollection's own).
    """
    cfg = train_config(
        num_embeddings=500, batch_size=64, sharding_type=sharding_type, allow_tf32=False, output_dir="", **options
    )
    torch.manual_seed(1234)
    init = build_model(cfg.model, torch.device("cpu"), table_device=torch.device("cpu")).state_dict()
    init_path, out_path = os.path.join(workdir, "init.pt"), os.path.join(workdir, "losses.json")
    torch.save(init, init_path)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(world_size),
        os.path.abspath(__file__),
        "--worker",
        init_path,
        out_path,
        str(steps),
        *to_argv(cfg),
    ]
    threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
    result = subprocess.run(
        cmd, capture_output=True, text=True, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": str(threads)}
    )
    if result.returncode != 0:
        raise RuntimeError(f"sharded training failed (exit {result.returncode}):\n{result.stderr[-6000:]}")
    with open(out_path) as f:
        sharded = json.load(f)
    with torch_threads(threads):  # as many as each rank: the same matmul kernels
        reference = reference_losses(cfg, init, world_size, steps)
    return Comparison(sharding_type, world_size, sharded["plan"], sharded["losses"], reference)


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Runs the block with ``count`` intra-op threads, then restores the caller's count."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def worker(init_path: str, out_path: str, steps: str, *app_args: str) -> None:
    """Under torchrun: trains the app's sharded model from INIT and writes each step's loss."""
    import torch.distributed as dist

    from apps.core.common.distributed import all_reduce_mean, init_distributed
    from apps.dlrm.config import parse_train_config
    from apps.dlrm.model import EBC_PATH
    from apps.dlrm.training.app import Trainer

    cfg = parse_train_config(list(app_args))
    env = init_distributed()
    trainer = Trainer(cfg, env)
    copy_into(trainer.model, torch.load(init_path, weights_only=True))
    batches = trainer.data.train_batches()
    losses = [all_reduce_mean(trainer.train_step(batches).item(), env) for _ in range(int(steps))]
    if env.is_main:
        with open(out_path, "w") as f:
            json.dump({"losses": losses, "plan": [s.sharding_type for s in trainer.plan.plan[EBC_PATH].values()]}, f)
    trainer.close()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> list[Comparison]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2, help="ranks of the sharded side")
    parser.add_argument("--sharding_types", default=",".join(t for t in SHARDING_TYPES if t != "auto"))
    parser.add_argument("--json", default="", help="also write the results to this file")
    parser.add_argument("--multi_hot_sizes", default="", help="ids per sample of each of the 26 features")
    parser.add_argument("--pooling", default="sum", choices=POOLINGS)
    parser.add_argument("--worker", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.worker is not None:
        worker(*opts.worker)
        return []
    options = dict(pooling=opts.pooling, multi_hot_sizes=[int(m) for m in opts.multi_hot_sizes.split(",") if m])
    results = []
    for sharding_type in opts.sharding_types.split(","):
        with tempfile.TemporaryDirectory() as workdir:
            result = compare(sharding_type, opts.nproc, workdir, **options)
        results.append(result)
        print(
            f"{sharding_type:15s} {opts.nproc} ranks: max loss difference {result.max_difference:.2e} over "
            f"{len(result.sharded)} steps: {'equal' if result.equal else 'DIFFERENT'}",
            flush=True,
        )
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(
                [{**asdict(r), "max_difference": r.max_difference, "equal": r.equal} for r in results], f, indent=2
            )
    if not all(r.equal for r in results):
        sys.exit(1)
    return results


if __name__ == "__main__":
    main()
