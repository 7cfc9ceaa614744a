"""Kubernetes manifests, validated offline the way the API server would: KubeRay's RayJob and
RayCluster against the v1.7.0 CRD schemas in ../shared/schemas (defaults applied, unknown
fields rejected), core objects with kubernetes-validate in strict mode, plus the rules KubeRay
checks in its controller. Covers every file in k8s/ and what `baton k8s` renders for every job
in jobs/; mutated manifests must fail."""

from __future__ import annotations

import copy
import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from baton import k8s, ray_settings
from baton.data.feed import READ_CONCURRENCY
from baton.cli import main
from baton.errors import SpecError
from baton.spec import load_spec

REPO = Path(__file__).resolve().parents[2]
SCHEMAS = REPO.parent / "shared" / "schemas" / "kuberay-v1.7.0"
JOBS = sorted((REPO / "jobs").glob("*.yaml"))
MANIFESTS = sorted((REPO / "k8s").glob("*.yaml"))
needs_schemas = pytest.mark.skipif(not SCHEMAS.is_dir(),
                                   reason=f"KubeRay CRD schemas not found at {SCHEMAS}")


# --- a CRD validator that behaves as the API server does -------------------------------------

SCHEMA_MAPS = ("properties", "patternProperties", "definitions")
SCHEMA_LISTS = ("anyOf", "allOf", "oneOf")


def strict(schema: dict) -> dict:
    """openAPIV3Schema -> JSON Schema with strict field validation: an object that lists its
    properties admits no others (unless it preserves unknown fields); `nullable` admits null."""
    out = {}
    for key, value in schema.items():
        if key in SCHEMA_MAPS:
            out[key] = {name: strict(sub) for name, sub in value.items()}
        elif key in SCHEMA_LISTS:
            out[key] = [strict(sub) for sub in value]
        elif key in ("items", "not") or (key == "additionalProperties" and isinstance(value, dict)):
            out[key] = strict(value)
        elif not key.startswith("x-kubernetes-") and key != "nullable":
            out[key] = value
    if ("properties" in schema and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    if schema.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    return out


def apply_defaults(schema: dict, value):
    """What the API server stores: defaults filled in, non-nullable nulls pruned."""
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for name in list(value):
            sub = props.get(name) or (schema.get("additionalProperties")
                                      if isinstance(schema.get("additionalProperties"), dict) else None)
            if value[name] is None and not (sub or {}).get("nullable"):
                del value[name]
            elif sub:
                value[name] = apply_defaults(sub, value[name])
        for name, sub in props.items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        value = [apply_defaults(schema["items"], v) for v in value]
    return value


_VALIDATORS: dict = {}


def crd_errors(obj: dict) -> list[str]:
    """Schema errors of a ray.io/v1 object after defaulting, then KubeRay's own rules."""
    import jsonschema

    kind = obj.get("kind")
    if kind not in _VALIDATORS:
        raw = json.loads((SCHEMAS / f"{kind.lower()}s.v1.schema.json").read_text())
        _VALIDATORS[kind] = (raw, jsonschema.Draft7Validator(strict(raw)))
    raw, validator = _VALIDATORS[kind]
    stored = apply_defaults(raw, copy.deepcopy(obj))
    errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(stored)]
    if obj.get("apiVersion") != "ray.io/v1":
        errors.append(f"apiVersion {obj.get('apiVersion')!r} is not ray.io/v1")
    return errors + k8s.kuberay_errors(obj)


def core_errors(obj: dict) -> list[str]:
    import kubernetes_validate
    from kubernetes_validate.utils import ValidationError

    try:
        kubernetes_validate.validate(obj, kubernetes_validate.latest_version(), strict=True)
    except ValidationError as e:
        return [str(e.message)]
    return []


def manifest_errors(obj: dict) -> list[str]:
    if obj["apiVersion"] == "ray.io/v1":
        return crd_errors(obj)
    if obj["apiVersion"] == "monitoring.coreos.com/v1":
        return podmonitor_errors(obj)
    return core_errors(obj)


