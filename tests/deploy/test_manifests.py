"""deploy/k8s: every overlay renders with the real kustomize, every object fits the Kubernetes
schemas, every container's arguments parse with the real `disagg` CLI (exact flag names) into valid
configs, and the objects agree with each other: selectors, named ports, Secret keys, network
policies, grace periods, RBAC and the GPU resources."""

from __future__ import annotations

import re

import pytest

from disagg.cli import disagg_from_args
from disagg.cli_args import dataclass_from_args
from disagg.config import ConfigError, ServerConfig
from disagg.pd_config import check_cluster_secret
from disagg.router.launch import config_from_args
from manifests import (
    K8S, NAMESPACE, POD_IP, by_kind, env_values, expand, matches, named_ports, parse_args, pod_spec, render,
    schema_errors,
)

pytestmark = pytest.mark.timeout(120)
OVERLAYS = ("cpu", "gpu")
EPHEMERAL_PORTS = (32768, 60999)  # where the workers' KV control and transfer listeners (port 0) land
DRAIN_MARGIN_S = 15  # after the drain: stopping the workers and the registry
EXPECTED = sorted([
    ("Deployment", "disagg-decode"), ("Deployment", "disagg-prefill"), ("Deployment", "disagg-router"),
    ("Namespace", "disagg"), ("NetworkPolicy", "disagg-decode"), ("NetworkPolicy", "disagg-prefill"),
    ("NetworkPolicy", "disagg-router"), ("PodDisruptionBudget", "disagg-decode"),
    ("PodDisruptionBudget", "disagg-prefill"), ("PodDisruptionBudget", "disagg-router"), ("Role", "disagg-router"),
    ("RoleBinding", "disagg-router"), ("Secret", "disagg-secrets"), ("Service", "disagg-decode"),
    ("Service", "disagg-prefill"), ("Service", "disagg-router"), ("ServiceAccount", "disagg-router"),
])


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request) -> tuple[str, list[dict]]:
    return request.param, render(K8S / "overlays" / request.param)


def container_of(objects: list[dict], name: str) -> dict:
    [container] = pod_spec(by_kind(objects, "Deployment")[name])["containers"]
    return container


def exact_flags_unknown(argv: list[str]) -> list[str]:
    """Flags in `argv` that are not spelled exactly as the parser defines them (argparse would also
    take an abbreviation, which would hide a rename)."""
    from disagg.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command").choices[argv[0]]
    known = set(sub._option_string_actions)
    return [arg for arg in argv[1:] if arg.startswith("--") and arg.split("=")[0] not in known]


def command_line(objects: list[dict], name: str):
    """(argv after `$(VAR)` expansion, parsed namespace) of the Deployment's one container."""
    container = container_of(objects, name)
    assert "command" not in container  # the image's ENTRYPOINT ["disagg"] runs
    argv = expand(container["args"], env_values(container))
    assert exact_flags_unknown(argv) == []
    return argv, parse_args(argv)


def test_every_overlay_renders_into_objects_that_fit_the_kubernetes_schemas(overlay):
    name, objects = overlay
    assert sorted((o["kind"], o["metadata"]["name"]) for o in objects) == EXPECTED
    assert {o["metadata"].get("namespace", NAMESPACE) for o in objects} == {NAMESPACE}
    assert [error for o in objects for error in schema_errors(o)] == []
    tag = {"cpu": "disagg:0.1.0-cpu", "gpu": "disagg:0.1.0-cuda"}[name]
    assert {c["image"] for d in by_kind(objects, "Deployment").values() for c in pod_spec(d)["containers"]} == {tag}


def test_the_monitoring_objects_render_and_have_their_required_fields():
    [monitor] = render(K8S / "monitoring")
    assert (monitor["kind"], monitor["metadata"]["namespace"], schema_errors(monitor)) == ("PodMonitor", NAMESPACE, [])
    assert monitor["spec"]["podMetricsEndpoints"] == [{"port": "http", "path": "/metrics", "interval": "15s"}]
    broken = dict(monitor, spec={"selector": monitor["spec"]["selector"]})
    assert schema_errors(broken) == ["PodMonitor/disagg-servers: spec.podMetricsEndpoints is required"]
    objects = render(K8S / "overlays" / "cpu")
    selected = [n for n, d in by_kind(objects, "Deployment").items()
                if d["spec"]["template"]["metadata"]["labels"]["role"] in
                next(e["values"] for e in monitor["spec"]["selector"]["matchExpressions"] if e["key"] == "role")]
    assert sorted(selected) == ["disagg-decode", "disagg-prefill"]
    assert all("http" in named_ports(container_of(objects, n)) for n in selected)


