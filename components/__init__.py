"""TorchX components of the DLRM registry: ``torchx run components.dlrm:train``."""
