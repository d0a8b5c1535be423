"""Score data in batch with an inference package or a checkpoint: ``python -m apps.dlrm.predict --help``.

    torchrun --nproc_per_node 2 -m apps.dlrm.predict --model s3://bucket/pkg --data parquet \\
        --data_path s3://bucket/candidates/ --output s3://bucket/scores/ --passthrough_columns row_id

Each rank scores its share of the files (see apps/dlrm/serving/predict.py); without torchrun it
is one process. Exit status 2, with one line, for a bad option, model, input or output place.
"""

from apps.core.common.startup import imports_uncollected
from apps.core.common.teardown import exit_without_teardown

with imports_uncollected():  # ~0.9 s of each rank's start (see the module)
    from torch.distributed.elastic.multiprocessing.errors import record

    from apps.core.common.distributed import exit_refused, init_distributed, leave_process_group
    from apps.core.common.errors import ConfigError
    from apps.core.training.report import setup_logging
    from apps.dlrm.serving.config import parse_predict_config
    from apps.dlrm.serving.predict import predict


@record  # a failing rank's traceback goes to torchrun's error file, which TorchX reports
def main(argv: list[str] | None = None) -> None:
    cfg = parse_predict_config(argv)
    env = init_distributed()
    setup_logging(env.rank)
    try:
        predict(cfg, env)
    except ConfigError as e:
        exit_refused(e, env)
    finally:
        leave_process_group()


if __name__ == "__main__":
    exit_without_teardown(main)
