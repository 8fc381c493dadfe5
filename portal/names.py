"""Names that must mean one thing everywhere (no imports of the portal's own: the sign-in hooks,
the services and every app's Redis use share them): how a typed username is compared where
look-alikes must count as one, and the one shape of a Redis key or channel."""

from __future__ import annotations

import hashlib
import re
import unicodedata

from django.conf import settings


def instance_keys(instance: str, *parts: object) -> str:
    """`portal:<instance>:<part>:<part>…`, the one shape of the portal's Redis names (`*` for a
    part: a SCAN pattern). Also Celery's queues' prefix, kombu's global_keyprefix
    (portal/settings.py, which names the instance before the settings exist)."""
    return ":".join(["portal", instance, *map(str, parts)])


def redis_key(*parts: object) -> str:
    """`portal:<PORTAL_INSTANCE_ID>:<part>:<part>…`: every Redis key and channel the portal names
    itself (telemetry, wake-ups, queue holds, change feeds, live logs), and Celery's queues too
    (`portal:<PORTAL_INSTANCE_ID>:celery:<queue>`).

    Two portals may share one Redis (a test instance beside production, two labs on one server):
    without the instance in the name, one takes the other's telemetry, wake-ups and queue holds,
    whose server names, card uuids and job ids collide."""
    return instance_keys(settings.PORTAL_INSTANCE_ID, *parts)


# PORTAL_INSTANCE_ID's characters in a Slurm name (gpus.slurm_booking.reservation_name): `portal-`
# 7, these 32, `-<digest>-` 10, a booking id of up to 15 digits: Reservation.slurm_reservation's 64.
SLURM_NAME_INSTANCE = 32


def instance_label(readable: int | None = None) -> str:
    """This portal in names other programs keep (its containers, its Slurm jobs and
    reservations): PORTAL_INSTANCE_ID in a name's characters, and a short digest of it as given,
    so that two instances the characters alone would merge ("a b", "a-b") never share a name
    (`podman run --replace` would remove the other's container, `scontrol delete` its reservation).
    `readable`: at most that many of its characters before the digest (a name kept in a column of
    a bounded length: the digest of the whole still keeps two instances apart)."""
    instance = settings.PORTAL_INSTANCE_ID
    digest = hashlib.sha256(instance.encode()).hexdigest()[:8]
    return f"{re.sub(r'[^A-Za-z0-9_.-]', '-', instance)[:readable]}-{digest}"


def signin_name(username: str) -> str:
    """A username as failures are counted against it and unlocked: NFKC-normalised, case-folded,
    without accents and stripped. LDAP and Active Directory match names without case, width or
    compatibility forms (OpenLDAP finds uid=alice for "ＡＬＩＣＥ", "ªlice" and "alİce"), so none
    of those may be a fresh account to guess at. Coarser than a directory's match on purpose
    (accents go too): names that count together only share one lock."""
    folded = unicodedata.normalize("NFKD", unicodedata.normalize("NFKC", username).casefold())
    return unicodedata.normalize("NFC", "".join(c for c in folded if not unicodedata.combining(c))).strip()
