"""`--allowed-bootstrap-hosts` patterns: parsing and matching, exact values, no I/O."""

import ipaddress

import pytest

from disagg import host_patterns
from disagg.config import ConfigError
from disagg.pd_config import DecodeConfig
from disagg.host_patterns import InvalidPattern, allows, parse_pattern, parse_patterns

pytestmark = pytest.mark.timeout(10)
FORMS = "(use host, host:port, an IP network such as 10.0.0.0/8, or [IPv6]:port)"


@pytest.mark.parametrize("entry, port, network", [
    ("10.0.0.0/8", None, "10.0.0.0/8"),
    ("10.0.0.5", None, "10.0.0.5/32"),
    ("10.0.0.5:8998", 8998, "10.0.0.5/32"),
    ("10.0.0.0/8:8998", 8998, "10.0.0.0/8"),
    ("::1", None, "::1/128"),
    ("[::1]:8998", 8998, "::1/128"),
    ("[::1]", None, "::1/128"),
    ("fd00::/8", None, "fd00::/8"),
    ("[fd00::/8]:1", 1, "fd00::/8"),
    ("10.0.0.5:65535", 65535, "10.0.0.5/32"),
])
def test_addresses_and_networks_parse_to_a_network_and_a_port(entry, port, network):
    pattern = parse_pattern(entry)
    assert (pattern.entry, pattern.port, pattern.network, pattern.name) == (
        entry, port, ipaddress.ip_network(network), None)


@pytest.mark.parametrize("entry, port, regex", [
    ("prefill-0.svc", None, r"prefill\-0\.svc"),
    ("prefill-*.svc:8998", 8998, r"prefill\-[^.]*\.svc"),
    ("Prefill-0.SVC", None, r"prefill\-0\.svc"),
    ("localhost", None, "localhost"),
    ("*", None, "[^.]*"),
    ("a_b.c", None, r"a_b\.c"),
])
def test_names_parse_to_a_lowercase_pattern_and_a_port(entry, port, regex):
    pattern = parse_pattern(entry)
    assert (pattern.entry, pattern.port, pattern.network, pattern.name.pattern) == (entry, port, None, regex)


@pytest.mark.parametrize("entry, why", [
    ("", "it is empty or has spaces around it"),
    (" 10.0.0.5", "it is empty or has spaces around it"),
    ("10.0.0.5 ", "it is empty or has spaces around it"),
    ("10.0.0.5:0", "port '0' is not an integer in [1, 65535]"),
    ("10.0.0.5:65536", "port '65536' is not an integer in [1, 65535]"),
    ("10.0.0.5:", "port '' is not an integer in [1, 65535]"),
    ("host:http", "port 'http' is not an integer in [1, 65535]"),
    ("host:-1", "port '-1' is not an integer in [1, 65535]"),
    ("[::1]:x", "port 'x' is not an integer in [1, 65535]"),
    ("10.0.0.5/8", "'10.0.0.5/8' is not an IP network (address/prefix length, no host bits set)"),
    ("10.0.0.0/33", "'10.0.0.0/33' is not an IP network (address/prefix length, no host bits set)"),
    ("prefill/8", "'prefill/8' is not an IP network (address/prefix length, no host bits set)"),
    ("[::1", "'[' without ']'"),
    ("[::1]8998", "'8998' after ']' is not :PORT"),
    ("[prefill-0]:8998", "'prefill-0' in brackets is not an IPv6 address or network"),
    ("a:b:c", "'a:b:c' is not a host name, an IP address or a network"),
    (":8998", "'' is not a host name, an IP address or a network"),
    ("pre fill", "'pre fill' is not a host name, an IP address or a network"),
    ("a..b", "'a..b' is not a host name, an IP address or a network"),
    ("prefill.svc.", "'prefill.svc.' is not a host name, an IP address or a network"),
    ("http://10.0.0.5", "port '//10.0.0.5' is not an integer in [1, 65535]"),
    ("*.svc/8", "'*.svc/8' is not an IP network (address/prefix length, no host bits set)"),
])
def test_an_invalid_entry_is_named_with_what_is_wrong(entry, why):
    with pytest.raises(InvalidPattern) as info:
        parse_pattern(entry)
    assert str(info.value) == f"allowed_bootstrap_hosts entry {entry!r} is not valid: {why} {FORMS}"


