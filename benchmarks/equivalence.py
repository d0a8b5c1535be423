"""Sharded training equals unsharded training: the same losses from the same weights and samples.

    python benchmarks/equivalence.py --nproc 2                       # DLRM, every sharding type
    python benchmarks/equivalence.py --nproc 1 --sharding_types row_wise --json out.json
    python benchmarks/equivalence.py --pooling mean --multi_hot_sizes 3,2,1,2,6,1,1,1,1,7,3,8,1,6,9,5,1,1,1,12,100,27,10,3,1,1
    python benchmarks/equivalence.py --app hstu                      # the HSTU, every type it admits

For each sharding type, ``--nproc`` ranks (GPUs when there are, float32 with TF32 off) train the
app's sharded model -- fused FBGEMM optimizers, TorchRec's pipeline and all-to-alls -- for a few
steps from given initial weights (one torchrun for all the types), and one process trains the
same weights unsharded on the same global batches, on the CPU, through the kernels that sharding
type runs (``unsharded_reference.py`` says which and why). Their per-step losses must agree to
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
from typing import Any, Callable, Iterator

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from apps.core.common.tables import Tables  # noqa: E402
from apps.core.common.teardown import exit_without_teardown  # noqa: E402
from apps.core.config import SHARDING_TYPES, SharedSections  # noqa: E402
from apps.core.options import to_argv  # noqa: E402
from apps.core.training.trainer import Trainer  # noqa: E402
from apps.dlrm import config as dlrm_config  # noqa: E402
from apps.dlrm import model as dlrm_model  # noqa: E402
from apps.dlrm.training.app import DLRM  # noqa: E402
from apps.hstu import config as hstu_config  # noqa: E402
from apps.hstu import model as hstu_model  # noqa: E402
from apps.hstu.training.app import HSTU  # noqa: E402
from benchmarks import cli  # noqa: E402
from benchmarks.unsharded_reference import DLRMReference, HSTUReference, UnshardedReference  # noqa: E402

STEPS = 20
#: Largest difference of a step's loss allowed. On a CPU both sides run the same kernels and agree
#: exactly; on GPUs the sharded side runs CUDA kernels and the reference the CPU's.
TOLERANCE = 1e-4
CPU = torch.device("cpu")


@dataclass(frozen=True)
class App:
    """What the check needs of an app: its config (``small``: the options of a model quick to
    train), its sharded side (``trainer_app``, ``build_model``) and its unsharded reference."""

    train_config: Callable[..., SharedSections]
    parse_train_config: Callable[[list[str]], SharedSections]
    build_model: Callable[..., torch.nn.Module]
    trainer_app: Any  # the TrainingApp the shared Trainer runs
    reference: Callable[[Any, dict[str, torch.Tensor], int], UnshardedReference]
    sharding_types: tuple[str, ...]
    small: dict[str, Any]

    @property
    def tables(self) -> Tables:
        return self.trainer_app.tables


APPS = {
    "dlrm": App(
        dlrm_config.train_config,
        dlrm_config.parse_train_config,
        lambda cfg: dlrm_model.build_model(cfg.model, CPU, table_device=CPU),
        DLRM,
        DLRMReference,
        tuple(t for t in SHARDING_TYPES if t != "auto"),
        dict(num_embeddings=500, batch_size=64),
    ),
    "hstu": App(
        hstu_config.train_config,
        hstu_config.parse_train_config,
        lambda cfg: hstu_model.build_model(cfg.model, CPU, table_device=CPU),
        HSTU,
        HSTUReference,
        tuple(t for t in SHARDING_TYPES if t != "auto" and t not in hstu_config.UNSHARDABLE),
        # The app's table rate (0.2) first throws the loss up (7.8 to 17 at step 2: row-wise
        # Adagrad's first steps are full-sized), then 20 steps bring it back only to 7.2; at 0.01
        # it falls to 6.0, so "learning" means learning.
        dict(num_items=500, batch_size=16, max_seq_len=20, num_layers=1, learning_rate=0.01),
    ),
}


@dataclass
class Comparison:
    sharding_type: str
    world_size: int
    plan: list[str]  # the sharding type of each table in the plan the ranks used
    sharded: list[float]
    reference: list[float]
    lean: bool  # whether the sharded side took the lean single-rank step (apps/core/training/lean.py)

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


def compare(
    sharding_type: str, world_size: int, workdir: str, steps: int = STEPS, app: str = "dlrm", **options: Any
) -> Comparison:
    """Trains ``sharding_type`` on ``world_size`` ranks and the unsharded reference; their losses.

    ``options`` are other JobConfig fields, the same on both sides (e.g. ``multi_hot_sizes``
    and ``pooling``: the sharded tables' pooling against EmbeddingBagCollection's own).
    """
    return compare_types([sharding_type], world_size, workdir, steps, app, **options)[0]


def compare_types(
    sharding_types: list[str], world_size: int, workdir: str, steps: int = STEPS, app: str = "dlrm", **options: Any
) -> list[Comparison]:
    """:func:`compare` of each of ``sharding_types``, their sharded runs in one torchrun."""
    spec = APPS[app]
    configs = [
        spec.train_config(**spec.small, sharding_type=kind, allow_tf32=False, output_dir="", **options)
        for kind in sharding_types
    ]
    torch.manual_seed(1234)
    init = spec.build_model(configs[0]).state_dict()
    init_path, out_path = os.path.join(workdir, "init.pt"), os.path.join(workdir, "losses.json")
    torch.save(init, init_path)
    cmd = cli.torchrun_command(
        world_size,
        os.path.abspath(__file__),
        "--worker",
        app,
        init_path,
        out_path,
        str(steps),
        ",".join(sharding_types),
        *to_argv(configs[0]),
    )
    threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
    result = subprocess.run(
        cmd, capture_output=True, text=True, cwd=REPO, env=cli.rank_env(OMP_NUM_THREADS=str(threads))
    )
    if result.returncode != 0:
        raise RuntimeError(f"sharded training failed (exit {result.returncode}):\n{result.stderr[-6000:]}")
    with open(out_path) as f:
        sharded = json.load(f)
    comparisons = []
    for kind, cfg in zip(sharding_types, configs):
        with torch_threads(threads):  # as many as each rank: the same matmul kernels
            reference = spec.reference(cfg, init, world_size)
            losses = [reference.step(step) for step in range(steps)]
        result = sharded[kind]
        comparisons.append(Comparison(kind, world_size, result["plan"], result["losses"], losses, result["lean"]))
    return comparisons


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Runs the block with ``count`` intra-op threads, then restores the caller's count."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def worker(app: str, init_path: str, out_path: str, steps: str, sharding_types: str, *app_args: str) -> None:
    """Under torchrun: trains ``app``'s sharded model from INIT with each of SHARDING_TYPES in
    turn and writes each step's loss and the plan's sharding types."""
    import torch.distributed as dist

    from apps.core.common.distributed import all_reduce_mean, init_distributed

    spec = APPS[app]
    env = init_distributed()
    init = torch.load(init_path, weights_only=True)
    results = {}
    for kind in sharding_types.split(","):
        trainer = Trainer(spec.trainer_app, spec.parse_train_config([*app_args, "--sharding_type", kind]), env)
        copy_into(trainer.model, init)
        batches = trainer.data.train_batches()
        losses = [all_reduce_mean(trainer.train_step(batches).item(), env) for _ in range(int(steps))]
        plan = [s.sharding_type for s in trainer.plan.plan[spec.tables.paths[0]].values()]
        results[kind] = {"losses": losses, "plan": plan, "lean": not trainer.not_lean}
        trainer.close()
    if env.is_main:
        cli.write_report(out_path, results)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> list[Comparison]:
    parser = cli.parser(__doc__)
    parser.add_argument("--app", default="dlrm", choices=sorted(APPS))
    cli.add_nproc(parser, "ranks of the sharded side")
    parser.add_argument("--sharding_types", default="", help="comma-separated; default: every type the app admits")
    cli.add_json(parser, "the results")
    parser.add_argument("--multi_hot_sizes", default="", help="DLRM: ids per sample of each of the 26 features")
    parser.add_argument("--pooling", default="", choices=dlrm_config.POOLINGS, help="DLRM: the tables' pooling")
    parser.add_argument("--worker", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.worker is not None:
        worker(*opts.worker)
        return []
    options: dict[str, Any] = {}
    if opts.pooling:
        options["pooling"] = opts.pooling
    if opts.multi_hot_sizes:
        options["multi_hot_sizes"] = [int(m) for m in opts.multi_hot_sizes.split(",")]
    if options and opts.app != "dlrm":
        parser.error(f"--{' and --'.join(options)} is a DLRM option: leave it out with --app {opts.app}")
    kinds = opts.sharding_types.split(",") if opts.sharding_types else list(APPS[opts.app].sharding_types)
    with tempfile.TemporaryDirectory() as workdir:
        results = compare_types(kinds, opts.nproc, workdir, app=opts.app, **options)
    for result in results:
        print(
            f"{opts.app} {result.sharding_type:15s} {opts.nproc} ranks: max loss difference {result.max_difference:.2e} over "
            f"{len(result.sharded)} steps: {'equal' if result.equal else 'DIFFERENT'}",
            flush=True,
        )
    cli.write_report(opts.json, [{**asdict(r), "max_difference": r.max_difference, "equal": r.equal} for r in results])
    if not all(r.equal for r in results):
        sys.exit(1)
    return results


if __name__ == "__main__":
    exit_without_teardown(main)
