from django.templatetags.static import static
from django.urls import reverse
from jinja2 import Environment

from portal.figures import na


def environment(**options) -> Environment:
    env = Environment(**options)
    env.globals.update({"static": static, "url": reverse})
    env.filters["na"] = na
    return env
