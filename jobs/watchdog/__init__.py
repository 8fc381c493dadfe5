"""The GPU watchdog's portal-side parts: the rules (a pure function), who is told, and its words
and records (what people asked of a violation among them). The round on a GPU host is
jobs.host.watchdog."""
