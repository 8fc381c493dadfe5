"""What runs on a GPU host's worker: a job's process and its end, the spool, a lab's
worker side, the host's watchdog, DCGM's mapping; the launcher (launcher-bin/) and the lab's
launcher (jupyter/) beside them. Nothing here serves a web request."""