def test_the_config_refuses_the_first_bad_entry_as_a_config_error():
    with pytest.raises(ConfigError) as info:
        DecodeConfig(allowed_bootstrap_hosts=("10.0.0.5", "10.0.0.6:99999", "x:y"))
    assert str(info.value) == (
        f"allowed_bootstrap_hosts entry '10.0.0.6:99999' is not valid: port '99999' is not an integer in [1, 65535] {FORMS}")


CASES = [  # (host, port) a request names -> allowed under the patterns below, in order
    ("10.1.2.3", 1), ("10.0.0.5", 8998), ("10.0.0.5", 8999), ("10.0.0.6", 8998), ("11.0.0.1", 8998),
    ("prefill-0.svc", 8998), ("PREFILL-7.SVC", 8998), ("prefill-0.svc", 8999), ("prefill-0.evil.svc", 8998),
    ("prefill-.svc", 8998), ("decode-0.svc", 8998), ("::1", 8998), ("0:0::1", 8998), ("[::1]", 8998), ("::1", 8999),
    ("::2", 8998), ("fd00::5", 7), ("localhost", 8998), ("127.0.0.1", 8998),
]


@pytest.mark.parametrize("entries, expected", [
    (("10.0.0.0/8",), [True, True, True, True, False] + [False] * 14),
    (("10.0.0.5",), [False, True, True, False, False] + [False] * 14),
    (("10.0.0.5:8998",), [False, True, False, False, False] + [False] * 14),
    (("10.0.0.0/8:8998",), [False, True, False, True, False] + [False] * 14),
    (("prefill-*.svc:8998",), [False] * 5 + [True, True, False, False, True, False] + [False] * 8),
    (("prefill-0.svc",), [False] * 5 + [True, False, True, False, False, False] + [False] * 8),
    (("[::1]:8998",), [False] * 11 + [True, True, True, False, False, False, False, False]),
    (("fd00::/8",), [False] * 16 + [True, False, False]),
    (("localhost",), [False] * 17 + [True, False]),  # a name never matches the address it resolves to
    (("127.0.0.1",), [False] * 18 + [True]),
    ((), [True] * 19),  # no list: anything, as SGLang
])
def test_matching_every_form(entries, expected):
    patterns = parse_patterns(entries)
    assert [allows(patterns, host, port) for host, port in CASES] == expected
    config = DecodeConfig(allowed_bootstrap_hosts=entries)
    assert [config.allows_bootstrap_address(host, port) for host, port in CASES] == expected


def test_several_entries_allow_their_union_and_an_address_never_matches_a_name_pattern():
    patterns = parse_patterns(("10.0.0.5:8998", "prefill-*.svc", "[::1]:1"))
    assert [allows(patterns, h, p) for h, p in [("10.0.0.5", 8998), ("prefill-x.svc", 5), ("::1", 1),
                                                ("10.0.0.5", 1), ("::1", 8998), ("10.0.0.7", 8998)]] == [
        True, True, True, False, False, False]
    assert parse_pattern("10.0.0.*").matches("10.0.0.7", 1) is True  # a name pattern compares text, digits too
    assert parse_pattern("10.0.0.5:8998").matches("10.0.0.5", None) is False  # a port-bound entry needs the port
    assert parse_pattern("::ffff:10.0.0.5").matches("10.0.0.5", 1) is False  # versions never mix


def test_parsing_is_cached_per_list():
    host_patterns.parse_patterns.cache_clear()
    parse_patterns(("10.0.0.5",))
    parse_patterns(("10.0.0.5",))
    assert (host_patterns.parse_patterns.cache_info().hits, host_patterns.parse_patterns.cache_info().misses) == (1, 1)
