"""``python -m apps.hstu.torchrun TORCHRUN_ARGS...``: torchrun for the HSTU's trainers, as every app
starts its trainers (:mod:`apps.core.torchrun`); its lines name this command."""

from apps.core import torchrun
from apps.hstu.spec import SPEC

if __name__ == "__main__":
    torchrun.main(SPEC)
