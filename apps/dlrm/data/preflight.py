"""The data's own checks, run where a job is submitted, before it is.

A training job opens its data only once torchrun, the process group and the model are up: 20-30 s
on a laptop, a queue's wait on a cluster. Data that cannot serve the options (a Criteo folder
preprocessed for larger tables, a Parquet column that is not there, ids out of range) is then
refused late and far from the command. Where ``--data_path`` is on the submitting machine (always
under ``-s local_cwd``; on a shared filesystem under Slurm), the loaders' own checks read the same
facts now: a Criteo folder's manifest and arrays, the Parquet files' footers (schemas, column
statistics and row counts, not their data). A path that is not here (it may exist only on the cluster) and URLs
(an object store may need credentials that only the cluster has) are left to the job.
"""

from apps.core.urls import is_here, is_url
from apps.dlrm.config import DataConfig, ModelConfig


def check_local_data(model: ModelConfig, data: DataConfig) -> list[str]:
    """Raises the loader's ConfigError for local data (of the data section) that the model
    section cannot train on; quick (metadata only), and silent for synthetic data and URLs.
    Returns the paths the job reads that this machine does not have (for a scheduler that runs
    the job here to refuse)."""
    data_path = data.data_path
    if data.data == "synthetic" or is_url(data_path):
        return []
    if not is_here(data_path):
        return [f"--data_path {data_path}"]
    local = data_path.removeprefix("file://")
    if data.data == "criteo":
        # Imported on use: the components import this module, and most jobs need neither reader.
        from apps.dlrm.data.criteo.layout import check_table_sizes, open_folder

        manifest, _ = open_folder(local)
        check_table_sizes(manifest["num_embeddings_per_feature"], model.table_sizes, local)
    else:
        from apps.dlrm.data.parquet.files import CheckedFiles

        CheckedFiles.open(model, data).splits(data)
    return []
