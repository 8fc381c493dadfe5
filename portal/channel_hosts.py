"""Where a channel may send: never into the lab's own network unless an admin says so, and only
to the address that was checked.

A channel URL is written by any member, and the portal's host makes the request: a `json://`
webhook (or a self-hosted Mattermost, ntfy, Matrix, Rocket.Chat or Teams workflow URL) aimed at
127.0.0.1, at a private address or at a cloud's metadata service would let them reach, and with
"Send a test" read about, what only the portal's host can reach. So, for the services whose URL
names the host they are sent to, every address the host resolves to must be a public one
(`address_is_public`), unless the host (or its network) is in CHANNEL_ALLOWED_HOSTS (an in-house
Mattermost). Checked when a channel is added and again at each send; redirects are not followed
(a public host could send the request inward), and a generic webhook is POSTed, nothing else.

**Sent to the address that was checked.** A name that answers a public address to the check and
127.0.0.1 to the lookup that connects (DNS rebinding) would otherwise reach the portal's loopback.
So a send looks the host up once (`destination_check`), and its connections go to those
addresses only (`Pin`):

- `sending_to(pin)` sets the pin in a context variable for the duration of the send, and
  `_connect`, installed once in place of `urllib3.util.connection.create_connection` (the name
  urllib3's `HTTPConnection._new_conn` calls for every connection that apprise's `requests`
  opens, http and https alike), consults it: unpinned, it is urllib3's own function; pinned, the
  channel's host is connected to at the checked addresses (the socket addresses that lookup
  returned: nothing is resolved again), and any other host name is refused, not resolved: a proxy
  from HTTP(S)_PROXY (which would look the name up again, on its side), or a Matrix server's
  discovery pointing elsewhere.
- Only the socket changes: urllib3 still holds the host's name, so TLS sends it as SNI and
  verifies the certificate against it, and the Host header carries it.
- Why a context variable: it is per thread (and per asyncio task), a new thread starts without
  it, and the `with` block resets it, so no other thread's or later request's lookups are
  touched. apprise runs each service call in its own thread pool through
  `contextvars.copy_context().run` (`apprise.apprise.submit_with_context`), so the pin goes with
  the send into that pool thread, for that call only; an apprise that stopped copying the context
  would send unpinned, which tests/test_channel_rebinding.py would show. It relies too on apprise's
  plugins opening a connection per request (module-level `requests.post`: a fresh pool each time),
  so no connection made unpinned is reused by a pinned send.
- Why not the alternatives: writing the address into the URL breaks TLS verification and the Host
  header, and apprise builds its URLs itself; apprise's own `HTTPPolicySession` needs a session
  handed to the plugin, and its plugins call `requests.post` directly; patching `socket.getaddrinfo`
  would reach every library in the process (the database's, Redis'), where this reaches only
  urllib3's connections, and only while a channel sends.
- Not pinned: services that send to their vendor's fixed host (Slack, Discord, ntfy.sh and
  t2bot.io in their token modes). The host name is apprise's constant, answered by the vendor's
  DNS, which a member cannot make point inward; their URL's "host" is a token. A name the admin
  listed in CHANNEL_ALLOWED_HOSTS is resolved as usual (the admin vouches for its DNS), but a send
  to it still reaches no other host.
"""

from __future__ import annotations

import contextvars
import inspect
import ipaddress
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import urllib3.util.connection
from django.conf import settings

if TYPE_CHECKING:  # imported where a channel is checked or sent to (portal.channels): 70 ms a process
    import apprise

# The services that send to the host their URL names. The others (Slack, Discord) send to their
# vendor's fixed hosts, and their URL's "host" is a token. A Teams workflow URL (`workflow://`,
# what apprise makes of Teams' https://….logic.azure.com/… address) names its host too.
SELF_HOSTED = {
    *("mmost", "mmosts", "matrix", "matrixs", "ntfy", "ntfys", "rocket", "rockets"),
    *("json", "jsons", "form", "forms", "xml", "xmls", "workflow", "workflows"),
}
GENERIC = {"json", "jsons", "form", "forms", "xml", "xmls"}

# --- public addresses ----------------------------------------------------------------------------

