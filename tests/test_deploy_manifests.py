"""The deployment manifests: deploy/serve.yaml and deploy/kuberay/*.yaml (each file one
RayService with its Service and NetworkPolicy: the GPU pair, and the coder pair on CPUs).

Offline and fast: no Ray cluster, no Kubernetes, no network. Each RayService is validated against
KubeRay's CRD schema (tests/data/kuberay) made strict, its serveConfigV2 and deploy/serve.yaml
against Ray Serve's own config schema, their `args` against the project config, and the
placement (custom resources, GPUs or CPUs, the head-pod Service) is checked for consistency.
"""
from __future__ import annotations

import copy
import json
import re
from functools import lru_cache
from pathlib import Path

import jsonschema
import pytest
import yaml
from pydantic import BaseModel
from ray.serve import Application
from ray.serve.schema import ServeDeploySchema

from specdec.app import build_app, build_config
from specdec.serving.autoscaling import SessionsPolicy
from specdec.serving.config import Config
from specdec.app.launch import COORDINATOR_SERVICER

REPO = Path(__file__).resolve().parent.parent
SERVE_YAML = REPO / "deploy" / "serve.yaml"
KUBERAY_DIR = REPO / "deploy" / "kuberay"
MANIFESTS = sorted(path.name for path in KUBERAY_DIR.glob("*.yaml"))
GPU_MANIFEST = "rayservice.yaml"
CRD_FILE = Path(__file__).resolve().parent / "data" / "kuberay" / "ray.io_rayservices.yaml"
APP_NAME = "specdec"
CLIENT_PORT = 50051
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the CRD is 1 MB: libyaml is 5x faster


def _load_all(path: Path) -> list:
    return [doc for doc in yaml.load_all(path.read_text(), Loader=_Loader) if doc is not None]


@lru_cache(maxsize=None)
def _kube_docs(manifest: str) -> tuple:
    return tuple(_load_all(KUBERAY_DIR / manifest))


def _kind(kind: str, manifest: str) -> list[dict]:
    return [copy.deepcopy(doc) for doc in _kube_docs(manifest) if doc.get("kind") == kind]


def _rayservice(manifest: str = GPU_MANIFEST) -> dict:
    found = _kind("RayService", manifest)
    assert len(found) == 1, f"expected one RayService in {manifest}, found {len(found)}"
    return found[0]


def _serve_configs() -> dict[str, dict]:
    """Every Serve config, by where it comes from."""
    configs = {"deploy/serve.yaml": _load_all(SERVE_YAML)[0]}
    for manifest in MANIFESTS:
        configs[f"{manifest} serveConfigV2"] = yaml.safe_load(_rayservice(manifest)["spec"]["serveConfigV2"])
    return configs


def _app(serve_config: dict) -> dict:
    apps = [a for a in serve_config["applications"] if a.get("name") == APP_NAME]
    assert len(apps) == 1, f"expected one application named {APP_NAME!r}"
    return apps[0]


def _kuberay_config(manifest: str) -> Config:
    return build_config(_app(_serve_configs()[f"{manifest} serveConfigV2"])["args"])


def test_both_pairs_have_a_manifest():
    assert MANIFESTS == ["rayservice-coder.yaml", "rayservice.yaml"], MANIFESTS
    assert {_rayservice(m)["metadata"]["name"] for m in MANIFESTS} == {"specdec", "specdec-coder"}


# --- the RayService against KubeRay's CRD, made strict ---------------------------------------

# Keys whose values are data, not sub-schemas.
_DATA_KEYS = {"default", "enum", "example", "required", "x-kubernetes-validations", "x-kubernetes-list-map-keys"}


