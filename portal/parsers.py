"""DRF's JSON parser, with JSON nested too deep for the decoder (`[[[[…`) a 400 like any bad JSON,
and a lone surrogate (`"\\ud800"`) anywhere in the body a 400 naming its field."""

from __future__ import annotations

import re
from typing import Any

from rest_framework import exceptions, parsers

# JSON may escape half of a UTF-16 pair alone; Python decodes it, but no UTF-8 text can hold it.
_SURROGATE = re.compile("[\ud800-\udfff]")


def _surrogate_in(value: Any) -> str | None:
    """The first lone surrogate anywhere in a parsed JSON value (keys included), as U+XXXX."""
    if isinstance(value, str):
        found = _SURROGATE.search(value)
        return f"U+{ord(found[0]):04X}" if found else None
    if isinstance(value, dict):
        value = [item for pair in value.items() for item in pair]
    if isinstance(value, list):
        return next((found for item in value if (found := _surrogate_in(item))), None)
    return None


def _refuse_surrogates(data: Any) -> None:
    """Refused here, before any service reads them: an error that echoes one (DRF's "… is not a valid
    choice"), or a row that stores one in JSON, would fail only when the answer is rendered, a 500
    after the write."""
    fields = data.items() if isinstance(data, dict) else [("non_field_errors", data)]
    for field, value in fields:
        if found := (_surrogate_in(field) or _surrogate_in(value)):
            name = field.encode("utf-8", "backslashreplace").decode()  # the key may be the culprit
            raise exceptions.ValidationError(
                {name: [f"Surrogate characters are not allowed: {found}. Send the text as UTF-8."]}
            )


class JSONParser(parsers.JSONParser):
    def parse(self, stream, media_type=None, parser_context=None):  # type: ignore[no-untyped-def]
        try:
            data = super().parse(stream, media_type, parser_context)
            _refuse_surrogates(data)  # walks as deep as the decoder went: inside the same guard
        except RecursionError:
            raise exceptions.ParseError("JSON parse error - nested too deeply; send a flat object.") from None
        return data
