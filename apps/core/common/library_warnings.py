"""The known-harmless warnings of the libraries under the apps, filtered in this one place, each
beside the reason it says nothing a user can act on. Each is matched by its source (a warning's
category, a log line's logger) and its message, so that any other warning of the same library
still shows. (A warning we can avoid at its cause is avoided there: the planner's storage
reservation, apps/core/training/sharding.py.)

:func:`filter_known_warnings` runs when the ``apps`` package is imported (apps/__init__.py): FBGEMM
logs one of them while it is being imported, which every command of ours does before it runs a
line of its own, so no later place would be early enough.
"""

import logging
import re
import warnings

#: Python warnings: (category, regex of the message's start, why it is harmless).
WARNINGS: tuple[tuple[type[Warning], str, str], ...] = (
    # torch's own deprecations, raised from inside TorchRec's DDP wrapper and collectives: calls
    # that TorchRec makes, not we.
    (Warning, r"`broadcast_buffers` is deprecated", "TorchRec's DDP wrapper passes it"),
    (Warning, r"`torch.distributed.reduce_scatter_tensor` is deprecated", "TorchRec's collectives call it"),
    (Warning, r"`torch.distributed.all_gather_into_tensor` is deprecated", "TorchRec's collectives call it"),
    (
        Warning,
        re.escape("Please use DTensor instead and we are deprecating ShardedTensor."),
        "TorchRec hands sharded tables to DCP as ShardedTensors, which torch deprecates on each "
        "use while saving and loading a checkpoint, once per call site and rank",
    ),
    (
        UserWarning,
        r"TBE B200 optimization: device_major=",
        "a debugging line that fbgemm-gpu 1.6.0 left in its embedding kernels' backward "
        "(codegen/training/backward/embedding_backward_split_template.cu, TORCH_WARN_ONCE, marked "
        "'remove after verification'): it says which segment length the kernel chose, on the "
        "first backward of every process; torch raises it as a UserWarning",
    ),
    (
        RuntimeWarning,
        re.escape("Error running: `sinfo --version` to get SLURM version."),
        "TorchX asks Slurm's version (sinfo) to write a GPU role's request, and warns where sinfo "
        "is missing: off the cluster, where only a dry run goes (a submission without Slurm's "
        "commands is refused in one line, schedulers/slurm.py). Such a dry run shows the request "
        "as Slurm before 24.11 reads it (--gpus-per-task), as docs/clusters.md says; a "
        "submission from a login node asks the cluster's own sinfo",
    ),
)

#: Log lines: (logger name, text the message contains, why it is harmless).
LOG_LINES: tuple[tuple[str, str, str], ...] = (
    (
        "root",
        "_fbgemm_torch_compat_table has no entry for",
        "fbgemm-gpu 1.6.0's table of the torch release each FBGEMM release goes with stops at 1.5, "
        "so importing it warns, once per shared library it loads (14 per process), that it "
        "cannot check torch's version; FBGEMM's releases pair 1.6 with torch 2.11, the row "
        "this project runs it on (1.8.0's table has the entry). Its other version warning, of a "
        "release the table pairs with another torch, still shows",
    ),
)


def _keep(record: logging.LogRecord) -> bool:
    """Whether a log record is none of LOG_LINES."""
    return not any(record.name == name and text in record.getMessage() for name, text, _ in LOG_LINES)


def filter_known_warnings() -> None:
    """Hides WARNINGS and LOG_LINES for the rest of this process; once however often it is called."""
    for category, pattern, _ in WARNINGS:
        warnings.filterwarnings("ignore", message=pattern, category=category)
    for name in {name for name, _, _ in LOG_LINES}:
        target = logging.getLogger(None if name == "root" else name)
        if _keep not in target.filters:
            target.addFilter(_keep)