# IPv6 forms that carry an IPv4 address, which Python's is_global does not look into (and judges
# differently from one release to the next): (network, what a message calls it, whether the IPv4
# address inside decides). IPv4-mapped, NAT64's well-known prefix (DNS64 gives public IPv4-only
# hosts such addresses) and 6to4 are judged by the address inside. Refused whatever they carry:
# the deprecated IPv4-compatible form, local-use NAT64 (where the IPv4 address sits depends on the
# site's prefix length) and Teredo (its client address is obfuscated; it tunnels through UDP).
_TEREDO = ipaddress.IPv6Network("2001::/32")
_SIXTOFOUR = ipaddress.IPv6Network("2002::/16")
_LOCAL_NAT64 = ipaddress.IPv6Network("64:ff9b:1::/48")
_CARRIERS = (
    (ipaddress.IPv6Network("::ffff:0:0/96"), "an IPv4-mapped address", True),
    (ipaddress.IPv6Network("64:ff9b::/96"), "a NAT64 address", True),
    (_SIXTOFOUR, "a 6to4 address", True),
    (ipaddress.IPv6Network("::/96"), "an IPv4-compatible IPv6 address", False),
    (_LOCAL_NAT64, "a local-use NAT64 address", False),
    (_TEREDO, "a Teredo address", False),
)


