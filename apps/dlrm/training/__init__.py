"""Training: the Trainer that owns a run (trainer.py), the optimizers and learning-rate schedule
(optim.py), the sharding plan and sharded model (sharding.py), metrics synced across ranks
(metrics.py), what a run reports (report.py) and the options that need GPUs (device_support.py)."""
