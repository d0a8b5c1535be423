"""Scheduler plugins and named resources that TorchX needs beyond its built-ins."""
