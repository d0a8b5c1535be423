"""The TorchX component and app registry for distributed DLRM training on TorchRec.

Installs the packages that TorchX runs (``components``, ``apps``, ``schedulers``) so that
``torchx run components.dlrm:train`` resolves from any directory, our TorchX plugins
(``torchx_plugins``: ``-s aws_batch`` and named resources) and the ``[torchx.components]``
entry points that ``torchx builtins`` lists. The heavy, device-dependent dependencies
(torch, fbgemm-gpu or fbgemm-gpu-cpu, torchrec) are installed by ``scripts/install.sh``, which
picks the right builds for the machine; they are deliberately not listed here, so that pip never
drags the 2.7 GB CUDA fbgemm-gpu onto a CPU machine.
"""

from setuptools import find_packages, setup

setup(
    name="torchrec-dlrm-registry",
    version="0.1.0",
    description="TorchX components and apps for sharded DLRM and HSTU training with TorchRec",
    python_requires=">=3.10",
    packages=find_packages(include=["apps", "apps.*", "components", "components.*", "schedulers", "schedulers.*"])
    # Portions of TorchX's plugin namespace (no __init__.py): `-s aws_batch` and the Azure/GCP -h types.
    + ["torchx_plugins.schedulers", "torchx_plugins.named_resources"],
    entry_points={
        "torchx.components": [
            # `torchx builtins` lists ours as dlrm.train, ... and `torchx run dlrm.train` finds them.
            "dlrm = components.dlrm",
            "hstu = components.hstu",
            # Any [torchx.components] entry point replaces TorchX's built-ins (dist.ddp, utils.echo,
            # ...) unless they are registered too; the "_" prefix keeps their names unprefixed.
            "_torchx = torchx.components",
        ],
        # TorchX's commands that read a submitted job, saying a mistake in one line (schedulers/cli.py).
        "torchx.cli.cmds": [
            f"{command} = schedulers.cli:{command.capitalize()}"
            for command in ("status", "describe", "log", "cancel", "delete", "list")
        ],
    },
)
