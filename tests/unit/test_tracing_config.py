"""--otlp-traces-endpoint: `disagg serve` hands it to both servers and (start_cluster) the router;
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is its default; with tracing off no OpenTelemetry module loads;
without the SDK the flag fails with the extra to install."""

import subprocess
import sys

import pytest

from disagg import cli, cluster, tracing
from disagg.config import ConfigError, ServerConfig, otlp_traces_endpoint
from disagg.router.config import PrefillEndpoint, RouterConfig


def test_serve_gives_the_endpoint_to_both_servers(monkeypatch):
    seen = {}
    monkeypatch.setattr(cluster, "run", lambda engine, disagg, options: seen.update(options=options) or 0)
    assert cli.run(["serve", "--model", "tiny", "--otlp-traces-endpoint", "http://127.0.0.1:4318/v1/traces"]) == 0
    prefill, decode = cluster.server_configs(seen["options"])
    assert prefill.otlp_traces_endpoint == decode.otlp_traces_endpoint == "http://127.0.0.1:4318/v1/traces"


def test_the_environment_variable_is_the_default(monkeypatch):
    assert otlp_traces_endpoint({}) is None
    assert otlp_traces_endpoint({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}) == "http://c:4318/v1/traces"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://c:4318/v1/traces")
    router = RouterConfig(prefill=(PrefillEndpoint("http://127.0.0.1:1", 2),), decode=("http://127.0.0.1:3",))
    assert ServerConfig().otlp_traces_endpoint == router.otlp_traces_endpoint == "http://c:4318/v1/traces"
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    assert ServerConfig().otlp_traces_endpoint is None and tracing.open_tracing(None, "disagg-router") is None


def test_tracing_off_loads_no_opentelemetry():
    code = ("import sys, disagg.api.app, disagg.router.app, disagg.tracing; "
            "assert disagg.tracing.open_tracing(None, 'x') is None; "
            "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout == "[]\n"


def test_without_the_sdk_the_flag_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)  # an import of it fails
    with pytest.raises(ConfigError, match=r"^--otlp-traces-endpoint needs OpenTelemetry's SDK and OTLP exporter: "
                                          r"pip install 'disagg\[tracing\]' \("):
        tracing.open_tracing("http://127.0.0.1:4318/v1/traces", "disagg-router")
