"""``python -m apps.dlrm.torchrun TORCHRUN_ARGS...``: torchrun for the DLRM's trainers, as every app
starts its trainers (:mod:`apps.core.torchrun`); its lines name this command."""

from apps.core import torchrun
from apps.dlrm.spec import SPEC

if __name__ == "__main__":
    torchrun.main(SPEC)
