"""The patterns of `--allowed-bootstrap-hosts`: which host:port a decode may reach (docs/security.md).

An entry is a host part and an optional port:
- `10.0.0.0/8`, `fd00::/8`: a network (CIDR), matching the IP addresses in it;
- `10.0.0.5`, `::1`: one IP address, compared as an address (`::1` and `0::1` are the same);
- `prefill-0.svc`, `prefill-*.svc`: a host name, case-insensitive; `*` matches any run of characters
  within one dot-separated label, never a dot;
- any of these followed by `:PORT` (an IPv6 address or network in brackets: `[::1]:8998`): that port
  only. Without a port, every port of the host.

Nothing is resolved: a name never matches an address, nor an address a name, so list what requests
carry (the host part of the router's `--prefill` URLs, the prefills' `--rank-host`). Pure: no I/O.
"""

from __future__ import annotations

import functools
import ipaddress
import re
from dataclasses import dataclass

FIELD = "allowed_bootstrap_hosts"
FORMS = "use host, host:port, an IP network such as 10.0.0.0/8, or [IPv6]:port"
_NAME = re.compile(r"[a-z0-9_*-]+(\.[a-z0-9_*-]+)*")  # labels of letters, digits, '-', '_' and '*'

class InvalidPattern(ValueError):
    """An entry that is not a pattern; the message names it (config.py turns it into a ConfigError)."""


Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class HostPattern:
    """One entry: an IP network (an address is a /32 or /128) or a host-name pattern, and a port or None."""

    entry: str
    port: int | None
    network: Network | None = None
    name: re.Pattern | None = None

    def matches(self, host: str, port: int | None) -> bool:
        """True when a request naming `host`:`port` may be served under this entry."""
        if self.port is not None and port != self.port:
            return False
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        if self.network is not None:
            address = _address(host)
            return address is not None and address.version == self.network.version and address in self.network
        return self.name is not None and self.name.fullmatch(host.lower()) is not None


def allows(patterns: tuple[HostPattern, ...], host: str, port: int | None) -> bool:
    """True when `host`:`port` matches one of `patterns`; an empty tuple allows everything."""
    return not patterns or any(pattern.matches(host, port) for pattern in patterns)


@functools.lru_cache(maxsize=16)
def parse_patterns(entries: tuple[str, ...]) -> tuple[HostPattern, ...]:
    """Every entry parsed; InvalidPattern naming the first bad one."""
    return tuple(parse_pattern(entry) for entry in entries)


def parse_pattern(entry: str) -> HostPattern:
    """One entry (see the module docstring); InvalidPattern naming it and what is wrong."""
    if not entry or entry != entry.strip():
        raise _invalid(entry, "it is empty or has spaces around it")
    host, port_text, bracketed = _split_port(entry)
    port = None if port_text is None else _port(entry, port_text)
    network = _network(entry, host)
    if network is not None:
        return HostPattern(entry, port, network=network)
    if bracketed:
        raise _invalid(entry, f"{host!r} in brackets is not an IPv6 address or network")
    if ":" in host or not _NAME.fullmatch(host.lower()):
        raise _invalid(entry, f"{host!r} is not a host name, an IP address or a network")
    label = "[^.]*"
    name = re.compile("".join(label if char == "*" else re.escape(char) for char in host.lower()))
    return HostPattern(entry, port, name=name)


def _split_port(entry: str) -> tuple[str, str | None, bool]:
    """(host, port text or None, whether the host was in brackets)."""
    if entry.startswith("["):
        host, sep, rest = entry[1:].partition("]")
        if not sep:
            raise _invalid(entry, "'[' without ']'")
        if rest and not rest.startswith(":"):
            raise _invalid(entry, f"{rest!r} after ']' is not :PORT")
        return host, rest[1:] if rest else None, True
    if entry.count(":") == 1:  # an IPv6 address or network without brackets has two or more
        host, _, port = entry.partition(":")
        return host, port, False
    return entry, None, False


def _port(entry: str, text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise _invalid(entry, f"port {text!r} is not an integer in [1, 65535]")
    return int(text)


def _network(entry: str, host: str) -> Network | None:
    """The host part as a network (a lone address: /32 or /128); None when it is a name."""
    if "/" not in host:
        address = _address(host)
        return None if address is None else ipaddress.ip_network(address)
    try:
        return ipaddress.ip_network(host)
    except ValueError:
        raise _invalid(entry, f"{host!r} is not an IP network (address/prefix length, no host bits set)") from None


def _address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def _invalid(entry: str, why: str) -> InvalidPattern:
    return InvalidPattern(f"{FIELD} entry {entry!r} is not valid: {why} ({FORMS})")
