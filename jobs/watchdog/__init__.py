"""The GPU watchdog's portal-side parts: the rules (a pure function) and who is told.
The round on a GPU host is jobs.host.watchdog."""
