from rest_framework.pagination import PageNumberPagination


class PagePagination(PageNumberPagination):
    """50 a page, `?page_size=` up to 500: for lists that grow without bound (bookings, audit)."""

    page_size = 50
    page_size_query_param = "page_size"
    max_page_size = 500
