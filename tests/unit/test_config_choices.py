"""Config fields with a closed set of values: Enum members that read, print and encode as their value."""

from __future__ import annotations

import json

import msgspec
import pytest

from disagg.cli import build_parser
from disagg.cli_args import dataclass_from_args
from disagg.config import ConfigError, DisaggregationMode, LoadBalanceMethod, ServerConfig
from disagg.pd_config import DisaggConfig, TransferBackend
from disagg.engine_config import CacheConfig, KVCacheDType


def test_strings_become_members_and_members_read_as_their_values():
    config = ServerConfig(load_balance_method="round_robin", disaggregation_mode="decode")
    assert config.load_balance_method is LoadBalanceMethod.ROUND_ROBIN
    assert config.disaggregation_mode is DisaggregationMode.DECODE
    assert config.load_balance_method == "round_robin" and f"{config.disaggregation_mode}" == "decode"
    assert str(LoadBalanceMethod.FOLLOW_BOOTSTRAP_ROOM) == "follow_bootstrap_room"
    body = {"load_balance_method": config.load_balance_method, "disaggregation_mode": config.disaggregation_mode}
    assert json.dumps(body) == '{"load_balance_method": "round_robin", "disaggregation_mode": "decode"}'
    assert msgspec.json.encode(body) == b'{"load_balance_method":"round_robin","disaggregation_mode":"decode"}'
    assert ServerConfig().load_balance_method is LoadBalanceMethod.LEAST_LOAD
    assert ServerConfig().disaggregation_mode is DisaggregationMode.NULL


def test_an_unknown_value_names_the_field_and_the_values_it_takes():
    with pytest.raises(ConfigError) as info:
        ServerConfig(load_balance_method="fastest")
    assert str(info.value) == "load_balance_method must be one of round_robin, least_load, follow_bootstrap_room, cache_aware, got 'fastest'"
    with pytest.raises(ConfigError) as info:
        ServerConfig(disaggregation_mode="both")
    assert str(info.value) == "disaggregation_mode must be one of null, prefill, decode, got 'both'"
    with pytest.raises(ConfigError) as info:  # the in-process twin is no server's backend
        DisaggConfig(transfer_backend="loopback")
    assert str(info.value) == "transfer_backend must be one of nixl, tcp, got 'loopback'"


def test_the_transfer_backend_and_the_kv_cache_dtype_are_members_too():
    assert DisaggConfig(transfer_backend="tcp").transfer_backend is TransferBackend.TCP
    assert DisaggConfig().transfer_backend is TransferBackend.NIXL
    assert CacheConfig(kv_cache_dtype="bfloat16").kv_cache_dtype is KVCacheDType.BFLOAT16
    parser = build_parser()
    args = parser.parse_args(["prefill", "--transfer-backend", "tcp", "--kv-cache-dtype", "bfloat16"])
    assert dataclass_from_args(DisaggConfig, args).transfer_backend is TransferBackend.TCP
    assert dataclass_from_args(CacheConfig, args).kv_cache_dtype is KVCacheDType.BFLOAT16


def test_the_cli_takes_values_and_each_role_has_its_default_method():
    parser = build_parser()
    for argv, method in ((["unified"], LoadBalanceMethod.LEAST_LOAD), (["prefill"], LoadBalanceMethod.FOLLOW_BOOTSTRAP_ROOM),
                         (["decode"], LoadBalanceMethod.LEAST_LOAD),
                         (["unified", "--load-balance-method", "round_robin"], LoadBalanceMethod.ROUND_ROBIN)):
        config = dataclass_from_args(ServerConfig, parser.parse_args(argv))
        assert config.load_balance_method is method, argv
    with pytest.raises(ConfigError, match="load_balance_method must be one of .*, got 'x'"):
        dataclass_from_args(ServerConfig, parser.parse_args(["unified", "--load-balance-method", "x"]))
