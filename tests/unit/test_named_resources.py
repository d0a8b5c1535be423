"""Instance types as named resources (``-h``), their NCCL/EFA presets, and bad ``-h``/``-j``."""

import os

import pytest
from torchx import plugins, specs
from torchx.specs import named_resources_aws, named_resources_generic
from torchx.specs.named_resources_aws import EFA_DEVICE, K8S_ITYPE

from components import dlrm
from components.launch import DEFAULT_ENV, EFA_ENV, EFA_RDMA_ENV
from components.signature import InvalidComponentArgument
from tests.conftest import BIN, run

# Tier (tests/conftest.py): pure logic, fast.
TIER = "unit"

# The vendors' published figures: vCPUs, GPUs, memory (GiB), EFA interfaces, instance type.
INSTANCE_TYPES = {
    "aws_p4d.24xlarge": (96, 8, 1152, 4, "p4d.24xlarge"),
    "aws_p4de.24xlarge": (96, 8, 1152, 4, "p4de.24xlarge"),
    "aws_p5.48xlarge": (192, 8, 2048, 32, "p5.48xlarge"),
    "azure_nd96asr_v4": (96, 8, 900, 0, "Standard_ND96asr_v4"),
    "gcp_a2-highgpu-8g": (96, 8, 680, 0, "a2-highgpu-8g"),
    "gcp_a3-highgpu-8g": (208, 8, 1872, 0, "a3-highgpu-8g"),
}


@pytest.mark.parametrize("name", INSTANCE_TYPES)
def test_instance_type_resolves_with_the_published_figures(name):
    vcpus, gpus, mem_gib, efa, instance_type = INSTANCE_TYPES[name]
    resource = specs.resource(h=name)
    assert (resource.cpu, resource.gpu) == (vcpus, gpus)
    # What a job may ask for: a little less than the machine has (the OS, the ECS agent or the
    # kubelet keep some), never more, or the job would wait for a host that never comes.
    assert 0.9 * mem_gib * 1024 <= resource.memMB < mem_gib * 1024
    assert resource.devices.get(EFA_DEVICE, 0) == efa
    assert resource.capabilities[K8S_ITYPE] == instance_type


def test_our_plugin_registers_cleanly_and_shadows_none_of_torchxs_types():
    registry = plugins.registry()
    ours = registry.get(plugins.PluginType.NAMED_RESOURCE)
    assert {"azure_nd96asr_v4", "gcp_a2-highgpu-8g", "gcp_a3-highgpu-8g"} <= set(ours)
    assert registry.load_errors(plugins.PluginType.NAMED_RESOURCE) == []
    # A plugin's name silently replaces TorchX's own definition of it.
    assert not set(ours) & (set(named_resources_aws.NAMED_RESOURCES) | set(named_resources_generic.NAMED_RESOURCES))


def role_env(**kwargs) -> dict[str, str]:
    (role,) = dlrm.train(**kwargs).roles
    return role.env


def test_aws_gpu_types_get_the_nccl_efa_presets():
    env = role_env(j="2x8", h="aws_p4d.24xlarge")
    assert env.items() >= {**DEFAULT_ENV, **EFA_ENV, **EFA_RDMA_ENV}.items()
    # EFA without GPUDirect RDMA: libfabric would refuse FI_EFA_USE_DEVICE_RDMA=1.
    env = role_env(j="2x8", h="aws_g5.48xlarge")
    assert env.items() >= EFA_ENV.items() and not env.keys() & EFA_RDMA_ENV.keys()
    # No EFA, no GPUs, or no -h: no presets.
    for kwargs in [dict(j="2x8", h="gcp_a3-highgpu-8g"), dict(j="2x4", h="aws_m5.2xlarge"), dict(j="2x2")]:
        assert not role_env(**kwargs).keys() & (EFA_ENV.keys() | EFA_RDMA_ENV.keys()), kwargs
    # The user's env wins over a preset.
    assert role_env(j="1x8", h="aws_p5.48xlarge", env={"NCCL_PROTO": "LL128"})["NCCL_PROTO"] == "LL128"


def test_named_resource_sizes_the_role_and_a_bare_j_counts_nodes():
    (role,) = dlrm.train(j="2", h="aws_p5.48xlarge").roles
    assert (role.num_replicas, role.resource.cpu, role.resource.gpu) == (2, 192, 8)
    assert "--nnodes 2 --nproc_per_node 8" in role.args[1]


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (
            dict(h="aws_p4d.24xl"),
            "-h 'aws_p4d.24xl' is not a known instance type. No named resource found for "
            "`aws_p4d.24xl`. Did you mean `aws_p4d.24xlarge`?",
        ),
        (
            dict(j="2x16", h="aws_p4d.24xlarge"),
            "-j '2x16' asks for 16 processes per node but -h aws_p4d.24xlarge "
            "has 8 GPUs: use at most one process per GPU (e.g. -j 2x8)",
        ),
        (dict(j="3", h="aws_m5.2xlarge"), "-j '3' gives no processes per node and -h aws_m5.2xlarge has no GPUs"),
    ],
)
def test_bad_instance_type_or_job_size_is_refused_before_anything_is_built(kwargs, fragment):
    with pytest.raises(InvalidComponentArgument) as error:
        dlrm.train(**kwargs)
    assert fragment in str(error.value)


def test_torchx_refuses_more_processes_than_gpus_without_a_traceback():
    result = run(
        [
            os.path.join(BIN, "torchx"),
            "run",
            "--dryrun",
            "-s",
            "local_cwd",
            "components.dlrm:train",
            "-j",
            "2x9",
            "-h",
            "gcp_a2-highgpu-8g",
        ],
        timeout=120,
    )
    assert result.returncode == 1
    assert "-j '2x9' asks for 9 processes per node but -h gcp_a2-highgpu-8g has 8 GPUs" in result.stderr
    assert "Traceback" not in result.stderr
