"""How a training job is shaped and started: the ``-j``/``-h`` grammar (:mod:`.job_shape`), the
cluster the planner plans for (:mod:`.target`), what ``python -m apps.<app>.torchrun``
(apps/core/torchrun.py) adds to torchrun's arguments on each host (:mod:`.torchrun_args`, with
the address and interface :mod:`.network` picks), and the one line its agent says when trainers
fail (:mod:`.agent`). The commands themselves stay at the top of each app (apps/dlrm, apps/hstu)."""