def podmonitor_errors(obj: dict) -> list[str]:
    """No PodMonitor schema is at hand: check what ties it to baton's pods instead."""
    spec = obj["spec"]
    errors = []
    labels = {**k8s.POD_LABELS, "ray.io/is-ray-node": "yes"}
    if not set(spec["selector"]["matchLabels"].items()) <= set(labels.items()):
        errors.append(f"selector {spec['selector']} matches no baton pod")
    if [e["port"] for e in spec["podMetricsEndpoints"]] != ["metrics"]:
        errors.append("the endpoint is not the pods' metrics port")
    return errors


def rendered(job: Path, *args: str) -> list[dict]:
    spec = load_spec(job)
    kind = args[0] if args else "RayJob"
    return k8s.render(spec, job.relative_to(REPO).as_posix(), [], k8s.K8sOptions(kind=kind))


# --- every manifest we ship or render is valid -----------------------------------------------

@needs_schemas
@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_every_manifest_in_k8s_is_valid(path):
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert docs
    for doc in docs:
        assert manifest_errors(doc) == [], f"{path.name}: {doc['kind']} {doc['metadata']['name']}"


@needs_schemas
@pytest.mark.parametrize("job", JOBS, ids=lambda p: p.name)
@pytest.mark.parametrize("kind", ["RayJob", "RayCluster"])
def test_what_baton_k8s_renders_for_every_job_is_valid(job, kind):
    objects = rendered(job, kind)
    assert [o["kind"] for o in objects] == [kind, "NetworkPolicy"]
    for obj in objects:
        assert manifest_errors(obj) == [], obj["kind"]


@pytest.mark.parametrize("path", [p for p in MANIFESTS if p.read_text().startswith("# Rendered by:")],
                         ids=lambda p: p.name)
def test_rendered_manifests_in_k8s_are_current(path, capsys, monkeypatch):
    """k8s/ holds `baton k8s` output; its first line is the command that regenerates it."""
    command = path.read_text().splitlines()[0].removeprefix("# Rendered by: baton ")
    monkeypatch.chdir(REPO)
    assert main(shlex.split(command)) == 0
    assert capsys.readouterr().out == path.read_text(), f"regenerate: baton {command} > {path}"


