"""JupyterLab on the listening socket its worker made (jobs.host.lab): the lab never binds a port itself.

The worker runs this file with the job's own interpreter (another venv or conda env, perhaps,
without the portal on its path), so it imports only the standard library, and JupyterLab::

    PORTAL_LAB_LISTEN_FD=<fd> <interpreter> /abs/path/jobs/host/jupyter/lab_launcher.py [jupyterlab options]

The worker bound the socket (SESSION_BIND_ADDRESS, a port the kernel chose) and listens on it
before the lab's process exists, so no other account on the host can take the lab's address
between a port being picked and Jupyter binding it (Jupyter needs a second or two to import,
and `--ServerApp.port=N` on a command line is anyone's to read). The socket arrives as an
inherited fd, named in PORTAL_LAB_LISTEN_FD. This file adopts it and has jupyter_server serve on
it (`HTTPServer.add_sockets`) instead of `listen()`ing on a port of its own: it replaces
`ServerApp._find_http_port` (which probes the port by binding it) and
`ServerApp._bind_http_server_tcp` in this process (a jupyter_server without them is refused),
takes `listen` and `bind` away from tornado's TCPServer, then runs `jupyterlab.labapp.main()` as
`python -m jupyterlab` does. Written against jupyter_server 2.21.

No fd, or one that is not a listening TCP socket: it says so on stderr and exits with
REFUSED_EXIT_CODE before Jupyter is even imported. It never falls back to a port of its own.
"""

from __future__ import annotations

import os
import socket
import stat
import sys
from typing import NoReturn

LISTEN_FD_ENV = "PORTAL_LAB_LISTEN_FD"
REFUSED_EXIT_CODE = 3  # jobs.host.lab.LISTENER_REFUSED_EXIT_CODE


def refuse(why: str) -> NoReturn:
    sys.stderr.write(f"[portal] JupyterLab does not start: {why}; it never binds a port of its own.\n")
    sys.exit(REFUSED_EXIT_CODE)


def adopt() -> socket.socket:
    """The listening TCP socket the worker passed down, kept from every process the lab starts."""
    named = os.environ.pop(LISTEN_FD_ENV, "")  # the kernels and terminals inherit no stale number
    if not named.isdigit():
        refuse(f"{LISTEN_FD_ENV} does not name the listening socket's fd ({named!r})")
    fd = int(named)
    try:
        mode = os.fstat(fd).st_mode
    except OSError as exc:
        refuse(f"fd {fd} ({LISTEN_FD_ENV}) is not open: {exc.strerror}")
    if not stat.S_ISSOCK(mode):
        refuse(f"fd {fd} ({LISTEN_FD_ENV}) is not a socket")
    sock = socket.socket(fileno=fd)
    if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
        refuse(f"fd {fd} ({LISTEN_FD_ENV}) is not a TCP socket")
    if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
        refuse(f"fd {fd} ({LISTEN_FD_ENV}) is a TCP socket that is not listening")
    # Inherited, it is inheritable: the kernels and terminals Jupyter starts must not hold the
    # lab's listener (user code could accept the portal's requests on it).
    os.set_inheritable(fd, False)
    return sock


def serve(sock: socket.socket) -> None:
    import jupyter_server
    from jupyter_server.serverapp import ServerApp
    from jupyterlab.labapp import main
    from tornado.tcpserver import TCPServer

    for seam in ("_find_http_port", "_bind_http_server_tcp"):
        if not callable(getattr(ServerApp, seam, None)):
            version = jupyter_server.__version__
            refuse(f"jupyter_server {version} has no ServerApp.{seam} to serve the socket through")

    def no_port_of_its_own(*args: object, **kwargs: object) -> None:
        raise OSError("this lab serves the socket its worker made, never a port of its own")

    # Whatever else this jupyter_server version does, its HTTP server listens nowhere else.
    TCPServer.listen = no_port_of_its_own  # type: ignore[method-assign,assignment]
    TCPServer.bind = no_port_of_its_own  # type: ignore[method-assign,assignment]
    port = sock.getsockname()[1]

    def port_of_the_socket(app: ServerApp) -> None:
        app.port = port  # for its URLs and server info; nothing is probed

    def serve_the_socket(app: ServerApp) -> bool:
        sock.setblocking(False)  # as tornado's own bind_sockets makes it: accepted in a loop
        app.http_server.add_sockets([sock])
        return True

    ServerApp._find_http_port = port_of_the_socket  # type: ignore[method-assign]
    ServerApp._bind_http_server_tcp = serve_the_socket  # type: ignore[method-assign]
    sys.exit(main())


if __name__ == "__main__":
    # This file's folder (the portal's Jupyter data) first on sys.path would let its `kernels`
    # folder stand in for a package of that name; JupyterLab gets the path `python -m` gives it.
    if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
        sys.path[0] = os.getcwd()
    serve(adopt())