def _strict(node):
    """A copy of a CRD (OpenAPI v3) schema that rejects unknown fields: every object schema
    with `properties` and no `additionalProperties` / `x-kubernetes-preserve-unknown-fields`
    of its own gets `additionalProperties: false`, as the API server's strict field validation
    does. Also maps the OpenAPI-only `nullable` and a bare `x-kubernetes-int-or-string` to JSON
    Schema."""
    if isinstance(node, list):
        return [_strict(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key == "properties":
            out[key] = {name: _strict(sub) for name, sub in value.items()}
        elif key in _DATA_KEYS:
            out[key] = value
        else:
            out[key] = _strict(value)
    if "properties" in out and "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    if out.get("nullable") and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    if out.get("x-kubernetes-int-or-string") and "type" not in out and "anyOf" not in out:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    return out


def _list_type(validator, list_type, instance, schema):
    """`x-kubernetes-list-type`: `set` items and `map` items' keys must be unique (`atomic`: no rule)."""
    if not validator.is_type(instance, "array"):
        return
    if list_type == "set":
        keys = [json.dumps(item, sort_keys=True) for item in instance]
    elif list_type == "map":
        names = schema.get("x-kubernetes-list-map-keys", [])
        item_props = schema.get("items", {}).get("properties", {})
        # The API server defaults missing key fields (e.g. a port's protocol) before comparing.
        keys = [
            json.dumps([item.get(n, item_props.get(n, {}).get("default")) for n in names])
            for item in instance
            if isinstance(item, dict)
        ]
    else:
        return
    duplicates = sorted({k for k in keys if keys.count(k) > 1})
    if duplicates:
        yield jsonschema.ValidationError(f"duplicate entries in a list of type {list_type!r}: {duplicates}")


_K8sValidator = jsonschema.validators.extend(jsonschema.Draft7Validator, {"x-kubernetes-list-type": _list_type})

_FORMATS = jsonschema.FormatChecker(formats=())  # only the Kubernetes formats below are checked


@_FORMATS.checks("int32")
def _int32(value) -> bool:
    return not isinstance(value, int) or -(2**31) <= value < 2**31


@_FORMATS.checks("int64")
def _int64(value) -> bool:
    return not isinstance(value, int) or -(2**63) <= value < 2**63


@_FORMATS.checks("int-or-string")
def _int_or_string(value) -> bool:
    return isinstance(value, (int, str)) and not isinstance(value, bool)


@lru_cache(maxsize=None)
def _crd() -> dict:
    return _load_all(CRD_FILE)[0]


@lru_cache(maxsize=None)
def _crd_version_schema(version: str = "v1") -> dict:
    versions = {v["name"]: v for v in _crd()["spec"]["versions"]}
    assert versions[version]["served"], f"CRD version {version} is not served"
    return versions[version]["schema"]["openAPIV3Schema"]


@lru_cache(maxsize=None)
def _strict_validator():
    schema = _strict(_crd_version_schema())
    _K8sValidator.check_schema(schema)
    return _K8sValidator(schema, format_checker=_FORMATS)


def _crd_errors(doc: dict, strict: bool = True) -> list[str]:
    validator = _strict_validator() if strict else _K8sValidator(_crd_version_schema(), format_checker=_FORMATS)
    return [
        f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
        for e in sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))
    ]


@pytest.mark.parametrize("manifest", MANIFESTS)
def test_rayservice_matches_the_strict_crd_schema(manifest):
    doc = _rayservice(manifest)
    crd = _crd()
    assert doc["apiVersion"] == f"{crd['spec']['group']}/v1"
    assert doc["kind"] == crd["spec"]["names"]["kind"]
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", doc["metadata"]["name"]), "RayService names are DNS-1035 labels"
    assert _crd_errors(doc) == []


@pytest.mark.parametrize(
    "where",
    [
        ("spec", "rayClusterConfig", "headGroupSpec"),
        ("spec",),
        ("spec", "rayClusterConfig", "workerGroupSpecs", 0),
        ("spec", "rayClusterConfig", "headGroupSpec", "template", "spec", "containers", 0),
    ],
    ids=lambda where: ".".join(map(str, where)),
)
def test_strict_schema_rejects_an_unknown_field(where):
    doc = _rayservice()
    target = doc
    for key in where:
        target = target[key]
    target["bogus"] = 1
    # The CRD as published lets it through; the strict copy must not.
    assert _crd_errors(doc, strict=False) == []
    errors = _crd_errors(doc)
    assert len(errors) == 1 and "bogus" in errors[0], errors
    assert errors[0].startswith(".".join(map(str, where)) + ":")


