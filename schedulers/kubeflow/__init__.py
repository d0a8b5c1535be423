"""``-s kubeflow``: TorchX apps as Kubeflow Trainer TrainJobs (``-cfg api=trainer``, the default: see
options.py for why) or the training operator's PyTorchJobs (``-cfg api=pytorchjob``), optionally queued
by Kueue (``-cfg queue=LOCAL_QUEUE``).

TorchX's own ``-s kubernetes`` submits a Volcano job; most clusters that train PyTorch run the Kubeflow
training operator or Kubeflow Trainer instead, with Kueue for quotas. This scheduler, registered through
TorchX's plugin registry (``torchx_plugins/schedulers/dlrm_kubeflow.py``), turns the same AppDef
(``components.dlrm:train``) into their objects, so those clusters need no hand-written YAML:

- ``options.py``: the run options, checked;
- ``pods.py``: a role's pod template (TorchX's ``role_to_pod``, fitted to the operators);
- ``kinds.py``, ``pytorchjob.py``, ``trainjob.py``: each kind's object, and its status as TorchX states;
- ``scheduler.py``: the scheduler, talking to the Kubernetes API.

``torchx run --dryrun -s kubeflow ...`` prints the object; ``-cfg output=FILE`` also writes it, so that
``kubectl apply -f FILE`` (or a GitOps repository) creates the object ``torchx run`` would.
"""
