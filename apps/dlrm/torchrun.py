"""torchrun, with this host's address and network interface chosen for multi-node jobs.

    python -m apps.dlrm.torchrun TORCHRUN_ARGS...

takes torchrun's own arguments and runs torchrun (``torch.distributed.run``) in this process.
For a job of more than one node it first completes them with how the other hosts reach this one
(:mod:`apps.dlrm.launch.torchrun_args`: ``--local_addr``, ``--rdzv_conf is_host=1``,
``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME``), which torchrun and the trainers would
otherwise guess from the hostname, wrongly wherever it resolves to loopback. What the user set is
kept. The components run every trainer through it (components/launch.py).
"""

import logging
import os
import socket
import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main as torchrun_main

from apps.dlrm.common.errors import ConfigError
from apps.dlrm.launch.torchrun_args import multi_node_args

logger = logging.getLogger("apps.dlrm.torchrun")


def main(argv: list[str] | None = None) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s", "%H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        args, variables = multi_node_args(args, dict(os.environ))
    except ConfigError as e:
        sys.exit(f"apps.dlrm.torchrun: {e}")
    os.environ.update(variables)
    try:
        torchrun_main(args)
    except ChildFailedError as e:
        # The trainer printed its error (and @record gave TorchX its traceback): one line here,
        # not torchrun's traceback and failure table under it.
        rank, failure = e.get_first_failure()
        sys.exit(
            f"apps.dlrm.torchrun: {e.name} failed on {socket.gethostname()}: rank {rank} exited "
            f"with {failure.exitcode}; its error is above"
        )


if __name__ == "__main__":
    main()
