from django.templatetags.static import static
from django.urls import reverse
from jinja2 import Environment


def na(value: object, suffix: str = "") -> str:
    """A metric the driver does not report (None) reads "n/a"; a filter, not a macro, for speed."""
    return "n/a" if value is None else f"{value}{suffix}"


def environment(**options) -> Environment:
    env = Environment(**options)
    env.globals.update({"static": static, "url": reverse})
    env.filters["na"] = na
    return env
