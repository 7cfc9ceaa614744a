"""KubeRay manifests for a job: a `ray.io/v1` RayJob (or a standing RayCluster) whose worker
group is sized from the job's parallel and elastic sections.

The cluster it describes: a head that does no training (num-cpus 0) and serves the job API and
dashboard inside the cluster only (ClusterIP); one Ray worker pod per baton worker, with the
worker's GPUs (tolerating the GPU taint, selecting GPU nodes); autoscaling between the job's
smallest and largest world; shared checkpoint storage on every pod (a ReadWriteMany volume at
/mnt/baton, which `BATON_STORAGE` points relative paths at, or an s3:// URI with credentials
from a Secret); Ray's metrics on port 8080 for Prometheus; token authentication from a Secret.
Least privilege: every pod runs as the image's non-root user with no privilege escalation, no
capabilities, the runtime's default seccomp profile and a read-only root (Ray writes its
session, logs and unpacked working directories under /tmp, an emptyDir, where HOME points
too); a NetworkPolicy admits traffic to the cluster's pods only from each other, the RayJob's
submitter and the KubeRay operator (the dashboard's port), and Prometheus (the metrics port).
Every rendered object is checked against the rules KubeRay enforces in its controller
(`kuberay_errors`) before it is printed.
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass
from typing import Any, Optional

import yaml

from baton import __version__, ray_settings
from baton.errors import SpecError
from baton.spec import JobSpec

RAY_VERSION = "2.60.0"
APP_DIR = "/home/ray/baton"  # where k8s/Dockerfile puts the project (jobs/, user code)
STORAGE_MOUNT = "/mnt/baton"
METRICS_PORT = 8080  # Ray's --metrics-export-port on every pod; the PodMonitor scrapes it
# A worker pod being deleted (preempted, drained, scaled down) gets SIGTERM: `ray start` then
# drains its node for this long, and a job moves its workers off at the next step boundary
# (docs/elastic.md); the kubelet's SIGKILL comes 10 s after that
DRAIN_S = 50
MLFLOW_SERVICE = "http://mlflow:5000"  # the tracking server of k8s/mlflow.yaml, in the namespace
SUBMISSION_MODES = ("K8sJobMode", "HTTPMode", "InteractiveMode", "SidecarMode")
DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
POD_LABELS = {"app.kubernetes.io/name": "baton"}  # k8s/podmonitor.yaml selects these pods
MAX_NAME = {"RayJob": 47, "RayCluster": 63}  # KubeRay derives longer names from these
# the image's user (rayproject/ray: ray, uid 1000, group users 100)
POD_SECURITY = {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 100, "fsGroup": 100,
                "seccompProfile": {"type": "RuntimeDefault"}}
CONTAINER_SECURITY = {"allowPrivilegeEscalation": False, "privileged": False,
                      "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}
SCRATCH = "/tmp"  # the one writable place besides the storage volume: Ray's temp dir, HOME


@dataclass(frozen=True)
class K8sOptions:
    kind: str = "RayJob"  # or RayCluster: a standing cluster to `baton submit` to
    name: Optional[str] = None  # default: the job's name, made DNS-1035
    namespace: Optional[str] = None
    image: str = f"baton:{__version__}"  # build from k8s/Dockerfile and push to your registry
    pvc: Optional[str] = "baton-shared"  # ReadWriteMany claim mounted at /mnt/baton
    checkpoint_uri: Optional[str] = None  # s3://bucket/prefix instead of the volume's folder
    s3_secret: Optional[str] = None  # Secret with AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY
    token_secret: Optional[str] = "baton-ray-token"  # Secret with key auth_token; None: no auth
    redis_address: Optional[str] = None  # external Redis for GCS fault tolerance
    redis_secret: Optional[str] = None  # Secret with key password for that Redis
    # the tracking server k8s/mlflow.yaml runs; None: sqlite on the shared volume (one job)
    mlflow_uri: Optional[str] = MLFLOW_SERVICE
    worker_memory: Optional[str] = None  # default 16Gi per GPU worker, 4Gi per CPU worker
    min_workers: Optional[int] = None  # worker pods; default: min_dp x pp
    max_workers: Optional[int] = None  # default: max_dp x pp
    backoff_limit: int = 2  # whole-job retries; each resumes from the latest checkpoint
    ttl_s: int = 600  # the finished job's cluster is deleted this long after it ends


def k8s_name(job_name: str, kind: str) -> str:
    """The job's name as a Kubernetes name KubeRay accepts for `kind`."""
    name = re.sub(r"[^a-z0-9-]+", "-", job_name.lower()).strip("-")
    if not name or not name[0].isalpha():
        name = f"baton-{name}".rstrip("-")
    return name[: MAX_NAME[kind]].rstrip("-")


