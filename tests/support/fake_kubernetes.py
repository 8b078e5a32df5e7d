"""An in-process stand-in for a Kubernetes API server, for tests only.

It plugs in under the real `kubernetes` client as its REST layer, so the client's own parameter
checks, serialization and ApiException handling run as in production. It keeps objects in memory,
assigns uids, validates every created object against Kubernetes' schemas (kubernetes-validate,
strict; a JobSet as scripts/check_manifests.py does: its vendored schema, its Job templates as Jobs),
answers 404/409 like the API server, refuses calls without a timeout, and on delete
garbage-collects dependents by ownerReferences — except with the `Orphan` policy, which the API
server applies by default to batch Jobs."""

from __future__ import annotations

import copy
import importlib.util
import json
import re
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import kubernetes_validate
from kubernetes import client

ROUTE = re.compile(
    r"^/(?:api/v1|apis/(?P<group>[a-z0-9.-]+)/v1\w*)/namespaces/(?P<ns>[^/]+)/(?P<plural>[a-z]+)"
    r"(?:/(?P<name>[^/]+))?(?P<log>/log)?$"
)
KINDS = {
    "configmaps": "ConfigMap",
    "services": "Service",
    "pods": "Pod",
    "deployments": "Deployment",
    "jobs": "Job",
    "secrets": "Secret",
    "networkpolicies": "NetworkPolicy",
    "jobsets": "JobSet",
}
DEFAULT_PROPAGATION = {"Job": "Orphan"}
CHECK_MANIFESTS = Path(__file__).resolve().parents[2] / "scripts" / "check_manifests.py"


