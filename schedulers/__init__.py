"""Schedulers TorchX needs beyond its built-ins, registered as plugins in torchx_plugins/:
``aws_batch`` (removed from torchx-nightly), ``slurm`` (TorchX's own, with job status that works
on Slurm 22.05 and later) and ``kubeflow`` (Kubeflow PyTorchJob or TrainJob, queued by Kueue)."""
