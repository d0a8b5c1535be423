"""Preprocess Criteo TSV click logs for training: ``python -m apps.dlrm.preprocess --help``.

    python -m apps.dlrm.preprocess --input /data/criteo/ --output /data/criteo_npy \\
        --table_size_preset mlperf
    torchrun --nproc_per_node 8 -m apps.dlrm.train --data criteo --data_path /data/criteo_npy \\
        --table_size_preset mlperf

The layout of the output is documented in :mod:`apps.dlrm.data.criteo.layout`; how bad lines are
handled in :mod:`apps.dlrm.data.criteo.parse`. Exit status: 0 when every input file is converted,
1 when some failed (the others are complete and a rerun converts only what is missing), 2 for
a bad option.
"""

import logging
import sys

from apps.core.common.errors import ConfigError
from apps.core.training.report import redacting_handler
from apps.dlrm.data.criteo.config import parse_preprocess_config
from apps.dlrm.data.criteo.pipeline import PreprocessFailed, preprocess

logger = logging.getLogger("apps.dlrm.preprocess")


def main(argv: list[str] | None = None) -> None:
    cfg = parse_preprocess_config(argv)
    logging.basicConfig(level=logging.INFO, handlers=[redacting_handler("%(asctime)s %(levelname)s %(message)s")])
    try:
        preprocess(cfg)
    except ConfigError as e:
        logger.error("%s", e)
        sys.exit(2)
    except PreprocessFailed as e:
        logger.error("%s", e)
        sys.exit(1)


if __name__ == "__main__":
    main()