def test_server_command_lines_parse_into_the_configs_the_pods_need(overlay):
    name, objects = overlay
    for role in ("prefill", "decode"):
        deployment = by_kind(objects, "Deployment")[f"disagg-{role}"]
        container = container_of(objects, f"disagg-{role}")
        argv, args = command_line(objects, f"disagg-{role}")
        assert args.command == role
        server = dataclass_from_args(ServerConfig, args, disaggregation_mode=role)
        disagg = disagg_from_args(args)
        assert (server.host, server.port, server.shutdown_timeout_s) == ("0.0.0.0", named_ports(container)["http"], 30.0)
        assert (disagg.rank_host, disagg.transfer_backend) == (POD_IP, {"cpu": "tcp", "gpu": "nixl"}[name])
        assert server.api_key == "secret:api-key"
        assert pod_spec(deployment)["terminationGracePeriodSeconds"] == server.shutdown_timeout_s + DRAIN_MARGIN_S
        env = env_values(container)
        assert (env["DISAGG_CLUSTER_SECRET"], env["DISAGG_ADMIN_KEY"]) == ("secret:cluster-secret", "secret:admin-key")
        if role == "prefill":
            annotated = deployment["spec"]["template"]["metadata"]["annotations"]["sglang.ai/bootstrap-port"]
            assert disagg.prefill.bootstrap_host == POD_IP
            assert disagg.prefill.bootstrap_port == named_ports(container)["bootstrap"] == int(annotated)
        if name == "gpu":
            limits = container["resources"]["limits"]
            assert (args.device, int(limits["nvidia.com/gpu"]), limits["rdma/hca_shared_devices_a"]) == (
                "cuda", server.dp_size, "1")
            assert container["securityContext"]["capabilities"] == {"add": ["IPC_LOCK"], "drop": ["ALL"]}
        else:
            assert (args.device, server.dp_size, "nvidia.com/gpu" in container["resources"]["limits"]) == ("cpu", 2, False)


def test_every_server_holds_the_cluster_secret_its_network_binds_need(overlay, monkeypatch):
    """Each prefill and decode binds 0.0.0.0 and the pod IP: it takes DISAGG_CLUSTER_SECRET from the
    Secret (or says --insecure-no-cluster-secret), and the real check passes with the container's
    environment and fails without it."""
    _, objects = overlay
    for role in ("prefill", "decode"):
        container = container_of(objects, f"disagg-{role}")
        refs = [var["valueFrom"]["secretKeyRef"] for var in container.get("env", [])
                if var["name"] == "DISAGG_CLUSTER_SECRET" and "secretKeyRef" in var.get("valueFrom", {})]
        opted_out = "--insecure-no-cluster-secret" in container["args"]
        assert (refs, opted_out) == ([{"name": "disagg-secrets", "key": "cluster-secret"}], False)
        monkeypatch.setenv("DISAGG_CLUSTER_SECRET", env_values(container)["DISAGG_CLUSTER_SECRET"])
        _, args = command_line(objects, f"disagg-{role}")
        server = dataclass_from_args(ServerConfig, args, disaggregation_mode=role)
        assert disagg_from_args(args).cluster_secret == "secret:cluster-secret"
        check_cluster_secret(server, disagg_from_args(args))
        monkeypatch.delenv("DISAGG_CLUSTER_SECRET")
        _, args = command_line(objects, f"disagg-{role}")
        binds = f"0.0.0.0 (--host), {POD_IP} (--rank-host)" + (f", {POD_IP} (--bootstrap-host)" if role == "prefill" else "")
        with pytest.raises(ConfigError, match=re.escape(f"disagg {role} binds {binds} without a cluster secret:")):
            check_cluster_secret(server, disagg_from_args(args))


