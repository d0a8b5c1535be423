"""A Kubernetes API server on loopback that stands in for a cluster with the Kubeflow operators, for
the tests of ``-s kubeflow``'s CLI verbs.

No kube-apiserver can be installed from the registries this machine reaches (only etcd and kubectl),
so this one answers, over real HTTP, the REST calls the ``kubernetes`` client makes for them: create,
get, list (label selectors) and delete (foreground deletion keeps the object, marked, until
``finish_deletion``) custom objects; list pods; read a pod's log (timestamps, follow). Errors are the
API server's Status objects: 404 for a missing object, and for a resource whose CRD is not installed;
409 for a name taken; 401 without the kubeconfig's token. Every request is recorded.

What the operators write is replayed from tests/kubeflow_responses/: a job's ``status`` at each stage,
the pods they create (with their labels) and the pods' logs. Those files are written from the
operators' source (training-operator v1.9's and Kubeflow Trainer v2.3's controllers, whose condition
types, reasons and messages they quote), not captured from a running cluster.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterator
from urllib.parse import parse_qs, urlparse

import yaml

RESPONSES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kubeflow_responses")
TOKEN = "kubeflow-test-token-3c9f"  # the kubeconfig's bearer token; never to be printed
CREATED = "2026-11-23T10:00:00Z"

#: The custom resources a cluster with both operators serves: (group, version, plural) -> kind.
OPERATOR_KINDS = {
    ("kubeflow.org", "v1", "pytorchjobs"): "PyTorchJob",
    ("trainer.kubeflow.org", "v1alpha1", "trainjobs"): "TrainJob",
}
_CUSTOM = re.compile(
    r"^/apis/(?P<group>[^/]+)/(?P<version>[^/]+)/namespaces/(?P<ns>[^/]+)/(?P<plural>[^/]+)(?:/(?P<name>[^/]+))?$"
)
_PODS = re.compile(r"^/api/v1/namespaces/(?P<ns>[^/]+)/pods$")
_LOG = re.compile(r"^/api/v1/namespaces/(?P<ns>[^/]+)/pods/(?P<name>[^/]+)/log$")


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, str]
    body: Any


@dataclass
class FakeCluster:
    """The cluster's state, which tests read and set (the operators' part) directly."""

    url: str = ""
    kinds: dict[tuple[str, str, str], str] = field(default_factory=lambda: dict(OPERATOR_KINDS))
    objects: dict[tuple[str, str, str], dict[str, Any]] = field(default_factory=dict)  # (plural, ns, name)
    pods: list[dict[str, Any]] = field(default_factory=list)
    logs: dict[tuple[str, str], str] = field(default_factory=dict)  # (pod, container) -> timestamped lines
    requests: list[Request] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def kubeconfig(self, path: str) -> str:
        """A kubeconfig file (as ``kubectl config view`` writes one) for this server; returns its path."""
        with open(path, "w") as f:
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
                    "users": [{"name": "trainer", "user": {"token": TOKEN}}],
                    "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "trainer"}}],
                    "current-context": "fake",
                },
                f,
            )
        return path

    def operator_writes(self, plural: str, namespace: str, name: str, recorded: str) -> None:
        """Replays tests/kubeflow_responses/RECORDED.json for job ``name``: its status, pods and logs."""
        with open(os.path.join(RESPONSES, f"{recorded}.json")) as f:
            text = f.read().replace("<name>", name).replace("<namespace>", namespace)
        response = json.loads(text)
        with self.lock:
            self.objects[(plural, namespace, name)]["status"] = response["status"]
            self.pods = [p for p in self.pods if not p["metadata"]["name"].startswith(f"{name}-")]
            self.pods += response.get("pods", [])
            self.logs.update({tuple(key.split("/")): text for key, text in response.get("logs", {}).items()})

    def finish_deletion(self, plural: str, namespace: str, name: str) -> None:
        """What the garbage collector does once a foreground deletion's dependents are gone."""
        with self.lock:
            del self.objects[(plural, namespace, name)]
            self.pods = [p for p in self.pods if not p["metadata"]["name"].startswith(f"{name}-")]

    def sent(self, method: str, kind_path: str) -> list[Request]:
        return [r for r in self.requests if r.method == method and kind_path in r.path]


