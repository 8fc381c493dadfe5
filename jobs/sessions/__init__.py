"""Interactive sessions on a booking: `gpu exec` and `gpu shell`, JupyterLab (its
hand-off, proxy and relay), their pages and API. The lab's worker side is jobs.host.lab."""