def test_the_worker_group_is_sized_from_parallel_and_elastic():
    spec = load_spec(REPO / "jobs" / "gpt-small-gpu.yaml", ["parallel.dp=2"])
    [job, _] = k8s.render(spec, "jobs/gpt-small-gpu.yaml", ["parallel.dp=2"])
    cluster = job["spec"]["rayClusterSpec"]
    [group] = cluster["workerGroupSpecs"]
    assert (group["replicas"], group["minReplicas"], group["maxReplicas"]) == (2, 1, 8)
    pod = group["template"]["spec"]
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"  # no training on the head
    assert cluster["headGroupSpec"]["serviceType"] == "ClusterIP"
    assert cluster["enableInTreeAutoscaling"] is True
    assert job["spec"]["shutdownAfterJobFinishes"] is True and job["spec"]["backoffLimit"] > 0
    assert job["spec"]["entrypoint"] == "baton run /home/ray/baton/jobs/gpt-small-gpu.yaml --set parallel.dp=2"
    assert yaml.safe_load(job["spec"]["runtimeEnvYAML"]) == {"env_vars": {
        "BATON_STORAGE": "/mnt/baton", "MLFLOW_TRACKING_URI": "http://mlflow:5000"}}  # k8s/mlflow.yaml
    # Ray's own settings go to every pod (each raylet reads them as it starts), not to the
    # job's runtime environment, which Ray's processes never see
    for where, pod in _pods(job):
        [container] = pod["containers"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["RAY_kill_worker_timeout_milliseconds"] == "1000", where
        assert env["RAY_num_workers_soft_limit"] == "4", where


def test_the_head_keeps_an_idle_worker_for_each_read_that_may_run_at_once():
    """Reads run on the driver's node, a head with no CPUs on a cluster: ray_settings.py."""
    assert ray_settings.SYSTEM_CONFIG["num_workers_soft_limit"] >= READ_CONCURRENCY

    pp = load_spec(REPO / "jobs" / "gpt-dp-pp.yaml")
    [group] = k8s.render(pp, "jobs/gpt-dp-pp.yaml", [], k8s.K8sOptions(kind="RayCluster"))[0][
        "spec"]["workerGroupSpecs"]
    assert group["replicas"] == pp.parallel.dp * pp.parallel.pp  # one pod per worker
    assert "nvidia.com/gpu" not in group["template"]["spec"]["containers"][0]["resources"]["limits"]


def _pods(doc: dict) -> list[tuple[str, dict]]:
    """(where, pod spec) of every pod template in a manifest."""
    if doc["apiVersion"] == "ray.io/v1":
        cluster = doc["spec"].get("rayClusterSpec", doc["spec"])
        groups = [("head", cluster["headGroupSpec"])] + [(g["groupName"], g) for g in cluster["workerGroupSpecs"]]
        return [(name, g["template"]["spec"]) for name, g in groups]
    if doc["kind"] in ("Deployment", "StatefulSet", "Job", "DaemonSet"):
        return [(doc["metadata"]["name"], doc["spec"]["template"]["spec"])]
    return []


def _every_manifest() -> list[tuple[str, dict]]:
    docs = [(p.name, d) for p in MANIFESTS for d in yaml.safe_load_all(p.read_text()) if d]
    for job in JOBS:
        for kind in ("RayJob", "RayCluster"):
            docs += [(f"{job.name} ({kind})", d) for d in rendered(job, kind)]
    return docs


def test_every_pod_runs_with_least_privilege():
    """Issue 17: non-root, no privilege escalation, no capabilities, the default seccomp
    profile and a read-only root, in every container (init containers too) of every pod we
    ship or render. Fails if one lacks it."""
    pods = [(f"{name}: {where}", pod) for name, doc in _every_manifest() for where, pod in _pods(doc)]
    assert len(pods) >= 2 * 2 * len(JOBS) + 1  # a head and a worker group each, and Redis
    for where, pod in pods:
        sc = pod.get("securityContext", {})
        assert sc.get("runAsNonRoot") is True and sc.get("seccompProfile") == {"type": "RuntimeDefault"}, where
        for c in pod["containers"] + pod.get("initContainers", []):
            csc = c.get("securityContext", {})
            assert csc.get("allowPrivilegeEscalation") is False, where
            assert csc.get("capabilities", {}).get("drop") == ["ALL"], where
            assert csc.get("readOnlyRootFilesystem") is True, where
            assert not csc.get("privileged"), where
            writable = {m["mountPath"] for m in c.get("volumeMounts", []) if not m.get("readOnly")}
            assert writable, f"{where}: {c['name']} has nowhere to write"


def test_a_deleted_worker_pod_drains_before_the_kubelet_kills_it():
    """A worker pod's SIGTERM makes `ray start` drain its node (tests/faults/test_preemption.py)
    for RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S; the pod's grace period is longer, so that the
    job has moved off before the kubelet's SIGKILL."""
    workers = [(f"{name}: {where}", pod) for name, doc in _every_manifest()
               for where, pod in _pods(doc) if doc["apiVersion"] == "ray.io/v1" and where != "head"]
    assert len(workers) >= 2 * len(JOBS)
    for where, pod in workers:
        [container] = pod["containers"]
        drain = {e["name"]: e.get("value") for e in container["env"]}["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"]
        assert pod["terminationGracePeriodSeconds"] >= float(drain) + 10, where


def test_a_network_policy_admits_only_the_clusters_own_pods_and_named_peers():
    for name, doc in _every_manifest():
        if doc["apiVersion"] != "ray.io/v1":
            continue
        instance = doc["metadata"]["name"]
        cluster = doc["spec"].get("rayClusterSpec", doc["spec"])
        for _, group in [("head", cluster["headGroupSpec"])] + [(0, g) for g in cluster["workerGroupSpecs"]]:
            assert group["template"]["metadata"]["labels"]["app.kubernetes.io/instance"] == instance
        if name.endswith(")"):  # rendered: its policy comes with it
            policies = [d for n, d in _every_manifest() if n == name and d["kind"] == "NetworkPolicy"]
        else:
            policies = [d for d in yaml.safe_load_all((REPO / "k8s" / name).read_text())
                        if d and d["kind"] == "NetworkPolicy"]
        [policy] = policies
        spec = policy["spec"]
        assert spec["podSelector"] == {"matchLabels": {"app.kubernetes.io/instance": instance}}
        assert spec["policyTypes"] == ["Ingress"]
        own, api, metrics = spec["ingress"]
        assert own == {"from": [{"podSelector": {"matchLabels": {"app.kubernetes.io/instance": instance}}}]}
        assert [p["port"] for p in api["ports"]] == [8265] and [p["port"] for p in metrics["ports"]] == [8080]
        assert all(peer.get("podSelector") for rule in spec["ingress"] for peer in rule["from"])


def test_an_empty_token_secret_is_refused_not_taken_for_no_auth(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert main(["k8s", "jobs/quickstart.yaml", "--token-secret", ""]) == 2
    assert "--token-secret is empty" in capsys.readouterr().err
    assert main(["k8s", "jobs/quickstart.yaml", "--no-auth"]) == 0
    assert "authOptions" not in capsys.readouterr().out
    assert main(["k8s", "jobs/quickstart.yaml", "--backoff-limit", "-1"]) == 2  # rendered, once
    assert "--backoff-limit -1 is invalid" in capsys.readouterr().err


def test_no_secret_is_on_a_command_line():
    """k8s/redis.yaml passed the Redis password as `--requirepass $(REDIS_PASSWORD)`, which the
    kubelet expands into the process's arguments, visible in the process list."""
    for name, doc in _every_manifest():
        for where, pod in _pods(doc):
            for c in pod["containers"] + pod.get("initContainers", []):
                line = " ".join(c.get("command", []) + c.get("args", []))
                # $(NAME) is expanded by the kubelet into the arguments; a password flag is one
                assert not re.search(r"\$\([A-Za-z_][A-Za-z0-9_]*\)|--\w*pass", line), (name, where, line)


def test_secrets_are_referenced_never_inline():
    for path in MANIFESTS:
        for doc in yaml.safe_load_all(path.read_text()):
            assert doc["kind"] != "Secret", path.name
            text = json.dumps(doc)
            assert "secretKeyRef" in text or "secretName" in text or "password" not in text.lower()


def test_nothing_is_exposed_outside_the_cluster():
    for path in MANIFESTS:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc["kind"] == "Service":
                assert doc["spec"].get("type", "ClusterIP") == "ClusterIP"
            if doc["apiVersion"] == "ray.io/v1":
                cluster = doc["spec"].get("rayClusterSpec", doc["spec"])
                assert cluster["headGroupSpec"]["serviceType"] == "ClusterIP"
                assert not cluster["headGroupSpec"].get("enableIngress")


# --- mutated manifests fail --------------------------------------------------------------------

def _job() -> dict:
    return rendered(REPO / "jobs" / "quickstart.yaml")[0]


def _mutate(path: str, value, obj=None) -> dict:
    obj = obj or _job()
    *parents, last = path.split(".")
    node = obj
    for key in parents:
        node = node[int(key)] if key.isdigit() else node[key]
    node[int(last) if last.isdigit() else last] = value
    return obj


@needs_schemas
def test_a_typod_field_fails():
    obj = _job()
    head = obj["spec"]["rayClusterSpec"]["headGroupSpec"]
    head["rayStartParms"] = head.pop("rayStartParams")
    assert any("rayStartParms" in e for e in crd_errors(obj))
    obj = _job()
    obj["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["imagePullPolcy"] = "Always"
    assert any("imagePullPolcy" in e for e in crd_errors(obj))
    assert crd_errors(_job()) == []  # the unmutated one passes


@needs_schemas
def test_an_integer_in_ray_start_params_fails_the_schema():
    obj = _mutate("spec.rayClusterSpec.headGroupSpec.rayStartParams.num-cpus", 0)
    assert any("rayStartParams.num-cpus" in e and "string" in e for e in crd_errors(obj))


def test_an_integer_in_ray_start_params_breaks_a_kuberay_rule():
    obj = _mutate("spec.rayClusterSpec.workerGroupSpecs.0.rayStartParams.num-gpus", 1)
    assert k8s.kuberay_errors(obj) == [
        "spec.rayClusterSpec.workerGroupSpecs[0].rayStartParams.num-gpus must be a string (quote 1)"]


def test_min_replicas_above_max_replicas_fails():
    obj = _mutate("spec.rayClusterSpec.workerGroupSpecs.0.minReplicas", 5)
    obj = _mutate("spec.rayClusterSpec.workerGroupSpecs.0.maxReplicas", 3, obj)
    assert k8s.kuberay_errors(obj) == ["spec.rayClusterSpec.workerGroupSpecs[0]: minReplicas 5 > maxReplicas 3"]


def test_a_60_character_name_fails():
    obj = _mutate("metadata.name", "a" * 60)
    assert any("at most 47" in e for e in k8s.kuberay_errors(obj))
    cluster = rendered(REPO / "jobs" / "quickstart.yaml", "RayCluster")[0]
    assert k8s.kuberay_errors(_mutate("metadata.name", "a" * 60, cluster)) == []  # 63 for a cluster
    assert any("DNS-1035" in e for e in k8s.kuberay_errors(_mutate("metadata.name", "Gpt_small")))


def test_job_rules_no_schema_carries():
    ttl = _mutate("spec.shutdownAfterJobFinishes", False)
    assert k8s.kuberay_errors(ttl) == ["spec.ttlSecondsAfterFinished needs spec.shutdownAfterJobFinishes: true"]
    assert any("submissionMode" in e for e in k8s.kuberay_errors(_mutate("spec.submissionMode", "Batch")))
    interactive = _mutate("spec.submissionMode", "InteractiveMode")
    assert k8s.kuberay_errors(interactive) == ["spec.backoffLimit > 0 cannot be used with InteractiveMode"]
    selector = _mutate("spec.clusterSelector", {"ray.io/cluster": "baton"})
    assert k8s.kuberay_errors(selector) == ["spec.backoffLimit > 0 cannot be used with spec.clusterSelector"]


def test_a_typod_core_field_fails():
    pvc = next(yaml.safe_load_all((REPO / "k8s" / "storage.yaml").read_text()))
    assert core_errors(pvc) == []
    pvc["spec"]["acessModes"] = pvc["spec"].pop("accessModes")
    assert core_errors(pvc)


def test_render_refuses_what_kuberay_would():
    spec = load_spec(REPO / "jobs" / "quickstart.yaml")
    with pytest.raises(SpecError, match="minReplicas 3 > maxReplicas 1"):
        k8s.render(spec, "jobs/quickstart.yaml", [], k8s.K8sOptions(min_workers=3, max_workers=1))
    with pytest.raises(SpecError, match="has 50 characters"):
        k8s.render(spec, "jobs/quickstart.yaml", [], k8s.K8sOptions(name="x" * 50))
    assert k8s.k8s_name("My_Job.v2", "RayJob") == "my-job-v2"
    assert k8s.k8s_name("7up", "RayJob") == "baton-7up"
    assert len(k8s.k8s_name("n" * 80, "RayJob")) == 47


def test_the_crd_validator_applies_defaults_before_validating():
    if not SCHEMAS.is_dir():
        pytest.skip(f"KubeRay CRD schemas not found at {SCHEMAS}")
    raw = json.loads((SCHEMAS / "rayjobs.v1.schema.json").read_text())
    stored = apply_defaults(raw, copy.deepcopy(_job()))
    assert stored["spec"]["submissionMode"] == "K8sJobMode"
    group = stored["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    assert group["numOfHosts"] == 1  # a default the object did not set
    pruned = apply_defaults(raw, _mutate("spec.activeDeadlineSeconds", None))
    assert "activeDeadlineSeconds" not in pruned["spec"]
