"""--worker-allowlist: the hosts POST /add_worker may register. Entries are DNS names (matched as written, case
aside; a name is not resolved, so a worker registering by address needs its address listed), IP addresses, or
networks in CIDR notation (10.0.0.0/8, fd00::/8) that addresses fall in. Empty: every host (the default)."""

from __future__ import annotations

import functools
import ipaddress
import re

_NAME = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9-]{0,62})(?:\.[A-Za-z0-9-]{1,63})*$")


class WorkerAllowlist:
    def __init__(self, names: frozenset[str], networks: tuple):
        self.names = names
        self.networks = networks

    @classmethod
    def parse(cls, entries: tuple[str, ...]) -> WorkerAllowlist:
        """ValueError naming the first entry that is neither a DNS name, an address nor a network."""
        names, networks = set(), []
        for raw in entries:
            entry = raw.strip().strip("[]").rstrip(".")
            try:
                networks.append(ipaddress.ip_network(entry, strict=False))
                continue
            except ValueError:
                pass
            if not _NAME.match(entry):
                raise ValueError(f"--worker-allowlist: {raw!r} is not a host name, an IP address or a CIDR network")
            names.add(entry.lower())
        return cls(frozenset(names), tuple(networks))

    def allows(self, host: str) -> bool:
        """Whether `host` (a name, an address, or a bracketed IPv6 address) is listed."""
        host = host.strip("[]").rstrip(".")
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return host.lower() in self.names
        return any(address in network for network in self.networks)


@functools.lru_cache(maxsize=8)
def allowlist(entries: tuple[str, ...]) -> WorkerAllowlist | None:
    """The allowlist of the router's --worker-allowlist (None when empty: every host)."""
    return WorkerAllowlist.parse(entries) if entries else None