def test_strict_schema_rejects_a_duplicate_list_map_key():
    doc = _rayservice()
    ports = doc["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]["ports"]
    ports.append({**ports[0], "name": "again"})  # same containerPort and protocol
    errors = _crd_errors(doc)
    assert any("duplicate entries" in e for e in errors), errors


def test_strict_schema_checks_types():
    doc = _rayservice()
    doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replicas"] = "1"
    errors = _crd_errors(doc)
    assert len(errors) == 1 and "replicas" in errors[0] and "integer" in errors[0], errors


# --- the Serve configs against Ray Serve's schema --------------------------------------------


def _field_names(model: BaseModel) -> dict[str, str]:
    """Accepted input key -> attribute name (pydantic 2, or 1 via __fields__)."""
    fields = getattr(type(model), "model_fields", None) or type(model).__fields__
    names = {name: name for name in fields}
    names.update({f.alias: name for name, f in fields.items() if getattr(f, "alias", None)})
    return names


def _unknown_keys(model: BaseModel, data: dict, path: str = "") -> list[str]:
    """Keys of `data` that `model` has no field for. Ray Serve's schema ignores them silently
    (a misspelt key would just not take effect), so the test looks for them itself."""
    unknown = []
    names = _field_names(model)
    for key, value in data.items():
        if key not in names:
            unknown.append(path + key)
            continue
        attr = getattr(model, names[key])
        if isinstance(attr, BaseModel) and isinstance(value, dict):
            unknown += _unknown_keys(attr, value, f"{path}{key}.")
        elif isinstance(attr, list) and isinstance(value, list):
            for i, (sub, sub_data) in enumerate(zip(attr, value)):
                if isinstance(sub, BaseModel) and isinstance(sub_data, dict):
                    unknown += _unknown_keys(sub, sub_data, f"{path}{key}[{i}].")
    return unknown


def _parse_serve_config(data: dict) -> ServeDeploySchema:
    parse = getattr(ServeDeploySchema, "model_validate", None) or ServeDeploySchema.parse_obj
    model = parse(data)
    unknown = _unknown_keys(model, data)
    assert not unknown, f"keys Ray Serve does not know: {unknown}"
    return model


@pytest.mark.parametrize("source", sorted(_serve_configs()))
def test_serve_config_matches_ray_serve_schema(source):
    data = _serve_configs()[source]
    model = _parse_serve_config(data)
    app = next(a for a in model.applications if a.name == APP_NAME)
    assert app.import_path == "specdec.app:build_app"
    assert len(model.applications) == 1


def test_unknown_serve_config_keys_are_caught():
    data = _serve_configs()["deploy/serve.yaml"]
    _app(data)["route_prefx"] = "/"
    with pytest.raises(AssertionError, match=r"applications\[0\]\.route_prefx"):
        _parse_serve_config(data)


@pytest.mark.parametrize("source", sorted(_serve_configs()))
def test_app_args_are_a_valid_project_config(source):
    args = _app(_serve_configs()[source])["args"]
    assert "config_file" not in args, "the manifests carry the config inline"
    config = build_config(args)  # strict: raises ConfigError on unknown keys or bad values
    assert config.coordinator.port == CLIENT_PORT
    # The real builder: also has Ray check each ray_actor_options (no cluster needed to bind).
    assert isinstance(build_app(args), Application)


@pytest.mark.parametrize("source", sorted(_serve_configs()))
def test_serves_grpc_proxy_knows_the_coordinator_api(source):
    """Serve's gRPC proxy imports the servicer function by name: it must exist."""
    import importlib

    [function] = _serve_configs()[source]["grpc_options"]["grpc_servicer_functions"]
    assert function == COORDINATOR_SERVICER
    module, name = function.rsplit(".", 1)
    assert callable(getattr(importlib.import_module(module), name))
    assert _app(_serve_configs()[source])["route_prefix"] == "/"  # the OpenAI API's routes start at /v1


def test_local_serve_yaml_fits_one_machine():
    data = _serve_configs()["deploy/serve.yaml"]
    assert data["proxy_location"] == "HeadOnly" and data["http_options"]["port"] == 8000
    assert data["grpc_options"]["grpc_servicer_functions"] == [COORDINATOR_SERVICER]
    config = build_config(_app(data)["args"])
    for name in ("verifier", "drafter", "coordinator"):
        options = getattr(config, name).ray_actor_options
        # No GPUs or custom resources that a laptop lacks, and no CPUs reserved.
        assert options == {"num_cpus": 0}, f"{name}: {options}"
    for name in ("verifier", "drafter"):
        assert getattr(config, name).model.device == "cpu"


# --- placement on the KubeRay cluster --------------------------------------------------------


def _ray_start_resources(params: dict) -> dict[str, float]:
    """The `resources` rayStartParam: a JSON object, usually quoted once more for the shell
    ('"{\\"name\\": 1}"' in YAML)."""
    value = params.get("resources")
    if value is None:
        return {}
    parsed = json.loads(value)
    if isinstance(parsed, str):
        parsed = json.loads(parsed)
    assert isinstance(parsed, dict), value
    return {k: float(v) for k, v in parsed.items()}


def _groups(manifest: str) -> dict[str, dict]:
    cluster = _rayservice(manifest)["spec"]["rayClusterConfig"]
    groups = {"<head>": cluster["headGroupSpec"]}
    groups.update({g["groupName"]: g for g in cluster.get("workerGroupSpecs", [])})
    return groups


def _limit(group: dict, resource: str) -> int:
    containers = group["template"]["spec"]["containers"]
    return sum(int(c.get("resources", {}).get("limits", {}).get(resource, 0)) for c in containers)


def _advertisers(resource: str, manifest: str) -> dict[str, float]:
    return {
        name: amount
        for name, group in _groups(manifest).items()
        if (amount := _ray_start_resources(group.get("rayStartParams", {})).get(resource, 0)) > 0
    }


def _placed_services() -> list[tuple[str, str, str]]:
    """(manifest, service, the custom resource that places it) for each model service a
    manifest deploys (a drafter the coordinator runs in process has no deployment)."""
    placed = []
    for manifest in MANIFESTS:
        config = _kuberay_config(manifest)
        placed.append((manifest, "verifier", "verifier_node"))
        if not config.coordinator.drafter_in_process:
            placed.append((manifest, "drafter", "drafter_node"))
    return placed


def _unit(section) -> tuple[str, str, str]:
    """What a replica of `section` takes a pod's share of: (ray_actor_options key, rayStartParam,
    container limit): GPUs for a CUDA model, else CPUs."""
    return ("num_gpus", "num-gpus", "nvidia.com/gpu") if section.model.device.startswith("cuda") else ("num_cpus", "num-cpus", "cpu")


@pytest.mark.parametrize("manifest,service,resource", _placed_services())
def test_model_services_land_on_their_own_workers(manifest, service, resource):
    section = getattr(_kuberay_config(manifest), service)
    options = section.ray_actor_options
    option, param, limit = _unit(section)
    assert options.get(option, 0) >= 1, f"{service} must ask for {option}"
    assert options.get("resources", {}).get(resource, 0) > 0, f"{service} must ask for {resource}"

    advertisers = _advertisers(resource, manifest)
    assert advertisers and "<head>" not in advertisers, f"{resource} must come from worker groups only: {advertisers}"
    for name, amount in advertisers.items():
        group = _groups(manifest)[name]
        assert amount >= options["resources"][resource]
        count = int(group["rayStartParams"].get(param, 0))
        assert count >= options[option], f"{name} advertises {count} ({param})"
        assert _limit(group, limit) == count, f"{name}: the {limit} limit must match {param}"
        assert group["minReplicas"] >= 1 and group["replicas"] >= 1, f"{name} must start with a pod"
    if option == "num_cpus":  # torch's default, 0, would take the node's cores, not the pod's
        assert section.torch_threads == options["num_cpus"], f"{service}: torch_threads must be the CPUs it holds"


@pytest.mark.parametrize("manifest", MANIFESTS)
def test_groups_pass_kuberay_controller_checks(manifest):
    """The RayCluster checks KubeRay's controller makes (utils/validation.go) that a schema cannot."""
    for name, group in _groups(manifest).items():
        assert group["template"]["spec"]["containers"], f"{name} needs a container"
        params = group.get("rayStartParams", {})
        assert "labels" not in params, f"{name}: rayStartParams labels are refused; use the group's labels"
        assert not (group.get("resources") and set(params) & {"num-cpus", "num-gpus", "memory", "resources"}), (
            f"{name}: resources set both in rayStartParams and the group's resources field"
        )
        if name != "<head>":
            assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"], name


@pytest.mark.parametrize("manifest,service,resource", _placed_services())
def test_autoscaled_replicas_fit_the_worker_pods_the_autoscaler_may_add(manifest, service, resource):
    """Each replica takes its share (a GPU, or all of a CPU pod) of a pod of its own group: Serve
    must not ask for more replicas than the Ray autoscaler may bring pods for, and the policy
    must be the sessions policy (Serve's default counts handle requests, which the direct gRPC
    data plane never makes)."""
    assert _rayservice(manifest)["spec"]["rayClusterConfig"].get("enableInTreeAutoscaling")
    section = getattr(_kuberay_config(manifest), service)
    serve_config = _serve_configs()[f"{manifest} serveConfigV2"]
    [override] = [d for d in _app(serve_config)["deployments"] if d["name"] == service.capitalize()]
    scaling = override["autoscaling_config"]
    assert scaling["policy"]["policy_function"] == "specdec.serving.autoscaling:SessionsPolicy"
    policy = SessionsPolicy(**scaling["policy"]["policy_kwargs"])
    assert policy.target_sessions >= 1
    option, param, _ = _unit(section)
    groups, advertisers = _groups(manifest), _advertisers(resource, manifest)
    pods = sum(groups[name]["maxReplicas"] for name in advertisers)
    per_pod = min(int(groups[name]["rayStartParams"][param]) for name in advertisers) // section.ray_actor_options[option]
    assert 1 <= scaling["min_replicas"] <= scaling["max_replicas"] <= pods * per_pod


@pytest.mark.parametrize("manifest", MANIFESTS)
def test_verifier_and_drafter_never_share_a_worker_group(manifest):
    assert not set(_advertisers("verifier_node", manifest)) & set(_advertisers("drafter_node", manifest))


@pytest.mark.parametrize("manifest", MANIFESTS)
def test_coordinator_is_pinned_to_the_head(manifest):
    options = _kuberay_config(manifest).coordinator.ray_actor_options
    assert options.get("num_cpus") == 0
    assert options.get("resources", {}).get("coordinator_node", 0) > 0
    advertisers = _advertisers("coordinator_node", manifest)
    assert list(advertisers) == ["<head>"], advertisers
    assert advertisers["<head>"] >= options["resources"]["coordinator_node"]


@pytest.mark.parametrize("manifest", MANIFESTS)
def test_images_match_ray_version(manifest):
    cluster = _rayservice(manifest)["spec"]["rayClusterConfig"]
    version = cluster["rayVersion"]
    for name, group in _groups(manifest).items():
        for container in group["template"]["spec"]["containers"]:
            image = container["image"]
            assert re.fullmatch(rf"rayproject/ray:{re.escape(version)}(-py3\d+)?(-(gpu|cu\d+|cpu))?", image), (name, image)


# --- the Service in front of the coordinator -------------------------------------------------


def _head_pod_labels(cluster_name: str, template_labels: dict) -> dict[str, str]:
    """What KubeRay (v1.x, common/pod.go labelPod and BuildPod) puts on a RayService's head pod
    once the RayService controller has found its Serve proxy healthy."""
    labels = {
        "ray.io/is-ray-node": "yes",
        "ray.io/cluster": cluster_name,
        "ray.io/node-type": "head",
        "ray.io/group": "headgroup",
        "ray.io/identifier": f"{cluster_name}-head",
        "app.kubernetes.io/name": "kuberay",
        "app.kubernetes.io/created-by": "kuberay-operator",
    }
    protected = {"ray.io/node-type", "ray.io/group", "ray.io/cluster"}
    labels.update({k: v for k, v in template_labels.items() if k not in protected})
    labels["ray.io/serve"] = "true"
    return labels


def _head_labels_of(manifest: str, suffix: str = "x7k2p") -> dict[str, str]:
    """The labels of `manifest`'s head pod in a cluster RayService named with `suffix`."""
    service = _rayservice(manifest)
    template = service["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]
    return _head_pod_labels(f"{service['metadata']['name']}-{suffix}", template.get("metadata", {}).get("labels", {}))


def _service(manifest: str) -> dict:
    services = _kind("Service", manifest)
    assert len(services) == 1, f"expected one Service in {manifest}, found {len(services)}"
    return services[0]


@pytest.mark.parametrize("manifest", MANIFESTS)
def test_service_exposes_the_coordinator_port_on_the_head_container(manifest):
    service = _service(manifest)
    assert service["apiVersion"] == "v1"
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", service["metadata"]["name"])
    [port] = [p for p in service["spec"]["ports"] if p["port"] == CLIENT_PORT]
    assert port.get("protocol", "TCP") == "TCP"

    head = _rayservice(manifest)["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    target = port.get("targetPort", port["port"])
    by_name = {p.get("name"): p["containerPort"] for p in head.get("ports", [])}
    container_port = by_name[target] if isinstance(target, str) else target
    assert container_port == _kuberay_config(manifest).coordinator.port == CLIENT_PORT, (
        f"the Service sends {port['port']} to head container port {container_port}"
    )
    assert container_port in by_name.values(), "declare the port on the head container"


@pytest.mark.parametrize("manifest", MANIFESTS)
def test_service_selects_only_this_rayservice_head_pod(manifest):
    selector = _service(manifest)["spec"]["selector"]
    assert selector.get("ray.io/node-type") == "head"
    # RayService names its clusters "<name>-<random suffix>", new ones on every upgrade.
    for suffix in ("x7k2p", "9qd4w"):
        head = _head_labels_of(manifest, suffix)
        assert selector.items() <= head.items(), f"selector {selector} misses head labels {head}"

        worker = {**head, "ray.io/node-type": "worker", "ray.io/group": "verifier-gpu"}
        assert not selector.items() <= worker.items(), "must not select worker pods"

    unhealthy = {**_head_labels_of(manifest), "ray.io/serve": "false"}
    other_heads = [_head_pod_labels("someone-else", {}), *(_head_labels_of(other) for other in MANIFESTS if other != manifest)]
    for labels in (unhealthy, *other_heads):
        assert not selector.items() <= labels.items(), labels


def _admitted(policy: dict, pod_labels: dict, source_labels: dict | None, port: int) -> bool:
    """Whether `policy` lets a TCP connection to `port` of a pod with `pod_labels` in, from a
    pod with `source_labels` (None = from outside the cluster's pods)."""
    spec = policy["spec"]
    if not spec["podSelector"]["matchLabels"].items() <= pod_labels.items():
        return True  # not selected: this policy says nothing about the pod
    for rule in spec.get("ingress", []):
        sources = rule.get("from")
        source_ok = sources is None or (
            source_labels is not None and any(s["podSelector"]["matchLabels"].items() <= source_labels.items() for s in sources)
        )
        ports = rule.get("ports")
        port_ok = ports is None or any(p["port"] == port and p.get("protocol", "TCP") == "TCP" for p in ports)
        if source_ok and port_ok:
            return True
    return False


def _pods(manifest: str) -> list[dict]:
    """The labels of `manifest`'s head pod and of a pod of each worker group."""
    cluster = _rayservice(manifest)["spec"]["rayClusterConfig"]
    workers = [
        {**group["template"].get("metadata", {}).get("labels", {}), "ray.io/node-type": "worker"} for group in cluster["workerGroupSpecs"]
    ]
    return [_head_labels_of(manifest), *workers]


@pytest.mark.parametrize("manifest", MANIFESTS)
def test_network_policy_keeps_every_port_but_the_client_api_inside_the_rayservice(manifest):
    [policy] = _kind("NetworkPolicy", manifest)
    assert policy["apiVersion"] == "networking.k8s.io/v1" and policy["spec"]["policyTypes"] == ["Ingress"]
    ours = _pods(manifest)
    outsiders = [{"app": "something-else"}, *(pod for other in MANIFESTS if other != manifest for pod in _pods(other))]
    for pod in ours:
        for port in (6379, 8265, 10001, 8080, 43121):  # GCS, dashboard, client, metrics, a replica's gRPC port
            assert not _admitted(policy, pod, None, port), (pod, port)
            assert not any(_admitted(policy, pod, outsider, port) for outsider in outsiders), (pod, port)
            assert all(_admitted(policy, pod, peer, port) for peer in ours), (pod, port)
    for port in (CLIENT_PORT, 8000, 9000):  # the client APIs: coordinator gRPC, OpenAI HTTP, Serve's gRPC proxy
        assert _admitted(policy, ours[0], None, port) and all(_admitted(policy, ours[0], o, port) for o in outsiders)


DASHBOARD = REPO / "deploy" / "grafana" / "specdec_dashboard.json"
EXPORTED = re.compile(r"metrics\.(?:Counter|Gauge|Histogram)\(\s*\"([a-z_]+)\"")
QUERIED = re.compile(r"ray_((?:specdec|spec_decode)_[a-z_]*[a-z])")


def exported_metrics() -> set[str]:
    """The metric names the services declare (Ray exports each as ray_<name>)."""
    sources = [
        *REPO.glob("coordinator/*.py"), *REPO.glob("specdec/serving/*.py"), *REPO.glob("drafter_service/*.py"),
        *REPO.glob("verifier_service/*.py"),
    ]
    return {name for path in sources for name in EXPORTED.findall(path.read_text())}


def test_the_grafana_dashboard_queries_only_metrics_the_services_export():
    dashboard = json.loads(DASHBOARD.read_text())
    assert any(v["name"] == "datasource" and v["type"] == "datasource" for v in dashboard["templating"]["list"])
    queried = set()
    for panel in dashboard["panels"]:
        assert panel["targets"] and panel["datasource"] == "${datasource}", panel["title"]
        for target in panel["targets"]:
            queried |= {re.sub(r"_(bucket|sum|count)$", "", name) for name in QUERIED.findall(target["expr"])}
    exported = exported_metrics()
    assert queried - exported == set(), f"the dashboard queries metrics no service exports: {sorted(queried - exported)}"
    # What a dashboard of this system must show, each on some panel.
    for name in ("specdec_generated_tokens", "spec_decode_num_accepted_tokens_per_pos", "specdec_rounds", "specdec_round_time_ms",
                 "specdec_drafter_failures", "specdec_replica_sessions", "specdec_replica_kv_cache_mib"):
        assert name in queried, name


def test_the_dashboard_check_catches_a_metric_nobody_exports():
    assert QUERIED.findall('rate({__name__=~"ray_specdec_made_up(_total)?"}[1m])') == ["specdec_made_up"]
    assert "specdec_made_up" not in exported_metrics() and "specdec_requests" in exported_metrics()
