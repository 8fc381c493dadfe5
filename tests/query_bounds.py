"""How many queries each hot path takes, however many servers, cards and processes (issue 40):
held at two sizes by tests/test_hot_path_queries.py, and printed beside the timings by the
benches (bench/bench_inventory.py, bench/bench_watchdog.py), which compare their counts with
these. A bound that has to move moves here, once, with the reason in the commit."""

from __future__ import annotations

# GET / (the dashboard page, signed in, no time zone chosen): the session, the user, the open
# violations, the processes, the viewer's profile (their Unix account), their teams, the bookings
# now, the cards, the servers (with the database's clock), the bell; and two more when a process
# runs as the viewer's username (whether it stands in for their Unix account: unix_account_name),
# as it does at these bounds. Two fewer (10) with none. One more (the Slurm nodes) where a server
# is a Slurm cluster, as none is at these bounds.
DASHBOARD = 12
# GET /api/v1/gpus/: the session, the user, the processes, the viewer's profile, the jobs' images,
# their teams, the bookings now, the cards; and the same two more (7 without them).
GPU_LIST = 9
# One telemetry round whose process lists did not change, in its transaction: the servers (read,
# write), the cards (read, write), the lent cards' read in the jobs app's savepoint. On PostgreSQL
# each write is three (gpus/bulk.py: the staging table, COPY, UPDATE). A round with a job's
# process on its cards takes more: the jobs' usage, in a savepoint of its own.
INGEST_STEADY = {"sqlite": 9, "postgresql": 13}
# The same round when every process list changed: a DELETE and an INSERT (COPY) more.
INGEST_CHANGED = {"sqlite": 11, "postgresql": 15}
# One steady watchdog round on a host (jobs/host/watchdog.py): its server (the UPDATE of the last
# round's time), what people asked of its open violations, its jobs, bookings and sessions, and
# the UPDATE of the open violations' `last_seen`.
WATCHDOG_ROUND = 6
