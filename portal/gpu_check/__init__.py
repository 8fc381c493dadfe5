"""`make gpu-check`: the portal's GPU promises, proved on this machine's real NVIDIA cards.

It drives the portal from the outside, as a lab would: `make run`'s portal as a subprocess on a
temporary var folder (SQLite, the embedded Redis, this machine as its one GPU host), users made
through `manage.py`, bookings, jobs and verdicts through the REST API, `gpu exec` through the
CLI. It imports nothing of gpus or jobs. See docs/gpu-check.md.

Modules: `bootstrap` (a temporary venv from var/gpu-check-wheels/ where this Python lacks the
portal's requirements; standard library only), `portal_run` (the portal and its API),
`machine` (nvidia-smi, NVML and the helper processes), `checks_*` (one function per check),
`report` (the table and gpu-check-report.json), `runner` (the order, the time limits, teardown).
"""
