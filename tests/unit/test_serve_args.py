"""`disagg serve`'s options that shape the two servers differently: the decode's step budget and TP
size, and the decode's local-prefill limit (the router reads it from the decode's /server_info); and
the admission limits that both servers get alike. Every flag comes from the config that takes it."""

import pytest

from disagg import cli, cluster
from disagg.config import ConfigError
from disagg.router.config import CacheAwareConfig, PlannerConfig, PlannerMode


def captured_run(monkeypatch, argv: list[str]) -> dict:
    seen = {}

    def fake_run(engine, disagg, options):
        seen.update(engine=engine, disagg=disagg, decode_engine=options.decode.engine(engine),
                    tools=options.servers.tools, cache_aware=options.cache_aware, options=options)
        return 0

    monkeypatch.setattr(cluster, "run", fake_run)
    assert cli.run(["serve", "--model", "tiny", *argv]) == 0
    return seen


def test_the_decode_gets_its_own_step_budget_and_the_prefill_keeps_the_engines(monkeypatch):
    seen = captured_run(monkeypatch, ["--max-num-batched-tokens", "512", "--decode-max-num-batched-tokens", "48",
                                      "--max-local-prefill-tokens", "192"])
    assert seen["engine"].scheduler.max_num_batched_tokens == 512
    assert seen["decode_engine"].scheduler.max_num_batched_tokens == 48
    assert seen["decode_engine"].model == seen["engine"].model and seen["decode_engine"].cache == seen["engine"].cache
    assert seen["disagg"].decode.max_local_prefill_tokens == 192


def test_the_router_takes_a_short_rest_locally_only_from_a_busy_prefill_unless_told_otherwise(monkeypatch):
    assert captured_run(monkeypatch, [])["cache_aware"] == CacheAwareConfig(local_prefill_min_prefill_load=1)
    seen = captured_run(monkeypatch, ["--local-prefill-min-prefill-load", "0", "--max-local-prefill-tokens", "192"])
    assert seen["cache_aware"] == CacheAwareConfig(local_prefill_min_prefill_load=0)
    assert seen["disagg"].decode.max_local_prefill_tokens == 192  # the decode's; the router reads it there
    monkeypatch.setattr(cluster, "run", lambda *args, **kwargs: pytest.fail("started"))
    with pytest.raises(ConfigError, match=r"^--local-prefill-min-prefill-load must be >= 0, got -1$"):
        cli.run(["serve", "--model", "tiny", "--local-prefill-min-prefill-load", "-1"])


def test_the_decode_gets_its_own_prompt_tokens_per_step(monkeypatch):
    seen = captured_run(monkeypatch, ["--decode-max-prefill-tokens-per-step", "24", "--max-local-prefill-tokens", "192",
                                      "--decode-max-num-seqs", "16"])
    assert (seen["engine"].scheduler.max_num_seqs, seen["decode_engine"].scheduler.max_num_seqs) == (64, 16)
    assert (seen["engine"].scheduler.max_prefill_tokens_per_step, seen["engine"].scheduler.max_num_batched_tokens) == (
        0, 1024)
    assert (seen["decode_engine"].scheduler.max_prefill_tokens_per_step,
            seen["decode_engine"].scheduler.max_num_batched_tokens) == (24, 1024)


def test_the_decode_gets_its_own_tp_size(monkeypatch):
    seen = captured_run(monkeypatch, ["--tp-size", "2", "--decode-tp-size", "1", *AS_THE_PREFILL])
    assert (seen["engine"].tensor_parallel_size, seen["decode_engine"].tensor_parallel_size) == (2, 1)
    assert seen["decode_engine"].scheduler == seen["engine"].scheduler
    seen = captured_run(monkeypatch, ["--decode-tensor-parallel-size", "2"])
    assert (seen["engine"].tensor_parallel_size, seen["decode_engine"].tensor_parallel_size) == (1, 2)
    assert captured_run(monkeypatch, ["--tp-size", "2", *AS_THE_PREFILL])["decode_engine"] is None  # both TP 2