def render(spec: JobSpec, job_path: str, overrides: list[str] = (),
           opts: K8sOptions = K8sOptions()) -> list[dict]:
    """The objects to `kubectl apply` for the job, in order."""
    if opts.kind not in MAX_NAME:
        raise SpecError(f"--kind {opts.kind!r}: use RayJob or RayCluster")
    if opts.checkpoint_uri and "://" not in opts.checkpoint_uri:
        raise SpecError(f"--checkpoint-uri {opts.checkpoint_uri!r}: give a URI such as s3://bucket/baton")
    name = opts.name or k8s_name(spec.name, opts.kind)
    meta: dict[str, Any] = {"name": name, "labels": {"app.kubernetes.io/name": "baton",
                                                     "app.kubernetes.io/instance": name}}
    if opts.namespace:
        meta["namespace"] = opts.namespace
    cluster = _cluster_spec(spec, opts, name)
    if opts.kind == "RayCluster":
        obj = {"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": meta, "spec": cluster}
    else:
        obj = {"apiVersion": "ray.io/v1", "kind": "RayJob", "metadata": meta, "spec": {
            "entrypoint": _entrypoint(job_path, overrides, opts),
            "runtimeEnvYAML": yaml.safe_dump({"env_vars": _env_vars(opts)}, sort_keys=True),
            "shutdownAfterJobFinishes": True,
            "ttlSecondsAfterFinished": opts.ttl_s,
            "backoffLimit": opts.backoff_limit,
            "submissionMode": "K8sJobMode",
            "rayClusterSpec": cluster,
        }}
    errors = kuberay_errors(obj)
    if errors:
        raise SpecError(f"{job_path}: the {opts.kind} would be refused: {'; '.join(errors)}")
    return [obj, _network_policy(name, opts)]


def _network_policy(name: str, opts: K8sOptions) -> dict:
    """Ingress to the job's pods: from each other (any port: GCS, object transfer, gloo,
    NCCL), from the RayJob's submitter and the KubeRay operator to the dashboard's job API,
    and from Prometheus to the metrics port. `kubectl port-forward` does not pass through
    NetworkPolicies: the README's way in still works."""
    mine = {"app.kubernetes.io/instance": name}
    meta: dict[str, Any] = {"name": f"{name}-ray", "labels": {"app.kubernetes.io/name": "baton",
                                                              "app.kubernetes.io/instance": name}}
    if opts.namespace:
        meta["namespace"] = opts.namespace
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": meta,
            "spec": {"podSelector": {"matchLabels": dict(mine)}, "policyTypes": ["Ingress"],
                     "ingress": [
                         {"from": [{"podSelector": {"matchLabels": dict(mine)}}]},
                         {"from": [{"podSelector": {"matchLabels": {
                             "ray.io/originated-from-crd": "RayJob",
                             "ray.io/originated-from-cr-name": name}}},
                                   {"namespaceSelector": {}, "podSelector": {"matchLabels": {
                                       "app.kubernetes.io/name": "kuberay-operator"}}}],
                          "ports": [{"protocol": "TCP", "port": 8265}]},
                         {"from": [{"namespaceSelector": {}, "podSelector": {"matchLabels": {
                             "app.kubernetes.io/name": "prometheus"}}}],
                          "ports": [{"protocol": "TCP", "port": METRICS_PORT}]},
                     ]}}


def _entrypoint(job_path: str, overrides: list[str], opts: K8sOptions) -> str:
    import shlex

    if job_path.startswith("/") or job_path.startswith(".."):
        raise SpecError(f"{job_path}: give the job file relative to the project folder, as the "
                        f"image holds it under {APP_DIR}")
    args = ["baton", "run", f"{APP_DIR}/{job_path}"]
    if opts.checkpoint_uri:
        args += ["--set", f"checkpoint.path={opts.checkpoint_uri}"]
    for item in overrides:
        args += ["--set", item]
    return shlex.join(args)


