"""The Kubernetes API as kubectl reaches it, for ``-s kubeflow`` and ``-s kubernetes``: the pod's
service account inside a cluster, else the kubeconfig (``KUBECONFIG``, ``~/.kube/config``) and its
current context. Without one, a one-line SetupError saying where it was looked for."""

import os

import yaml
from kubernetes import client, config

from schedulers.setup_checks import SetupError, first_line


def api_client(scheduler: str, fix: str = "") -> client.ApiClient:
    """A client of the cluster kubectl would talk to; ``fix`` ("; ...") adds another way out of
    having none (e.g. what a dry run can do without a cluster)."""
    configuration = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)
    except config.ConfigException:
        # The client reads KUBECONFIG when it is imported; a process may set it later.
        path = os.environ.get("KUBECONFIG")
        try:
            config.load_kube_config(config_file=path, client_configuration=configuration)
        except (config.ConfigException, OSError, yaml.YAMLError) as e:
            # The first line only: YAML errors go on to quote the file, which may hold a token.
            where = f"KUBECONFIG={path}" if path else "~/.kube/config"
            raise SetupError(
                f"-s {scheduler} finds no Kubernetes cluster to talk to in {where} ({first_line(e)}): set "
                f"KUBECONFIG to kubectl's kubeconfig file, or write ~/.kube/config{fix}"
            ) from None
    return client.ApiClient(configuration)
