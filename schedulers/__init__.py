"""Schedulers TorchX lacks (``aws_batch``); torchx_plugins/ registers them with TorchX."""