def _ip(address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    return ipaddress.ip_address(address.split("%")[0])  # without an IPv6 zone (fe80::1%eth0)


def _carried(ip: ipaddress.IPv6Address) -> tuple[str, ipaddress.IPv4Address | None, bool] | None:
    """The form of an IPv6 address that carries an IPv4 one, that address (None where it cannot
    be read), and whether it decides; None for any other IPv6 address."""
    if int(ip) <= 1:
        return None  # :: and ::1, not IPv4-compatible addresses
    for network, form, judged in _CARRIERS:
        if ip in network:
            if network == _SIXTOFOUR:
                inside = ip.sixtofour
            elif network == _TEREDO:
                inside = ip.teredo[1] if ip.teredo else None
            elif network == _LOCAL_NAT64:
                inside = None
            else:
                inside = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
            return form, inside, judged
    return None


def address_is_public(address: str) -> bool:
    """Whether a channel may connect to `address` without the admin's leave: a global unicast
    address; an IPv6 form that carries an IPv4 address, by that address (or never, for the forms
    refused whatever they carry). The one rule for the check and the pin."""
    ip = _ip(address)
    if isinstance(ip, ipaddress.IPv6Address) and (carried := _carried(ip)) is not None:
        _, inside, judged = carried
        return judged and inside is not None and address_is_public(str(inside))
    return ip.is_global and not ip.is_multicast


def _described(address: str) -> str:
    """The address as a message names it: `::7f00:1, an IPv4-compatible IPv6 address of 127.0.0.1`."""
    ip = _ip(address)
    if not isinstance(ip, ipaddress.IPv6Address) or (carried := _carried(ip)) is None:
        return address
    form, inside, _ = carried
    return f"{ip}, {form}" + (f" of {inside}" if inside is not None else "")


# --- the check ---------------------------------------------------------------------------------


@dataclass
class Pin:
    """Where one send may connect: its `host`, at `addresses` (family and socket address of each
    answer of the one lookup, in the resolver's order), or, when `addresses` is None (a name in
    CHANNEL_ALLOWED_HOSTS), by urllib3's own lookup. `notes`: what the connections met, for the
    delivery's reason (apprise logs a connection's error only at debug level)."""

    host: str
    addresses: tuple[tuple[int, tuple[Any, ...]], ...] | None
    notes: list[str] = field(default_factory=list)

    @property
    def key(self) -> str:
        return _host_key(self.host)


@dataclass(frozen=True)
class Destination:
    """What `destination_check` found: `problem` in words for the `url` field ("" when the portal
    may send), and the `pin` the send must use (None: a vendor's fixed host, connected to as
    usual). `lasting`: whether the problem will still be there at a retry (a failed lookup may not)."""

    problem: str = ""
    pin: Pin | None = None
    lasting: bool = True


def destination_check(plugin: apprise.NotifyBase, scheme: str) -> Destination:
    """Whether the portal may send through `plugin`, and where to. Resolves the host once (a DNS
    lookup); send only inside `sending_to(destination.pin)`."""
    if scheme in GENERIC and getattr(plugin, "method", "POST") != "POST":
        return Destination(f"A webhook is sent with POST; remove method={plugin.method} from the URL.")
    if scheme not in SELF_HOSTED:
        return Destination()
    host = (getattr(plugin, "host", "") or "").strip("[]").lower()
    if not host:  # a token mode (ntfy.sh's topics, t2bot.io's Matrix tokens): the vendor's host
        return Destination()
    if host in _allowed_names():
        return Destination(pin=Pin(host, None))
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return Destination(f"The host {host} cannot be found; check its name.", lasting=False)
    answers = tuple(dict.fromkeys((family, sockaddr) for family, _, _, _, sockaddr in infos))
    addresses = [sockaddr[0] for _, sockaddr in answers]
    inside = [a for a in addresses if not address_is_public(a)]
    if inside and not _allowed_networks(addresses):
        return Destination(
            f"{host} is an address inside the portal's own network ({_described(inside[0])}): channels "
            "may only send to public services, unless the portal's admin lists the host in "
            "CHANNEL_ALLOWED_HOSTS."
        )
    return Destination(pin=Pin(host, answers))


def _allowed_names() -> set[str]:
    return {entry.lower() for entry in settings.CHANNEL_ALLOWED_HOSTS if _network(entry) is None}


def _allowed_networks(addresses: list[str]) -> bool:
    """Every one of the addresses in CHANNEL_ALLOWED_HOSTS' addresses or networks (10.0.5.0/24)."""
    networks = [net for net in map(_network, settings.CHANNEL_ALLOWED_HOSTS) if net is not None]
    return bool(addresses) and all(any(_ip(a) in net for net in networks) for a in addresses)


def _network(entry: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network | None:
    try:
        return ipaddress.ip_network(entry, strict=False)
    except ValueError:
        return None


def without_redirects(plugin: apprise.NotifyBase) -> apprise.NotifyBase:
    """The plugin set not to follow a 3xx (whatever the URL's redirect= says)."""
    plugin.redirects = False
    return plugin


# --- the pin -------------------------------------------------------------------------------------

_pin: contextvars.ContextVar[Pin | None] = contextvars.ContextVar("portal_channel_pin", default=None)


@contextmanager
def sending_to(pin: Pin | None) -> Iterator[None]:
    """Within the block, this thread's (and the apprise calls it starts') connections go where
    `pin` says, and nowhere else; None: as usual."""
    if pin is not None and urllib3.util.connection.create_connection is not _connect:
        raise RuntimeError(
            "urllib3.util.connection.create_connection was replaced after portal.channel_hosts "
            "installed its pin: a channel cannot be sent to the address that was checked."
        )
    token = _pin.set(pin)
    try:
        yield
    finally:
        _pin.reset(token)


def _host_key(host: str) -> str:
    """A host as urllib3 and apprise may each spell it: IPv6 without brackets and compressed, a
    name in lower case and IDNA, without the trailing dot."""
    host = host.strip("[]").rstrip(".").lower()
    try:
        return str(_ip(host))
    except ValueError:
        pass
    try:
        return host.encode("idna").decode("ascii")
    except UnicodeError:
        return host


def _connect(address: tuple[str, int], *args: Any, **kwargs: Any) -> socket.socket:
    """urllib3's create_connection, unless a channel is sending in this context: then only its
    host, at the addresses its check found."""
    pin = _pin.get()
    if pin is None:
        return _urllib3_connect(address, *args, **kwargs)
    host, port = address
    if _host_key(host) != pin.key:
        note = (
            f"Refused to connect to {host.strip('[]')}: this channel connects to {pin.host} only, "
            f"never through a proxy (with HTTP(S)_PROXY set, add {pin.host} to NO_PROXY), nor to "
            "another host it points to."
        )
        pin.notes.append(note)
        raise OSError(note)
    if pin.addresses is None:
        return _urllib3_connect(address, *args, **kwargs)
    call = _URLLIB3_SIGNATURE.bind(address, *args, **kwargs)
    call.apply_defaults()
    given = call.arguments
    return _connect_pinned(pin, port, given["timeout"], given["source_address"], given["socket_options"])


def _connect_pinned(
    pin: Pin, port: int, timeout: object, source_address: tuple[str, int] | None, socket_options: Any
) -> socket.socket:
    """The first of the pin's addresses that answers, as urllib3 would connect to a lookup's."""
    failed: list[str] = []
    error: OSError = OSError(f"{pin.host} has no address to connect to")
    for family, sockaddr in pin.addresses or ():
        sock = None
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
            for option in socket_options or ():
                sock.setsockopt(*option)
            if timeout is None or isinstance(timeout, (int, float)):
                sock.settimeout(timeout)  # else urllib3's "default" marker: the socket's default
            if source_address:
                sock.bind(source_address)
            sock.connect((sockaddr[0], port, *sockaddr[2:]))
            return sock
        except OSError as exc:
            if sock is not None:
                sock.close()
            failed.append(f"{sockaddr[0]} ({exc})")
            error = exc
    pin.notes.append(
        f"{pin.host} was looked up once, and sent to only as it answered then: "
        f"{', '.join(failed) or 'no address'}."
    )
    raise error


# Installed once, at import (portal.channels imports this module before any send). A reloaded
# module wraps urllib3's own function again, never its own wrapper.
_urllib3_connect = getattr(
    urllib3.util.connection.create_connection, "portal_wraps", urllib3.util.connection.create_connection
)
_URLLIB3_SIGNATURE = inspect.signature(_urllib3_connect)
_connect.portal_wraps = _urllib3_connect  # type: ignore[attr-defined]
urllib3.util.connection.create_connection = _connect
