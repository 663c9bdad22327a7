"""Where the cluster secret, the admin key and the allowed bootstrap hosts come from: flags, environment."""

import contextlib
import io

import pytest

from disagg.cli import build_parser
from disagg.cli_args import dataclass_from_args
from disagg.config import BootstrapConfig, ConfigError, DisaggConfig, ServerConfig, admin_key, cluster_secret
from disagg.router.launch import config_from_args


def test_environment_is_read_in_config_only_and_empty_means_unset():
    assert cluster_secret({"DISAGG_CLUSTER_SECRET": "s1"}) == "s1"
    assert cluster_secret({"DISAGG_CLUSTER_SECRET": ""}) is None
    assert cluster_secret({}) is None
    assert admin_key({"DISAGG_ADMIN_KEY": "a1"}) == "a1"
    assert admin_key({}) is None


def test_defaults_follow_the_environment(monkeypatch):
    monkeypatch.setenv("DISAGG_CLUSTER_SECRET", "from-env")
    monkeypatch.setenv("DISAGG_ADMIN_KEY", "admin-env")
    assert DisaggConfig().cluster_secret == BootstrapConfig().cluster_secret == "from-env"
    assert ServerConfig().admin_key == "admin-env"
    for command in (["prefill"], ["decode"], ["serve"]):
        args = build_parser().parse_args(command)
        assert (args.cluster_secret, args.admin_key) == ("from-env", "admin-env")
    assert build_parser().parse_args(["bootstrap"]).cluster_secret == "from-env"
    assert build_parser().parse_args(["decode", "--cluster-secret", "flag"]).cluster_secret == "flag"
    help_text = io.StringIO()
    with contextlib.redirect_stdout(help_text), pytest.raises(SystemExit):
        build_parser().parse_args(["decode", "--help"])
    assert "from-env" not in help_text.getvalue() and "admin-env" not in help_text.getvalue()


def test_secrets_stay_out_of_reprs():
    config = DisaggConfig(cluster_secret="hidden-1")
    server = ServerConfig(api_key="hidden-2", admin_key="hidden-3")
    assert "hidden" not in repr(config) + repr(server) + repr(BootstrapConfig(cluster_secret="hidden-4"))


@pytest.mark.parametrize("make, message", [
    (lambda: DisaggConfig(cluster_secret=""), "cluster_secret must not be empty (leave it unset to turn it off)"),
    (lambda: BootstrapConfig(cluster_secret=""), "cluster_secret must not be empty (leave it unset to turn it off)"),
    (lambda: ServerConfig(admin_key=""), "admin_key must not be empty (leave it unset to turn it off)"),
    (lambda: DisaggConfig(allowed_bootstrap_hosts=("a", " b")),
     "allowed_bootstrap_hosts entry ' b' is not valid: it is empty or has spaces around it (use host, host:port, "
     "an IP network such as 10.0.0.0/8, or [IPv6]:port)"),
    (lambda: DisaggConfig(max_bootstrap_clients=0), "max_bootstrap_clients must be at least 1, got 0"),
    (lambda: BootstrapConfig(max_rooms=0), "max_rooms must be positive, got 0"),
    (lambda: BootstrapConfig(max_ranks=-1), "max_ranks must be positive, got -1"),
])
def test_invalid_values_are_config_errors(make, message):
    with pytest.raises(ConfigError) as info:
        make()
    assert str(info.value) == message


def test_allowed_bootstrap_hosts_from_a_comma_list():
    args = build_parser().parse_args(["decode", "--allowed-bootstrap-hosts", "10.0.0.5, prefill-0.svc:8998,"])
    config = dataclass_from_args(DisaggConfig, args)
    assert config.allowed_bootstrap_hosts == ("10.0.0.5", "prefill-0.svc:8998")
    assert [config.allows_bootstrap_address(h, p) for h, p in (
        ("10.0.0.5", 1), ("PREFILL-0.svc", 8998), ("prefill-0.svc", 8999), ("10.0.0.6", 8998), ("127.0.0.1", 8998))] == [
        True, True, False, False, False]
    anywhere = dataclass_from_args(DisaggConfig, build_parser().parse_args(["decode"]))
    assert anywhere.allowed_bootstrap_hosts == () and anywhere.allows_bootstrap_address("169.254.169.254", 80)
    assert anywhere.max_bootstrap_clients == 64
    assert dataclass_from_args(DisaggConfig, build_parser().parse_args(
        ["decode", "--max-bootstrap-clients", "3"])).max_bootstrap_clients == 3


def test_router_api_key_flag():
    base = ["router", "--prefill", "http://p:1", "--decode", "http://d:2"]
    assert config_from_args(build_parser().parse_args(base)).api_key is None
    assert config_from_args(build_parser().parse_args([*base, "--api-key", "rk"])).api_key == "rk"


def test_router_trust_client_routing_flag():
    base = ["router", "--prefill", "http://p:1", "--decode", "http://d:2"]
    assert config_from_args(build_parser().parse_args(base)).trust_client_routing is False
    assert config_from_args(build_parser().parse_args([*base, "--trust-client-routing"])).trust_client_routing is True


def test_registry_limits_from_flags():
    default = dataclass_from_args(BootstrapConfig, build_parser().parse_args(["bootstrap"]))
    assert (default.max_rooms, default.max_ranks) == (100_000, 4096)
    given = dataclass_from_args(BootstrapConfig, build_parser().parse_args(
        ["bootstrap", "--max-rooms", "5", "--max-ranks", "8"]))
    assert (given.max_rooms, given.max_ranks) == (5, 8)
