"""How a typed username is compared where look-alikes must count as one (no imports of the
portal's own: the sign-in hooks and the services both use it)."""

from __future__ import annotations

import unicodedata


def signin_name(username: str) -> str:
    """A username as failures are counted against it and unlocked: NFKC-normalised, case-folded,
    without accents and stripped. LDAP and Active Directory match names without case, width or
    compatibility forms (OpenLDAP finds uid=alice for "ＡＬＩＣＥ", "ªlice" and "alİce"), so none
    of those may be a fresh account to guess at. Coarser than a directory's match on purpose
    (accents go too): names that count together only share one lock."""
    folded = unicodedata.normalize("NFKD", unicodedata.normalize("NFKC", username).casefold())
    return unicodedata.normalize("NFC", "".join(c for c in folded if not unicodedata.combining(c))).strip()