def check_manifests_module():
    spec = importlib.util.spec_from_file_location("check_manifests", CHECK_MANIFESTS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def validation_problems(obj: dict[str, Any], version: str) -> list[str]:
    """What the API server would refuse: built-in kinds by Kubernetes' schemas, custom ones by their CRD's."""
    if obj.get("kind") == "JobSet":
        return check_manifests_module().check_json_schema(obj, version)
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return [exc.message]
    return []


class _Response:
    def __init__(self, status: int, payload: Any):
        self.status, self.reason = (
            status,
            {200: "OK", 201: "Created", 404: "Not Found", 409: "Conflict", 422: "Unprocessable Entity"}.get(status, ""),
        )
        text = payload if isinstance(payload, str) else json.dumps(payload)
        self.data = text.encode()
        self.headers = {"content-type": "text/plain" if isinstance(payload, str) else "application/json"}

    def read(self) -> bytes:
        return self.data

    def getheaders(self) -> dict[str, str]:
        return self.headers

    def getheader(self, name: str, default: str | None = None) -> str | None:
        return self.headers.get(name, default)


class _Rest:
    def __init__(self, cluster: FakeCluster):
        self.cluster = cluster

    def request(self, method, url, headers=None, body=None, post_params=None, _request_timeout=None):
        if _request_timeout is None:
            raise AssertionError(f"{method} {url} without a timeout")
        return self.cluster.handle(method, url, body)

    def close(self) -> None:
        pass


class FakeCluster:
    def __init__(self, k8s_version: str = "1.30.0"):
        self.version = k8s_version
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.pod_logs: dict[tuple[str, str], str] = {}
        self.calls: list[tuple[str, str]] = []

    def api_client(self) -> client.ApiClient:
        api = client.ApiClient()
        api.rest_client = _Rest(self)
        return api

    # -- what a test looks at or changes ---------------------------------------------------------
    def get(self, kind: str, name: str, namespace: str = "default") -> dict[str, Any] | None:
        return self.objects.get((kind, namespace, name))

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [obj for (k, _, _), obj in self.objects.items() if k == kind]

    def set_status(self, kind: str, name: str, status: dict[str, Any], namespace: str = "default") -> None:
        self.objects[(kind, namespace, name)]["status"] = status

    def add_pod(
        self,
        name: str,
        labels: dict[str, str],
        status: dict[str, Any],
        owner: dict[str, Any] | None = None,
        namespace: str = "default",
        log: str = "",
        node: str | None = None,
    ) -> None:
        meta = {"name": name, "namespace": namespace, "labels": labels, "uid": str(uuid.uuid4())}
        if owner is not None:
            meta["ownerReferences"] = [
                {
                    "apiVersion": owner["apiVersion"],
                    "kind": owner["kind"],
                    "name": owner["metadata"]["name"],
                    "uid": owner["metadata"]["uid"],
                }
            ]
        self.objects[("Pod", namespace, name)] = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": meta,
            "spec": {"containers": [], **({"nodeName": node} if node else {})},
            "status": status,
        }
        self.pod_logs[(namespace, name)] = log

    # -- the API server ----------------------------------------------------------------------------
    def handle(self, method: str, url: str, body: Any) -> _Response:
        parsed = urlparse(url)
        self.calls.append((method, parsed.path))
        match = ROUTE.match(parsed.path)
        if not match or match["plural"] not in KINDS:
            return _Response(404, _status(404, "NotFound", f"no route {parsed.path}"))
        kind, ns, name = KINDS[match["plural"]], match["ns"], match["name"]
        query = {k: v[0] for k, v in parse_qs(parsed.query).items()}
        key = (kind, ns, name)
        if match["log"]:
            if key not in self.objects:
                return _Response(404, _status(404, "NotFound", f"pods {name} not found"))
            lines = self.pod_logs.get((ns, name), "").splitlines()
            return _Response(200, "\n".join(lines[-int(query.get("tailLines", len(lines) or 1)) :]))
        if method == "POST" and name is None:
            return self._create(kind, ns, body)
        if method == "GET" and name is None:
            return _Response(
                200,
                {
                    "apiVersion": "v1",
                    "kind": f"{kind}List",
                    "metadata": {},
                    "items": [o for o in self._in(kind, ns) if _selected(o, query.get("labelSelector"))],
                },
            )
        if key not in self.objects:
            return _Response(404, _status(404, "NotFound", f"{match['plural']} {name} not found"))
        if method == "GET":
            return _Response(200, self.objects[key])
        if method == "DELETE":
            deleted = self._delete(key, query.get("propagationPolicy", DEFAULT_PROPAGATION.get(kind, "Background")))
            # as the API server: Services and Pods answer with the deleted object, the others with a Status
            return _Response(200, deleted if kind in ("Service", "Pod") else _status(200, "", "deleted"))
        return _Response(405, _status(405, "MethodNotAllowed", method))

    def _in(self, kind: str, ns: str) -> list[dict[str, Any]]:
        return [o for (k, n, _), o in self.objects.items() if k == kind and n == ns]

    def _create(self, kind: str, ns: str, body: dict[str, Any]) -> _Response:
        obj = copy.deepcopy(body)
        if problems := validation_problems(obj, self.version):
            return _Response(422, _status(422, "Invalid", f"{kind} {obj['metadata'].get('name')}: {problems[0]}"))
        name = obj["metadata"]["name"]
        if (kind, ns, name) in self.objects:
            return _Response(409, _status(409, "AlreadyExists", f"{kind} {name} already exists"))
        obj["metadata"].update(
            namespace=ns,
            uid=str(uuid.uuid4()),
            resourceVersion="1",
            creationTimestamp=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        )
        obj.setdefault("status", {})
        self.objects[(kind, ns, name)] = obj
        return _Response(201, obj)

    def _delete(self, key: tuple[str, str, str], propagation: str) -> dict[str, Any]:
        deleted = self.objects.pop(key)
        uid = deleted["metadata"]["uid"]
        for dep_key, dep in list(self.objects.items()):
            refs = dep["metadata"].get("ownerReferences") or []
            if any(ref["uid"] == uid for ref in refs):
                if propagation == "Orphan":
                    dep["metadata"]["ownerReferences"] = [r for r in refs if r["uid"] != uid]
                elif dep_key in self.objects:
                    self._delete(dep_key, "Background")
        return deleted


def _selected(obj: dict[str, Any], selector: str | None) -> bool:
    labels = obj["metadata"].get("labels") or {}
    for term in filter(None, (selector or "").split(",")):
        key, _, value = term.partition("=")
        if labels.get(key) != value:
            return False
    return True


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Status",
        "status": "Failure" if code >= 400 else "Success",
        "reason": reason,
        "message": message,
        "code": code,
    }
