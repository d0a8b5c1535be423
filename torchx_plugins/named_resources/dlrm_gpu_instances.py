"""GPU instance types of Azure and Google Cloud as TorchX named resources (``-h``).

The AWS types we train on (``aws_p4d.24xlarge``, ``aws_p4de.24xlarge``, ``aws_p5.48xlarge``)
already ship with TorchX (``torchx.specs.named_resources_aws``) with the right vCPUs, GPUs,
memory and EFA interfaces, so they are not registered again here: a plugin registered under
the same name silently replaces TorchX's definition (plugins are merged last), and a copy
would drift from upstream's fixes.

Memory is what a pod can request, not what the VM has: a Kubernetes node's allocatable
memory is its capacity minus kubelet/system reservations and the eviction threshold (about 3%
on GKE and AKS for hosts this size), so a request for the full capacity would never be
scheduled. ``node.kubernetes.io/instance-type`` is the node label the kubernetes scheduler
turns into a node selector.
"""

from torchx.plugins import register
from torchx.specs import GiB, Resource
from torchx.specs.named_resources_aws import K8S_ITYPE

#: Fraction of a VM's memory left to pods once Kubernetes has reserved its share.
ALLOCATABLE_MEMORY = 0.96


def _gpu_vm(instance_type: str, *, vcpus: int, gpus: int, mem_gib: int) -> Resource:
    return Resource(
        cpu=vcpus,
        gpu=gpus,
        memMB=int(mem_gib * GiB * ALLOCATABLE_MEMORY),
        capabilities={K8S_ITYPE: instance_type},
    )


@register.named_resource(name="azure_nd96asr_v4")
def azure_nd96asr_v4() -> Resource:
    # 8x A100 40GB (NVLink 3), 96 vCPUs (AMD EPYC 7V12), 900 GiB; 8x 200 Gb/s HDR InfiniBand
    # (not EFA: NCCL uses it through the host's IB verbs, no device plugin to request).
    return _gpu_vm("Standard_ND96asr_v4", vcpus=96, gpus=8, mem_gib=900)


@register.named_resource(name="gcp_a2-highgpu-8g")
def gcp_a2_highgpu_8g() -> Resource:
    # 8x A100 40GB, 96 vCPUs, 680 GB (Compute Engine's GB are GiB).
    return _gpu_vm("a2-highgpu-8g", vcpus=96, gpus=8, mem_gib=680)


@register.named_resource(name="gcp_a3-highgpu-8g")
def gcp_a3_highgpu_8g() -> Resource:
    # 8x H100 80GB, 208 vCPUs, 1872 GB; GPUDirect-TCPX NICs, no EFA.
    return _gpu_vm("a3-highgpu-8g", vcpus=208, gpus=8, mem_gib=1872)