@contextlib.contextmanager
def fake_cluster() -> Iterator[FakeCluster]:
    """A FakeCluster served on a free port of 127.0.0.1 until the block ends."""
    cluster = FakeCluster()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(cluster))
    cluster.url = f"http://127.0.0.1:{server.server_port}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield cluster
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def _handler(cluster: FakeCluster) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:  # quiet
            pass

        def do_GET(self) -> None:
            self._serve("GET")

        def do_POST(self) -> None:
            self._serve("POST")

        def do_DELETE(self) -> None:
            self._serve("DELETE")

        def _serve(self, method: str) -> None:
            url = urlparse(self.path)
            query = {key: values[-1] for key, values in parse_qs(url.query).items()}
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length)) if length else None
            with cluster.lock:
                cluster.requests.append(Request(method, url.path, query, body))
                if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                    status, reply = _status(401, "Unauthorized", "Unauthorized")
                else:
                    status, reply = _route(cluster, method, url.path, query, body)
            payload = reply.encode() if isinstance(reply, str) else json.dumps(reply).encode()
            self.send_response(status)
            self.send_header("Content-Type", "text/plain" if isinstance(reply, str) else "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

    return Handler


def _route(cluster: FakeCluster, method: str, path: str, query: dict[str, str], body: Any) -> tuple[int, Any]:
    if match := _CUSTOM.match(path):
        return _custom_object(cluster, method, match.groupdict(), query, body)
    if (match := _PODS.match(path)) and method == "GET":
        pods = [
            p
            for p in cluster.pods
            if p["metadata"]["namespace"] == match["ns"]
            and _selected(p["metadata"].get("labels", {}), query.get("labelSelector", ""))
        ]
        return 200, {"apiVersion": "v1", "kind": "PodList", "metadata": {"resourceVersion": "7"}, "items": pods}
    if (match := _LOG.match(path)) and method == "GET":
        return _log(cluster, match["ns"], match["name"], query)
    return _status(404, "NotFound", "the server could not find the requested resource")


def _custom_object(
    cluster: FakeCluster, method: str, where: dict[str, str], query: dict[str, str], body: Any
) -> tuple[int, Any]:
    kind = cluster.kinds.get((where["group"], where["version"], where["plural"]))
    if kind is None:  # the operator (its CRD) is not installed
        return _status(404, "NotFound", "the server could not find the requested resource")
    key = (where["plural"], where["ns"], where["name"])
    resource = f"{where['plural']}.{where['group']}"
    if method == "POST" and where["name"] is None:
        name = body["metadata"]["name"]
        if (where["plural"], where["ns"], name) in cluster.objects:
            return _status(409, "AlreadyExists", f'{resource} "{name}" already exists', name, where)
        body["metadata"].update(uid=f"uid-{name}", creationTimestamp=CREATED, generation=1, resourceVersion="1")
        cluster.objects[(where["plural"], where["ns"], name)] = body
        return 201, body
    if method == "GET" and where["name"] is None:
        items = [
            obj
            for (plural, ns, _), obj in cluster.objects.items()
            if (plural, ns) == key[:2] and _selected(obj["metadata"].get("labels", {}), query.get("labelSelector", ""))
        ]
        return 200, {
            "apiVersion": f"{where['group']}/{where['version']}",
            "kind": f"{kind}List",
            "metadata": {"resourceVersion": "7"},
            "items": items,
        }
    if key not in cluster.objects:
        return _status(404, "NotFound", f'{resource} "{where["name"]}" not found', where["name"], where)
    if method == "GET":
        return 200, cluster.objects[key]
    if method == "DELETE":
        if query.get("propagationPolicy") == "Foreground":
            cluster.objects[key]["metadata"].update(
                deletionTimestamp="2026-11-23T11:00:00Z", finalizers=["foregroundDeletion"]
            )
            return 200, cluster.objects[key]
        del cluster.objects[key]
        return 200, {"kind": "Status", "apiVersion": "v1", "status": "Success", "details": {"name": where["name"]}}
    return _status(405, "MethodNotAllowed", f"{method} is not supported here")


def _log(cluster: FakeCluster, namespace: str, name: str, query: dict[str, str]) -> tuple[int, Any]:
    pods = [p for p in cluster.pods if p["metadata"]["name"] == name and p["metadata"]["namespace"] == namespace]
    if not pods:
        return _status(404, "NotFound", f'pods "{name}" not found', name, {"plural": "pods", "group": ""})
    containers = [c["name"] for c in pods[0]["spec"]["containers"]]
    container = query.get("container", containers[0])
    if container not in containers:
        return _status(400, "BadRequest", f"container {container} is not valid for pod {name}")
    lines = cluster.logs.get((name, container), "").splitlines(keepends=True)
    if query.get("timestamps") != "true":
        lines = [line.partition(" ")[2] for line in lines]
    return 200, "".join(lines)


def _selected(labels: dict[str, str], selector: str) -> bool:
    """Equality-based label selectors (``k=v,k2=v2``), the kind the client sends here."""
    terms = [term.split("=", 1) for term in selector.split(",") if term]
    return all(labels.get(key) == value for key, value in terms)


def _status(
    code: int, reason: str, message: str, name: str | None = None, where: dict[str, Any] | None = None
) -> tuple[int, dict[str, Any]]:
    details = {"name": name, "group": where.get("group", ""), "kind": where["plural"]} if name and where else {}
    return code, {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "details": details,
        "code": code,
    }
