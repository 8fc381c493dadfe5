from rest_framework.exceptions import NotFound, ValidationError
from rest_framework.pagination import PageNumberPagination


class PagePagination(PageNumberPagination):
    """50 a page, `?page_size=` up to 500: for lists that grow without bound (bookings, audit).
    A page or page size that is no whole number, or a page past the last, is a 400 naming it."""

    page_size = 50
    page_size_query_param = "page_size"
    max_page_size = 500

    def get_page_size(self, request):  # type: ignore[no-untyped-def]
        raw = request.query_params.get(self.page_size_query_param, "").strip()
        if not raw:
            return self.page_size
        if not (raw.isascii() and raw.isdigit()) or int(raw) < 1:
            raise ValidationError(
                {
                    "page_size": [
                        f"{raw!r} is not a page size; give a whole number from 1 to {self.max_page_size}."
                    ]
                }
            )
        return min(int(raw), self.max_page_size)

    def paginate_queryset(self, queryset, request, view=None):  # type: ignore[no-untyped-def]
        try:
            return super().paginate_queryset(queryset, request, view)
        except NotFound:
            pages = self.django_paginator_class(queryset, self.get_page_size(request)).num_pages
            raw = request.query_params.get(self.page_query_param)
            raise ValidationError(
                {"page": [f"There is no page {raw!r}; give a whole number from 1 to {pages}."]}
            ) from None
