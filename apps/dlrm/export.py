"""Turn a training run's checkpoint into an inference package: ``python -m apps.dlrm.export --help``.

    python -m apps.dlrm.export --checkpoint_dir s3://bucket/ckpt --step best --output s3://bucket/pkg \\
        --quantize int8

One process, any machine with the memory for the whole model (see apps/dlrm/serving/export.py).
Exit status 2, with one line, for a bad option, checkpoint or output place.
"""

import logging
import sys

from apps.core.common.errors import ConfigError
from apps.core.training.report import setup_logging
from apps.dlrm.serving.config import parse_export_config
from apps.dlrm.serving.export import export

logger = logging.getLogger("apps.dlrm")


def main(argv: list[str] | None = None) -> None:
    cfg = parse_export_config(argv)
    setup_logging(rank=0)
    try:
        export(cfg)
    except ConfigError as e:
        logger.error("%s", e)
        sys.exit(2)


if __name__ == "__main__":
    main()
