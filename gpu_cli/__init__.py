"""`gpu`: the GPU lab portal from a terminal, through its REST API (/api/v1/).

This package imports nothing of the portal (no Django, no portal app): on a user's own machine
only it and its dependencies (click, httpx, rich) are installed. docs/cli.md describes it.
"""
