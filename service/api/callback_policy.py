"""Which callback URLs the service may call (``HOIST_CALLBACK_HOSTS``), checked when a
load is submitted and again, on the resolved addresses, before every delivery.

A URL must be ``http`` or ``https``, carry no user name or password, be at most
:data:`MAX_CALLBACK_URL` characters, and name a host the allow-list admits: a host name
listed (exactly, or under a ``*.domain`` entry), or an address inside a listed network
(CIDR; a single address is a ``/32`` or ``/128``). When delivering, the host is resolved
and every address it resolves to must be admitted: inside a listed network, or — for a
host admitted by name — a global (public) address. A name that later resolves into
loopback, private, link-local or other special networks not listed is refused, so that
changing DNS cannot turn a callback against the service's own network. The sender then
connects to the address it checked (not to the name again).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from dataclasses import dataclass
from urllib.parse import SplitResult, urlsplit

from service.errors import CallbackRefusedError, clip

MAX_CALLBACK_URL = 2048
"""Longest callback URL, in characters."""

MAX_ALLOW_ENTRIES = 256
"""Most entries in ``HOIST_CALLBACK_HOSTS``."""

RESOLVE_TIMEOUT_S = 5.0
"""Time a host name may take to resolve, in seconds."""

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True, slots=True)
class Target:
    """A checked callback URL.

    Attributes:
        url: the URL as given.
        scheme: ``http`` or ``https``.
        host: the host name or address literal (lower case, without brackets).
        port: the port (80 or 443 when not given).
        target: the request target (path and query).
    """

    url: str
    scheme: str
    host: str
    port: int
    target: str

    @property
    def origin(self) -> str:
        """``scheme://host:port``, what a job's view shows of the URL (no path or query,
        which may carry a receiver's token)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"

    @property
    def host_header(self) -> str:
        """The ``Host`` header: the name as given, with the port when not the default."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = 443 if self.scheme == "https" else 80
        return host if self.port == default else f"{host}:{self.port}"


def _address(text: str) -> Address | None:
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


class AllowList:
    """The hosts and networks of ``HOIST_CALLBACK_HOSTS`` (comma-separated host names,
    ``*.domain`` wildcards and CIDR networks); empty refuses every callback.

    Raises:
        ValueError: an entry is neither a host name nor a network, or too many entries.
    """

    def __init__(self, text: str | None) -> None:
        self.names: frozenset[str] = frozenset()
        self.suffixes: tuple[str, ...] = ()
        self.networks: tuple[Network, ...] = ()
        entries = [e.strip().lower() for e in (text or "").split(",") if e.strip()]
        if len(entries) > MAX_ALLOW_ENTRIES:
            raise ValueError(f"HOIST_CALLBACK_HOSTS has {len(entries)} entries (at most {MAX_ALLOW_ENTRIES})")
        names: set[str] = set()
        suffixes: list[str] = []
        networks: list[Network] = []
        for entry in entries:
            if "/" in entry or _address(entry) is not None:
                try:
                    networks.append(ipaddress.ip_network(entry, strict=False))
                except ValueError:
                    raise ValueError(f"HOIST_CALLBACK_HOSTS: {entry!r} is not a valid network") from None
                continue
            name = entry[2:] if entry.startswith("*.") else entry
            labels = name.rstrip(".").split(".")
            if not name or len(name) > 253 or not all(_label_ok(label) for label in labels):
                raise ValueError(f"HOIST_CALLBACK_HOSTS: {entry!r} is not a host name, *.domain or network")
            if entry.startswith("*."):
                suffixes.append("." + name.rstrip("."))
            else:
                names.add(name.rstrip("."))
        self.names = frozenset(names)
        self.suffixes = tuple(suffixes)
        self.networks = tuple(networks)

    @property
    def empty(self) -> bool:
        """True when no callback is allowed."""
        return not (self.names or self.suffixes or self.networks)

    def name_allowed(self, host: str) -> bool:
        """Whether host name ``host`` is listed (or under a listed ``*.domain``)."""
        host = host.rstrip(".")
        return host in self.names or any(host.endswith(s) for s in self.suffixes)

    def in_networks(self, address: Address) -> bool:
        """Whether ``address`` lies in a listed network."""
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        return any(address in network for network in self.networks)

    def address_allowed(self, address: Address, *, by_name: bool) -> bool:
        """Whether a delivery may connect to ``address``: inside a listed network, or a
        global address of a host listed by name."""
        if self.in_networks(address):
            return True
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        return by_name and address.is_global and not address.is_multicast

    def check_url(self, url: str) -> Target:
        """The parts of callback URL ``url`` once its form and host are admitted (no
        name resolution: a name not listed is refused).

        Raises:
            CallbackRefusedError: naming what is wrong.
        """
        if self.empty:
            raise CallbackRefusedError(
                "callbacks are not enabled on this service", hint="set HOIST_CALLBACK_HOSTS to the receivers' hosts"
            )
        if len(url) > MAX_CALLBACK_URL:
            raise CallbackRefusedError(f"callback URL has {len(url)} characters (at most {MAX_CALLBACK_URL})")
        if any(ord(c) < 0x21 or ord(c) == 0x7F for c in url):
            raise CallbackRefusedError("callback URL holds white space or control characters")
        try:
            parts: SplitResult = urlsplit(url)
            port = parts.port
        except ValueError as exc:
            raise CallbackRefusedError(f"callback URL {clip(url, 200)!r} is not valid: {exc}") from None
        scheme = parts.scheme.lower()
        if scheme not in ("http", "https"):
            raise CallbackRefusedError(f"callback URL scheme {clip(scheme, 20)!r} is not http or https")
        if "@" in parts.netloc:
            raise CallbackRefusedError("callback URL must not carry a user name or password")
        host = (parts.hostname or "").lower()
        if not host:
            raise CallbackRefusedError(f"callback URL {clip(url, 200)!r} names no host")
        address = _address(host)
        allowed = self.in_networks(address) if address is not None else self.name_allowed(host)
        if not allowed:
            raise CallbackRefusedError(
                f"callback host {clip(host, 200)!r} is not allowed", hint="HOIST_CALLBACK_HOSTS lists the hosts allowed"
            )
        target = parts.path or "/"
        if parts.query:
            target += "?" + parts.query
        if port == 0:
            raise CallbackRefusedError(f"callback URL {clip(url, 200)!r} names port 0")
        return Target(url, scheme, host, port or (443 if scheme == "https" else 80), target)

    async def resolve(self, target: Target) -> Address:
        """The address to connect to for ``target``: its host resolved now, every
        address it resolves to admitted (:meth:`address_allowed`); the first one.

        Raises:
            CallbackRefusedError: the host does not resolve, or resolves to an address
                not admitted.
        """
        literal = _address(target.host)
        if literal is not None:
            addresses = [literal]
        else:
            loop = asyncio.get_running_loop()
            try:
                async with asyncio.timeout(RESOLVE_TIMEOUT_S):
                    infos = await loop.getaddrinfo(target.host, target.port, type=socket.SOCK_STREAM)
            except (OSError, TimeoutError) as exc:
                raise CallbackRefusedError(f"callback host {target.host!r} does not resolve: {exc}") from None
            addresses = []
            for info in infos:
                found = _address(str(info[4][0]).split("%", 1)[0])
                if found is not None and found not in addresses:
                    addresses.append(found)
        if not addresses:
            raise CallbackRefusedError(f"callback host {target.host!r} resolves to no address")
        by_name = literal is None and self.name_allowed(target.host)
        for address in addresses:
            if not self.address_allowed(address, by_name=by_name):
                raise CallbackRefusedError(f"callback host {target.host!r} resolves to {address}, which is not allowed")
        return addresses[0]


def _label_ok(label: str) -> bool:
    return 0 < len(label) <= 63 and all(c.isascii() and (c.isalnum() or c in "-_") for c in label)
