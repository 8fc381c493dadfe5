"""DRF's JSON parser, with JSON nested too deep for the decoder (`[[[[…`) a 400 like any bad JSON."""

from rest_framework import exceptions, parsers


class JSONParser(parsers.JSONParser):
    def parse(self, stream, media_type=None, parser_context=None):  # type: ignore[no-untyped-def]
        try:
            return super().parse(stream, media_type, parser_context)
        except RecursionError:
            raise exceptions.ParseError("JSON parse error - nested too deeply; send a flat object.") from None