def _env_vars(opts: K8sOptions) -> dict[str, str]:
    env = {"BATON_STORAGE": STORAGE_MOUNT} if opts.pvc else {}
    if opts.mlflow_uri:
        env["MLFLOW_TRACKING_URI"] = opts.mlflow_uri
    return env


def _cluster_spec(spec: JobSpec, opts: K8sOptions, name: str) -> dict:
    r, pp = spec.resources, spec.per_replica  # workers a replica takes
    lo, hi = spec.dp_range
    low = lo * pp if opts.min_workers is None else opts.min_workers
    high = hi * pp if opts.max_workers is None else opts.max_workers
    gpus = math.ceil(r.gpus_per_worker)
    cpus = max(1, math.ceil(r.cpus_per_worker))
    memory = opts.worker_memory or ("16Gi" if gpus else "4Gi")
    limits = {"cpu": str(cpus), "memory": memory}
    if gpus:
        limits["nvidia.com/gpu"] = str(gpus)
    worker_pod: dict[str, Any] = {"containers": [_container(
        "ray-worker", opts, {"requests": dict(limits), "limits": dict(limits)},
        [("metrics", METRICS_PORT)], {"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": str(DRAIN_S)})],
        "terminationGracePeriodSeconds": DRAIN_S + 10}
    if gpus:
        worker_pod["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists",
                                      "effect": "NoSchedule"}]
        worker_pod["nodeSelector"] = {"nvidia.com/gpu.present": "true"}
    _add_storage(worker_pod, opts)
    _harden(worker_pod)
    head_resources = {"cpu": "2", "memory": "8Gi"}
    head_pod: dict[str, Any] = {"containers": [_container(
        "ray-head", opts, {"requests": dict(head_resources), "limits": dict(head_resources)},
        [("gcs-server", 6379), ("dashboard", 8265), ("client", 10001), ("metrics", METRICS_PORT)])]}
    _add_storage(head_pod, opts)
    _harden(head_pod)
    labels = {**POD_LABELS, "app.kubernetes.io/instance": name}  # the NetworkPolicy's selector
    cluster: dict[str, Any] = {
        "rayVersion": RAY_VERSION,
        "enableInTreeAutoscaling": True,
        "autoscalerOptions": {"upscalingMode": "Default", "idleTimeoutSeconds": 60},
        "headGroupSpec": {
            "serviceType": "ClusterIP",  # users port-forward; nothing is exposed outside
            # num-cpus 0: no training work on the head; the driver (num_cpus 0) still runs there
            "rayStartParams": {"num-cpus": "0", "dashboard-host": "0.0.0.0",
                               "metrics-export-port": str(METRICS_PORT)},
            "template": {"metadata": {"labels": dict(labels)}, "spec": head_pod},
        },
        "workerGroupSpecs": [{
            "groupName": "gpu-workers" if gpus else "cpu-workers",
            "replicas": min(max(spec.parallel.dp * pp, low), high),
            "minReplicas": low,
            "maxReplicas": high,
            "rayStartParams": {"metrics-export-port": str(METRICS_PORT)},
            "template": {"metadata": {"labels": dict(labels)}, "spec": worker_pod},
        }],
    }
    if opts.token_secret:
        cluster["authOptions"] = {"mode": "token", "secretName": opts.token_secret}
    if opts.redis_address:
        ft: dict[str, Any] = {"redisAddress": opts.redis_address}
        if opts.redis_secret:
            ft["redisPassword"] = {"valueFrom": {"secretKeyRef": {"name": opts.redis_secret,
                                                                  "key": "password"}}}
        cluster["gcsFaultToleranceOptions"] = ft
    return cluster