# the decode settings `disagg serve` sizes, given as the prefill's engine has them
AS_THE_PREFILL = ["--decode-max-num-seqs", "64", "--decode-max-prefill-tokens-per-step", "0"]


def test_without_a_decode_setting_of_its_own_both_run_one_engine(monkeypatch):
    assert captured_run(monkeypatch, AS_THE_PREFILL)["decode_engine"] is None


def test_tool_flags_and_the_chat_template_reach_both_servers(monkeypatch):
    seen = captured_run(monkeypatch, ["--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                                      "--chat-template", "deploy/templates/tool_chat_template_hermes.jinja"])
    assert (seen["tools"].enable_auto_tool_choice, seen["tools"].tool_call_parser) == (True, "hermes")
    assert seen["engine"].model.chat_template == "deploy/templates/tool_chat_template_hermes.jinja"
    assert captured_run(monkeypatch, [])["tools"].enable_auto_tool_choice is False


def test_auto_tool_choice_without_a_parser_fails_before_anything_starts(monkeypatch, capsys):
    monkeypatch.setattr(cluster, "run", lambda *args: pytest.fail("started"))
    with pytest.raises(SystemExit) as exited:
        cli.main(["serve", "--model", "tiny", "--enable-auto-tool-choice"])
    assert exited.value.code == 2
    assert capsys.readouterr().err == "disagg: error: --enable-auto-tool-choice requires --tool-call-parser\n"


def test_the_router_runs_cache_aware_with_the_decodes_local_prefill_limit():
    from types import SimpleNamespace

    from disagg.router.policy import Policy

    prefill, decode = SimpleNamespace(port=7001, bootstrap_port=7002), SimpleNamespace(port=7003)
    cache_aware = CacheAwareConfig(local_prefill_min_prefill_load=3)
    config = cluster.router_config(prefill, decode, cache_aware, host="127.0.0.1", port=9)
    assert (config.policy, config.cache_aware) == (Policy.CACHE_AWARE, cache_aware)
    assert (config.prefill[0].url, config.prefill[0].bootstrap_port, config.decode) == (
        "http://127.0.0.1:7001", 7002, ("http://127.0.0.1:7003",))


def test_both_servers_get_the_admission_limits(monkeypatch):
    options = captured_run(monkeypatch, ["--max-waiting-requests", "2", "--max-kv-usage", "0.9"])["options"]
    assert (options.servers.max_waiting_requests, options.servers.max_kv_usage) == (2, 0.9)
    prefill, decode = cluster.server_configs(options)
    assert (prefill.max_waiting_requests, decode.max_waiting_requests, decode.max_kv_usage) == (2, 2, 0.9)
    options = captured_run(monkeypatch, ["--max-waiting-requests", "0"])["options"]
    assert (options.servers.max_waiting_requests, options.servers.max_kv_usage) == (0, 1.0)  # off, as on one server


@pytest.mark.parametrize("flags, error", [
    (["--max-waiting-requests", "-1"], "max_waiting_requests must be >= 0 (0: no limit), got -1"),
    (["--max-kv-usage", "0"], "max_kv_usage must be in (0, 1] (1: off), got 0.0"),
])
def test_a_bad_admission_limit_fails_before_anything_starts(monkeypatch, flags, error):
    monkeypatch.setattr(cluster, "run", lambda *args: pytest.fail("started"))
    with pytest.raises(ConfigError) as refused:
        cli.run(["serve", "--model", "tiny", *flags])
    assert str(refused.value) == error


def test_the_options_reach_the_servers_and_the_router(monkeypatch):
    seen = captured_run(monkeypatch, ["--port", "0", "--dp-size", "1", "--log-format", "json", "--host", "127.0.0.2",
                                      "--shutdown-timeout-s", "7", "--prefill-cpus", "0", "--decode-cpus", "0"])
    o = seen["options"]
    assert (o.servers.host, o.port, o.servers.dp_size, o.servers.log_format, o.servers.shutdown_timeout_s,
            o.prefill_cpus, o.decode_cpus) == (
        "127.0.0.2", 0, 1, "json", 7.0, "0", "0")


def test_every_serve_flag_is_a_field_of_a_config_it_passes_on():
    """No flag of `disagg serve` is declared by hand: each is a field of a config the cluster is built
    from, so a setting has one declaration and one default."""
    import dataclasses

    from disagg.config import ServerConfig, TlsConfig
    from disagg.engine_config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from disagg.pd_config import ControlConfig, DecodeConfig, DisaggConfig, PrefillConfig, TcpListenerConfig
    from disagg.tool_config import ToolConfig

    configs = (ModelConfig, CacheConfig, SchedulerConfig, EngineConfig, DisaggConfig, PrefillConfig, DecodeConfig,
               ControlConfig, TcpListenerConfig, ServerConfig, ToolConfig, TlsConfig, CacheAwareConfig,
               PlannerConfig, cluster.ClusterOptions, cluster.DecodeOverrides)
    fields = {f.name for cls in configs for f in dataclasses.fields(cls)}
    serve = next(a for a in cli.build_parser()._subparsers._group_actions[0].choices.items() if a[0] == "serve")[1]
    flags = {action.dest for action in serve._actions if action.dest != "help"}
    assert sorted(flags - fields) == []
    assert {"dp_size", "local_prefill_min_prefill_load", "max_local_prefill_tokens", "decode_max_num_seqs",
            "prefill_cpus", "port", "max_waiting_requests"} <= flags


def test_unset_settings_are_sized_to_the_cpus_each_role_gets(monkeypatch):
    """On 2 CPUs: a worker a role, 4 waiting requests a worker, the decode prefilling a short rest
    itself in 24-token chunks beside at most 4 decoding requests, 8 when no prefill serves, the planner
    switching roles (both servers switchable); every note on the ready line."""
    monkeypatch.setattr(cluster, "usable_cpus", lambda: frozenset({0, 1}))
    monkeypatch.setattr(cli, "usable_cpus", lambda: frozenset({0, 1}))
    seen = captured_run(monkeypatch, [])
    o = seen["options"]
    prefill, decode = cluster.server_configs(o)
    assert (prefill.dp_size, prefill.cpus, decode.dp_size, decode.cpus) == (1, "0", 1, "1")
    assert (prefill.max_waiting_requests, decode.max_waiting_requests) == (4, 4)
    assert (prefill.enable_pd_role_switch, decode.enable_pd_role_switch) == (True, True)
    assert (seen["disagg"].decode.max_local_prefill_tokens, seen["disagg"].decode.whole_max_num_seqs) == (192, 8)
    assert (seen["decode_engine"].scheduler.max_num_seqs, seen["decode_engine"].scheduler.max_prefill_tokens_per_step,
            seen["engine"].scheduler.max_num_seqs, seen["engine"].scheduler.max_prefill_tokens_per_step) == (4, 24, 64, 0)
    assert o.planning == PlannerConfig(planner=PlannerMode.AUTO)
    assert o.sized == (
        "prefill dp 1 + decode dp 1 (a worker per CPU of each role)",
        "--max-waiting-requests 4 (4 a worker; past them 429 at once, not a queue that misses every SLO)",
        "--max-local-prefill-tokens 192 (the decode prefills a short rest itself while the prefill is busy)",
        "--decode-max-prefill-tokens-per-step 24 (that prefill in chunks, beside every decoding request's token)",
        "--decode-max-num-seqs 4 (the rest wait for a slot; these keep their pace within the ITL objective)",
        "--whole-max-num-seqs 8 (while no prefill serves, every server prefills its own requests as a unified one)",
        "--itl-objective-ms 50 (the decode's pace: as many requests run at once as its own steps, measured as it "
        "runs, keep within 5/6 of the ITL objective, so their mean stays within it)",
        "--ttft-objective-ms 1500 (429 at once while the requests answered lately all waited past the TTFT objective "
        "for their first token and a queue stands)")
    assert seen["disagg"].decode.itl_objective_ms == 50.0
    assert (prefill.ttft_objective_ms, decode.ttft_objective_ms) == (1500.0, 1500.0)
    seen = captured_run(monkeypatch, ["--itl-slo-ms", "45", "--ttft-slo-ms", "900"])  # the planner's objectives
    assert seen["disagg"].decode.itl_objective_ms == 37.5
    assert [server.ttft_objective_ms for server in cluster.server_configs(seen["options"])] == [900.0, 900.0]


def test_what_is_given_is_kept_and_only_the_rest_is_sized(monkeypatch):
    for module in (cluster, cli):
        monkeypatch.setattr(module, "usable_cpus", lambda: frozenset(range(7)))
    o = captured_run(monkeypatch, ["--max-waiting-requests", "0", "--decode-max-num-seqs", "16",
                                   "--planner", "advisory", "--ttft-objective-ms", "0"])["options"]
    prefill, decode = cluster.server_configs(o)
    assert (prefill.dp_size, prefill.cpus, decode.dp_size, decode.cpus) == (4, "0-3", 3, "4-6")
    assert (prefill.max_waiting_requests, prefill.enable_pd_role_switch, decode.enable_pd_role_switch) == (0, False, False)
    assert (prefill.ttft_objective_ms, decode.ttft_objective_ms) == (0.0, 0.0)  # off
    assert o.decode.decode_max_num_seqs == 16
    assert [note.split(" (")[0] for note in o.sized] == [
        "prefill dp 4 + decode dp 3", "--max-local-prefill-tokens 192", "--decode-max-prefill-tokens-per-step 24",
        "--whole-max-num-seqs 8", "--itl-objective-ms 50"]
    assert captured_run(monkeypatch, ["--itl-objective-ms", "0"])["disagg"].decode.itl_objective_ms == 0.0  # off
    o = captured_run(monkeypatch, ["--dp-size", "2"])["options"]
    prefill, decode = cluster.server_configs(o)
    assert (prefill.dp_size, decode.dp_size, prefill.max_waiting_requests) == (2, 2, 8)
    o = captured_run(monkeypatch, ["--dp-size", "2", "--decode-dp-size", "1"])["options"]
    assert [cfg.dp_size for cfg in cluster.server_configs(o)] == [2, 1]


def test_a_role_gets_at_most_eight_workers_each_on_its_share_of_the_cpus():
    from disagg.sizing import role_dp_size, size_to_machine

    assert [role_dp_size(cpus) for cpus in (None, frozenset({3}), frozenset(range(8)), frozenset(range(32)))] == [
        1, 1, 8, 8]
    sized = size_to_machine(frozenset(range(32)), frozenset(range(32, 64)), itl_slo_ms=60.0, ttft_slo_ms=1500.0)
    assert (sized.dp_size, sized.decode_dp_size, sized.max_waiting_requests) == (8, 8, 32)
    sized = size_to_machine(None, None, itl_slo_ms=60.0, ttft_slo_ms=1500.0, dp_size=3, max_waiting_requests=5,
                            max_local_prefill_tokens=0, decode_max_prefill_tokens_per_step=0, decode_max_num_seqs=64,
                            whole_max_num_seqs=0, itl_objective_ms=0, ttft_objective_ms=0)
    assert (sized.dp_size, sized.decode_dp_size, sized.max_waiting_requests, sized.ttft_objective_ms,
            sized.notes) == (3, 3, 5, 0, ())
    sized = size_to_machine(None, None, itl_slo_ms=45.0, ttft_slo_ms=800.0)
    assert (sized.decode_max_num_seqs, sized.itl_objective_ms, sized.ttft_objective_ms) == (4, 37.5, 800.0)
    assert next(note for note in sized.notes if note.startswith("--decode-max-num-seqs")) == (
        "--decode-max-num-seqs 4 (the rest wait for a slot; these keep their pace within the ITL objective)")
