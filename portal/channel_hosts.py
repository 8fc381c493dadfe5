"""Where a channel may send: never into the lab's own network unless an admin says so.

A channel URL is written by any member, and the portal's host makes the request: a `json://`
webhook (or a self-hosted Mattermost, ntfy, Matrix or Rocket.Chat URL) aimed at 127.0.0.1, at a
private address or at a cloud's metadata service would let them reach, and with "Send a test"
read about, what only the portal's host can reach. So, for the services whose URL names the host
they are sent to, every address the host resolves to must be a public one, unless the host (or
its network) is in CHANNEL_ALLOWED_HOSTS (an in-house Mattermost). Checked when a channel is
added and again at each send (a name may resolve elsewhere later); redirects are not followed
(a public host could send the request inward), and a generic webhook is POSTed, nothing else.
"""

from __future__ import annotations

import ipaddress
import socket

import apprise
from django.conf import settings

# The services that send to the host their URL names. The others (Slack, Teams, Discord) send to
# their vendor's fixed hosts, and their URL's "host" is a token.
SELF_HOSTED = {
    *("mmost", "mmosts", "matrix", "matrixs", "ntfy", "ntfys", "rocket", "rockets"),
    *("json", "jsons", "form", "forms", "xml", "xmls"),
}
GENERIC = {"json", "jsons", "form", "forms", "xml", "xmls"}
# Where a self-hosted service's URL may name no resolvable host: its token stands in the host's
# place (ntfy.sh's topics, t2bot.io's Matrix tokens), and it is sent to the vendor's host.
TOKEN_HOST_OK = {"ntfy", "ntfys", "matrix", "matrixs"}


def destination_problem(plugin: apprise.NotifyBase, scheme: str) -> str:
    """Why the portal must not send through `plugin` ("" when it may), in words for the `url`
    field. Resolves the host (a DNS lookup)."""
    if scheme in GENERIC and getattr(plugin, "method", "POST") != "POST":
        return f"A webhook is sent with POST; remove method={plugin.method} from the URL."
    if scheme not in SELF_HOSTED:
        return ""
    host = (getattr(plugin, "host", "") or "").strip("[]").lower()
    if not host or _allowed(host, ()):
        return ""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        if scheme in TOKEN_HOST_OK:
            return ""
        return f"The host {host} cannot be found; check its name."
    addresses = sorted({info[4][0] for info in infos})
    inside = [a for a in addresses if not ipaddress.ip_address(a.split("%")[0]).is_global]
    if inside and not _allowed(host, addresses):
        return (
            f"{host} is an address inside the portal's own network ({inside[0]}): channels may only "
            "send to public services, unless the portal's admin lists the host in CHANNEL_ALLOWED_HOSTS."
        )
    return ""


def _allowed(host: str, addresses: tuple[str, ...] | list[str]) -> bool:
    """The host by name, or every one of its addresses, in CHANNEL_ALLOWED_HOSTS (names, addresses
    or networks such as 10.0.5.0/24)."""
    names, networks = set(), []
    for entry in settings.CHANNEL_ALLOWED_HOSTS:
        try:
            networks.append(ipaddress.ip_network(entry, strict=False))
        except ValueError:
            names.add(entry.lower())
    if host in names:
        return True
    checked = list(addresses) or _literal(host)
    return bool(checked) and all(
        any(ipaddress.ip_address(a.split("%")[0]) in net for net in networks) for a in checked
    )


def _literal(host: str) -> list[str]:
    try:
        return [str(ipaddress.ip_address(host))]
    except ValueError:
        return []


def without_redirects(plugin: apprise.NotifyBase) -> apprise.NotifyBase:
    """The plugin set not to follow a 3xx (whatever the URL's redirect= says)."""
    plugin.redirects = False
    return plugin
