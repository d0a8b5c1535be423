"""Process group and device of this rank: NCCL on GPUs, gloo on CPUs."""

import datetime
import json
import logging
import os
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, NoReturn, TypeVar

import torch
import torch.distributed as dist

from apps.core.common.errors import REFUSED

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def num_nodes(self) -> int:
        return max(1, self.world_size // self.local_world_size)


def init_distributed(timeout_s: int = 600) -> DistEnv:
    """Joins the process group that torchrun describes in the environment.

    Without torchrun (``python -m apps.dlrm.train``) the app runs as a world of one process.
    """
    if "RANK" not in os.environ:
        os.environ.update(
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
            LOCAL_WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()),
        )
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if backend == "nccl" else None,
        )
    env = DistEnv(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())),
        device=device,
        backend=backend,
    )
    logger.debug("rank %d/%d on %s (%s)", env.rank, env.world_size, device, backend)
    return env


def restarts_left() -> int:
    """How many more times torchrun restarts this node's trainers if they fail now (``--max_restarts``
    less the restarts so far); 0 outside torchrun."""
    return int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0)) - int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))


#: How long a rank other than 0 waits before it exits on a refused option or data, where no
#: launcher of ours quotes the refusal (plain torchrun, or no torchrun at all).
MAIN_RANK_GRACE_SECONDS = 5
#: Set by the apps' torchrun (apps/core/torchrun.py) for its trainers: a folder where a rank
#: leaves its refused option or data, in a file named by its pid, for the launcher to quote.
REFUSALS_FOLDER = "APPS_REFUSALS_FOLDER"


def refusal_file(folder: str, pid: int) -> str:
    """Where the rank of process ``pid`` leaves its refusal in ``folder``."""
    return os.path.join(folder, f"{pid}.txt")


def record_refusal(message: str) -> None:
    """Writes ``message``, a refusal's one line, as this process's error in torchrun's error file
    (``TORCHELASTIC_ERROR_FILE``, the schema of torch's ``@record``): torchrun copies a failed
    trainer's into its own, which TorchX reads (``torchx status``'s ``structured_error_msg``).
    Nothing where no launcher asked for one."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    error = {"message": message, "errorCode": REFUSED, "extraInfo": {"timestamp": str(int(time.time()))}}
    with open(path, "w") as f:
        json.dump({"message": error}, f)


def exit_refused(error: Exception, env: DistEnv) -> NoReturn:
    """Ends this rank on a refused option or data (exit :data:`REFUSED`), said in one line for
    the whole job, which is also the rank's recorded error (:func:`record_refusal`).

    Under the apps' torchrun, the rank leaves the line for the launcher, which quotes the rank that
    stopped the job, whichever rank that is and on whichever host. Elsewhere rank 0 logs it, and
    the others wait a few seconds first: torchrun quotes the first rank to exit, and rank 0, which
    says why (it meets the same error, or is stopped anyway), should be that one."""
    record_refusal(str(error))
    folder = os.environ.get(REFUSALS_FOLDER)
    if folder:
        with open(refusal_file(folder, os.getpid()), "w") as f:
            f.write(str(error))
    elif env.is_main:
        logger.error("%s", error)
    else:
        time.sleep(MAIN_RANK_GRACE_SECONDS)
    sys.exit(REFUSED)


def leave_process_group() -> None:
    """A rank's last act: leaves its process group. (Its commands then end the process without
    the interpreter's teardown: :mod:`apps.core.common.teardown`.)"""
    dist.destroy_process_group()


def free_port() -> int:
    """A TCP port on loopback that is free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def all_reduce_mean(value: float, env: DistEnv) -> float:
    """The mean of a Python float over all ranks."""
    tensor = torch.tensor([value], dtype=torch.float64, device=env.device)
    dist.all_reduce(tensor)
    return tensor.item() / env.world_size


def decided_by_main(decide: Callable[[], T], env: DistEnv) -> T:
    """Runs ``decide`` on rank 0 only and gives every rank its result, or raises its error.

    For choices every rank must agree on (which checkpoint to resume from) and checks that
    should run once (can the checkpoint location be written), without racing each other.
    """
    box: list[Any] = [None]
    if env.is_main:
        try:
            box[0] = ("ok", decide())
        except Exception as e:  # noqa: BLE001 - re-raised on every rank below
            box[0] = ("error", e)
    dist.broadcast_object_list(box, src=0)
    status, value = box[0]
    if status == "error":
        raise value
    return value


def gather_rows(rows: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Every rank's ``rows`` (their counts may differ), concatenated in rank order."""
    if not (dist.is_available() and dist.is_initialized()):
        return rows
    world = dist.get_world_size(group)
    count = torch.tensor([rows.shape[0]], device=rows.device)
    counts = [torch.zeros_like(count) for _ in range(world)]
    dist.all_gather(counts, count, group=group)
    longest = int(max(c.item() for c in counts))
    padded = torch.zeros(longest, *rows.shape[1:], dtype=rows.dtype, device=rows.device)
    padded[: rows.shape[0]] = rows
    gathered = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)
    return torch.cat([g[: int(c.item())] for g, c in zip(gathered, counts)])
