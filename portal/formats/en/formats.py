"""English (LANGUAGE_CODE en-us): 'Mon 2026-11-23 14:00', as portal.timefmt.format_time writes it
(less the zone, which each page's footer names). Unset formats (the input formats) stay Django's."""

DATETIME_FORMAT = "D Y-m-d H:i"
DATE_FORMAT = "D Y-m-d"
TIME_FORMAT = "H:i"
SHORT_DATETIME_FORMAT = "Y-m-d H:i"
SHORT_DATE_FORMAT = "Y-m-d"
