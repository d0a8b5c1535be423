"""Training, shared by every app: the Trainer that owns a run (trainer.py) and what an app plugs
into it (app.py), the optimizers and learning-rate schedule (optim.py), the sharding plan and
sharded model (sharding.py), what a run reports (report.py) and where (run_folder.py), how long
it runs (run_length.py), its validations (validations.py), throughput (metrics.py) and the
options that need GPUs (device_support.py)."""
