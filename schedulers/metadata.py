"""Keys of a role's metadata that our schedulers read: components set them, schedulers act on
them. A module of its own, so that a component (imported at every ``torchx run``) sets them
without importing a scheduler, and with it TorchX's Docker and Slurm machinery."""

#: The key of a role's metadata that names the folder its logs go to, relative to the job's
#: working directory; TorchX's ``${app_id}`` in it is the job's id (read by schedulers/slurm.py).
LOG_DIR = "slurm/log_dir"
