"""Where the cluster secret, the admin key and the allowed bootstrap hosts come from: flags, environment; when a
missing cluster secret refuses a start; the TLS options."""

import contextlib
import io

import pytest

from disagg.cli import build_parser, disagg_from_args
from disagg.cli_args import dataclass_from_args
from disagg.config import ConfigError, ServerConfig, TlsConfig, admin_key, cluster_secret
from disagg.pd_config import DecodeConfig, DisaggConfig, check_cluster_secret, with_settings
from disagg.registry_config import BootstrapConfig
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
    (lambda: DecodeConfig(allowed_bootstrap_hosts=("a", " b")),
     "allowed_bootstrap_hosts entry ' b' is not valid: it is empty or has spaces around it (use host, host:port, "
     "an IP network such as 10.0.0.0/8, or [IPv6]:port)"),
    (lambda: DecodeConfig(max_bootstrap_clients=0), "max_bootstrap_clients must be at least 1, got 0"),
    (lambda: BootstrapConfig(max_rooms=0), "max_rooms must be positive, got 0"),
    (lambda: BootstrapConfig(max_ranks=-1), "max_ranks must be positive, got -1"),
])
def test_invalid_values_are_config_errors(make, message):
    with pytest.raises(ConfigError) as info:
        make()
    assert str(info.value) == message


def test_allowed_bootstrap_hosts_from_a_comma_list():
    args = build_parser().parse_args(["decode", "--allowed-bootstrap-hosts", "10.0.0.5, prefill-0.svc:8998,"])
    config = disagg_from_args(args).decode
    assert config.allowed_bootstrap_hosts == ("10.0.0.5", "prefill-0.svc:8998")
    assert [config.allows_bootstrap_address(h, p) for h, p in (
        ("10.0.0.5", 1), ("PREFILL-0.svc", 8998), ("prefill-0.svc", 8999), ("10.0.0.6", 8998), ("127.0.0.1", 8998))] == [
        True, True, False, False, False]
    anywhere = disagg_from_args(build_parser().parse_args(["decode"])).decode
    assert anywhere.allowed_bootstrap_hosts == () and anywhere.allows_bootstrap_address("169.254.169.254", 80)
    assert anywhere.max_bootstrap_clients == 64
    assert disagg_from_args(build_parser().parse_args(
        ["decode", "--max-bootstrap-clients", "3"])).decode.max_bootstrap_clients == 3


def test_router_api_key_flag():
    base = ["router", "--prefill", "http://p:1", "--decode", "http://d:2"]
    assert config_from_args(build_parser().parse_args(base)).api_key is None
    assert config_from_args(build_parser().parse_args([*base, "--api-key", "rk"])).api_key == "rk"


def refusal(command: str, binds: str) -> str:
    return (f"disagg {command} binds {binds} without a cluster secret: anyone who reaches its ports could write "
            "bootstrap registry routes, open KV control streams and read or write KV blocks. Give every prefill, "
            "decode and bootstrap of the cluster the same secret with --cluster-secret or the environment variable "
            "DISAGG_CLUSTER_SECRET (not shown by ps), bind loopback addresses only, or pass "
            "--insecure-no-cluster-secret to run the internal planes open, as SGLang and vLLM do")


def check(mode: str, host: str = "127.0.0.1", switch: bool = False, **disagg) -> str | None:
    """The refusal `check_cluster_secret` gives (None: the server may start); no secret unless given."""
    config = with_settings(DisaggConfig(cluster_secret=None), **disagg)
    try:
        check_cluster_secret(ServerConfig(host=host, disaggregation_mode=mode, enable_pd_role_switch=switch), config)
    except ConfigError as exc:
        return str(exc)
    return None


def test_a_prefill_or_decode_that_binds_a_non_loopback_address_needs_a_cluster_secret():
    assert check("prefill", "0.0.0.0") == refusal("prefill", "0.0.0.0 (--host)")
    assert check("decode", "::", rank_host="10.0.0.5") == refusal("decode", ":: (--host), 10.0.0.5 (--rank-host)")
    assert check("prefill", rank_host="10.0.0.5", bootstrap_host="prefill-0.svc") == refusal(
        "prefill", "10.0.0.5 (--rank-host), prefill-0.svc (--bootstrap-host)")  # a name may resolve anywhere
    assert check("decode", bootstrap_host="0.0.0.0") is None  # a decode binds no registry: the field is the prefill's
    # ... unless it may become a prefill (--enable-pd-role-switch): it runs its registry in both roles
    assert check("decode", bootstrap_host="0.0.0.0", switch=True) == refusal("decode", "0.0.0.0 (--bootstrap-host)")
    assert check("null", "0.0.0.0", rank_host="0.0.0.0") is None  # unified: no internal planes