def _container(name: str, opts: K8sOptions, resources: dict, ports: list[tuple[str, int]],
               extra_env: Optional[dict[str, str]] = None) -> dict:
    c: dict[str, Any] = {
        "name": name, "image": opts.image, "resources": resources,
        "ports": [{"name": n, "containerPort": p} for n, p in ports],
    }
    # Ray's own settings, read by the raylet as it starts; baton's, for the job's processes too
    pod_env = {**ray_settings.ray_env(), **(extra_env or {}), **_env_vars(opts)}
    env = [{"name": k, "value": v} for k, v in pod_env.items()]
    if opts.s3_secret:
        env += [{"name": key, "valueFrom": {"secretKeyRef": {"name": opts.s3_secret, "key": key}}}
                for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")]
    if env:
        c["env"] = env
    return c


def _add_storage(pod: dict, opts: K8sOptions) -> None:
    if not opts.pvc:
        return
    pod["volumes"] = [{"name": "baton-storage", "persistentVolumeClaim": {"claimName": opts.pvc}}]
    pod["containers"][0]["volumeMounts"] = [{"name": "baton-storage", "mountPath": STORAGE_MOUNT}]


def _harden(pod: dict) -> None:
    """Least privilege (the Pod Security Standards' restricted profile, and a read-only root):
    a writable emptyDir at /tmp for Ray's session folder and logs, with HOME pointed there."""
    pod["securityContext"] = copy.deepcopy(POD_SECURITY)  # copies: YAML would alias shared ones
    pod.setdefault("volumes", []).append({"name": "scratch", "emptyDir": {}})
    for c in pod["containers"]:
        c["securityContext"] = copy.deepcopy(CONTAINER_SECURITY)
        c.setdefault("volumeMounts", []).append({"name": "scratch", "mountPath": SCRATCH})
        c.setdefault("env", []).append({"name": "HOME", "value": f"{SCRATCH}/home"})


# --- the rules KubeRay checks in its controller, which no CRD schema carries -----------------

def kuberay_errors(obj: dict) -> list[str]:
    """What KubeRay's validation would refuse in a RayJob or RayCluster (empty: none)."""
    errors: list[str] = []
    kind, meta, spec = obj.get("kind"), obj.get("metadata") or {}, obj.get("spec") or {}
    name = meta.get("name", "")
    if kind in MAX_NAME:
        if not DNS_1035.match(name or ""):
            errors.append(f"metadata.name {name!r} is not a DNS-1035 label (lower-case letters, "
                          "digits and '-', starting with a letter)")
        if len(name) > MAX_NAME[kind]:
            errors.append(f"metadata.name {name!r} has {len(name)} characters; a {kind} name "
                          f"may have at most {MAX_NAME[kind]}")
    if kind == "RayJob":
        mode = spec.get("submissionMode", "K8sJobMode")
        if mode not in SUBMISSION_MODES:
            errors.append(f"spec.submissionMode {mode!r} is not one of {', '.join(SUBMISSION_MODES)}")
        if _number(spec.get("ttlSecondsAfterFinished")) > 0 and not spec.get("shutdownAfterJobFinishes"):
            errors.append("spec.ttlSecondsAfterFinished needs spec.shutdownAfterJobFinishes: true")
        if _number(spec.get("backoffLimit")) > 0:
            if mode == "InteractiveMode":
                errors.append("spec.backoffLimit > 0 cannot be used with InteractiveMode")
            if spec.get("clusterSelector"):
                errors.append("spec.backoffLimit > 0 cannot be used with spec.clusterSelector")
        cluster, where = spec.get("rayClusterSpec"), "spec.rayClusterSpec"
    else:
        cluster, where = spec, "spec"
    if cluster:
        errors += _cluster_errors(cluster, where)
    return errors


def _cluster_errors(cluster: dict, where: str) -> list[str]:
    errors = []
    groups = [(f"{where}.headGroupSpec", cluster.get("headGroupSpec") or {})]
    groups += [(f"{where}.workerGroupSpecs[{i}]", g)
               for i, g in enumerate(cluster.get("workerGroupSpecs") or [])]
    for path, group in groups:
        for key, value in (group.get("rayStartParams") or {}).items():
            if not isinstance(value, str):
                errors.append(f"{path}.rayStartParams.{key} must be a string (quote {value!r})")
        if "minReplicas" in group or "maxReplicas" in group:
            lo, hi = _number(group.get("minReplicas", 0)), _number(group.get("maxReplicas", 2**31 - 1))
            if lo > hi:
                errors.append(f"{path}: minReplicas {lo} > maxReplicas {hi}")
    return errors


def _number(value) -> float:
    """A number as given, else 0: a value of the wrong type is the schema's to report."""
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else 0


def to_yaml(objects: list[dict]) -> str:
    return "---\n".join(yaml.safe_dump(o, sort_keys=False) for o in objects)