def test_the_router_discovers_exactly_the_server_pods(overlay):
    _, objects = overlay
    deployments = by_kind(objects, "Deployment")
    argv, args = command_line(objects, "disagg-router")
    config = config_from_args(args)
    discovery = config.discovery
    assert (config.port, config.shutdown_timeout_s, discovery.namespace) == (30000, 30.0, NAMESPACE)
    assert config.port == named_ports(container_of(objects, "disagg-router"))["http"]
    for role, selector in (("prefill", discovery.prefill_selector), ("decode", discovery.decode_selector)):
        wanted = dict(item.split("=", 1) for item in selector)
        chosen = [n for n, d in deployments.items() if matches(wanted, d["spec"]["template"]["metadata"]["labels"])]
        assert chosen == [f"disagg-{role}"]
        assert named_ports(container_of(objects, f"disagg-{role}"))["http"] == discovery.port
    router_spec = pod_spec(deployments["disagg-router"])
    assert router_spec["terminationGracePeriodSeconds"] >= config.shutdown_timeout_s + 10
    # Its service account may list and watch pods in its namespace, and nothing else.
    binding = by_kind(objects, "RoleBinding")["disagg-router"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": router_spec["serviceAccountName"],
                                    "namespace": NAMESPACE}]
    assert by_kind(objects, "Role")[binding["roleRef"]["name"]]["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]


def test_selectors_ports_and_secret_keys_refer_to_what_exists(overlay):
    _, objects = overlay
    deployments = by_kind(objects, "Deployment")
    labels = {n: d["spec"]["template"]["metadata"]["labels"] for n, d in deployments.items()}
    for name, deployment in deployments.items():
        assert matches(deployment["spec"]["selector"]["matchLabels"], labels[name])
        container = container_of(objects, name)
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if probe in container:
                port = (container[probe].get("httpGet") or container[probe].get("tcpSocket"))["port"]
                assert port in named_ports(container), f"{name} {probe} port {port!r} is not a named port"
    for name, service in by_kind(objects, "Service").items():
        [target] = [n for n in deployments if matches(service["spec"]["selector"], labels[n])]
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= set(named_ports(container_of(objects, target)))
    for name, budget in by_kind(objects, "PodDisruptionBudget").items():
        assert [n for n in deployments if matches(budget["spec"]["selector"]["matchLabels"], labels[n])] == [name]
    secrets = {n: set(s.get("stringData", {})) | set(s.get("data", {})) for n, s in by_kind(objects, "Secret").items()}
    refs = [var["valueFrom"]["secretKeyRef"] for n in deployments for var in container_of(objects, n).get("env", [])
            if "secretKeyRef" in var.get("valueFrom", {})]
    assert len(refs) == 7 and all(ref["key"] in secrets[ref["name"]] for ref in refs)


def ingress_rules(objects: list[dict], name: str) -> list[tuple[str, tuple]]:
    """(who may connect, their ports as (port, endPort)) for each rule of a NetworkPolicy."""
    policy = by_kind(objects, "NetworkPolicy")[name]
    out = []
    for rule in policy["spec"]["ingress"]:
        peers = [p.get("podSelector", {}).get("matchLabels", {}).get("role") or "other" for p in rule.get("from", [])]
        ports = tuple((p["port"], p.get("endPort")) for p in rule["ports"])
        out.append((",".join(peers) or "anyone", ports))
    return out


def test_network_policies_open_exactly_the_ports_the_arguments_configure(overlay):
    _, objects = overlay
    ports = {}
    for role in ("prefill", "decode", "router"):
        _, args = command_line(objects, f"disagg-{role}")
        ports[role] = args.port
    _, prefill_args = command_line(objects, "disagg-prefill")
    kv = (EPHEMERAL_PORTS[0], EPHEMERAL_PORTS[1])
    assert ingress_rules(objects, "disagg-prefill") == [
        ("router,other", ((ports["prefill"], None),)), ("decode", ((prefill_args.bootstrap_port, None), kv))]
    assert ingress_rules(objects, "disagg-decode") == [("router,other", ((ports["decode"], None),)), ("prefill", (kv,))]
    assert ingress_rules(objects, "disagg-router") == [("anyone", ((ports["router"], None),))]


def test_a_renamed_or_misspelt_flag_fails_the_check():
    objects = render(K8S / "overlays" / "cpu")
    container = container_of(objects, "disagg-prefill")
    argv = expand(container["args"], env_values(container))
    renamed = ["--rank-hostname" if a == "--rank-host" else a for a in argv]
    with pytest.raises(AssertionError, match="unrecognized arguments: --rank-hostname"):
        parse_args(renamed)
    abbreviated = ["--dp" if a == "--dp-size" else a for a in argv]
    assert exact_flags_unknown(abbreviated) == ["--dp"]  # argparse alone would take the abbreviation
    with pytest.raises(AssertionError, match=r"\$\(POD_IPS\) is not an env var"):
        expand(["--rank-host", "$(POD_IPS)"], env_values(container))