@pytest.mark.parametrize("host", ["127.0.0.1", "127.8.9.10", "::1", "[::1]", "localhost", "LocalHost"])
def test_loopback_binds_need_no_secret(host):
    assert check("prefill", host, rank_host=host, bootstrap_host=host) is None
    assert check("decode", host, rank_host=host) is None
    assert BootstrapConfig(host=host, cluster_secret=None).host == host


def test_a_secret_or_the_explicit_opt_out_lets_it_start():
    assert check("prefill", "0.0.0.0", rank_host="10.0.0.5", cluster_secret="s") is None
    assert check("decode", "0.0.0.0", rank_host="10.0.0.5", insecure_no_cluster_secret=True) is None
    args = build_parser().parse_args(["prefill", "--host", "0.0.0.0", "--insecure-no-cluster-secret"])
    assert disagg_from_args(args).insecure_no_cluster_secret is True
    assert disagg_from_args(build_parser().parse_args(["decode"])).insecure_no_cluster_secret is False
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit):  # a switch: no --no- form
        build_parser().parse_args(["decode", "--no-insecure-no-cluster-secret"])
    assert "unrecognized arguments: --no-insecure-no-cluster-secret" in err.getvalue()
    with contextlib.redirect_stderr(io.StringIO()), pytest.raises(SystemExit):  # serve draws its own secret
        build_parser().parse_args(["serve", "--insecure-no-cluster-secret"])


def test_a_standalone_bootstrap_on_a_non_loopback_address_needs_a_cluster_secret():
    with pytest.raises(ConfigError) as info:
        BootstrapConfig(host="0.0.0.0", cluster_secret=None)
    assert str(info.value) == refusal("bootstrap", "0.0.0.0 (--host)")
    assert BootstrapConfig(host="0.0.0.0", cluster_secret="s").cluster_secret == "s"
    args = build_parser().parse_args(["bootstrap", "--host", "10.0.0.5", "--insecure-no-cluster-secret"])
    assert dataclass_from_args(BootstrapConfig, args, cluster_secret=None).insecure_no_cluster_secret is True


@pytest.mark.parametrize("options, message", [
    (dict(ssl_keyfile="k.pem"), "--ssl-keyfile, --ssl-ca-certs and --ssl-cert-reqs need --ssl-certfile "
                                "(without a certificate the server speaks plain HTTP)"),
    (dict(ssl_ca_certs="ca.pem"), "--ssl-keyfile, --ssl-ca-certs and --ssl-cert-reqs need --ssl-certfile "
                                  "(without a certificate the server speaks plain HTTP)"),
    (dict(ssl_certfile="c.pem", ssl_cert_reqs=3), "--ssl-cert-reqs must be 0 (none), 1 (optional) or 2 (required), got 3"),
    (dict(ssl_certfile="c.pem", ssl_cert_reqs=2),
     "--ssl-cert-reqs 2 needs --ssl-ca-certs: the CA certificates that verify client certificates"),
    (dict(ssl_certfile=""), "--ssl-certfile must not be empty (leave it unset)"),
])
def test_tls_options_that_cannot_work_are_config_errors(options, message):
    with pytest.raises(ConfigError) as info:
        TlsConfig(**options)
    assert str(info.value) == message


def test_tls_flags_are_vllms_on_every_server_and_the_router():
    tls = ["--ssl-certfile", "c.pem", "--ssl-keyfile", "k.pem", "--ssl-ca-certs", "ca.pem", "--ssl-cert-reqs", "2"]
    expected = TlsConfig(ssl_keyfile="k.pem", ssl_certfile="c.pem", ssl_ca_certs="ca.pem", ssl_cert_reqs=2)
    for command in ("unified", "prefill", "decode", "serve"):
        assert dataclass_from_args(TlsConfig, build_parser().parse_args([command, *tls])) == expected
    assert dataclass_from_args(TlsConfig, build_parser().parse_args(["unified"])) == TlsConfig()
    assert (TlsConfig().scheme, expected.scheme) == ("http", "https")
    base = ["router", "--prefill", "https://p:1", "--decode", "https://d:2"]
    router = config_from_args(build_parser().parse_args([*base, *tls, "--upstream-ca-certs", "up.pem",
                                                         "--upstream-certfile", "rc.pem", "--upstream-keyfile", "rk.pem"]))
    assert (router.tls, router.upstream_ca_certs, router.upstream_certfile, router.upstream_keyfile) == (
        expected, "up.pem", "rc.pem", "rk.pem")
    with pytest.raises(ConfigError) as info:
        config_from_args(build_parser().parse_args([*base, "--upstream-keyfile", "rk.pem"]))
    assert str(info.value) == "--upstream-keyfile needs --upstream-certfile"


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
