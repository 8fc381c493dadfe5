import time, statistics
from bench.common import setup_django_test_db
td = setup_django_test_db()
try:
    from gpus.services import server_report_ingest
    from tests.factories import make_snapshot
    from gpus.selectors import servers_for_dashboard
    from django.template.loader import render_to_string
    from django.db import connection
    for s in range(64):
        server_report_ingest(snapshot=make_snapshot(f"b{s:02d}", gpus=8, processes=2))
    def t(fn, n=10):
        xs=[]
        for _ in range(n):
            a=time.perf_counter(); fn(); xs.append((time.perf_counter()-a)*1000)
        return statistics.median(xs)
    def load():
        servers=list(servers_for_dashboard())
        for s in servers:
            for g in s.gpus.all(): list(g.processes.all())
        return servers
    print("load", t(load))
    servers=load()
    print("render", t(lambda: render_to_string("gpus/_servers.html", {"servers": servers})))
    snaps=[make_snapshot(f"b{s:02d}", gpus=8, processes=2) for s in range(64)]
    print("ingest one", t(lambda: server_report_ingest(snapshot=snaps[0]), 30))
finally:
    td()
