"""The `gpu` command: its group, login and logout; the rest are in cards.py and jobs.py."""

from __future__ import annotations

import os
import socket
import sys
from contextlib import suppress

import click

from gpu_cli import cards, config, interactive, jobs
from gpu_cli.api import Portal
from gpu_cli.errors import Refused, Unreachable


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="gpu-lab-portal", prog_name="gpu")
def cli() -> None:
    """The GPU lab portal from a terminal: cards, bookings, jobs and their logs.

    Log in once with `gpu login URL`; GPU_PORTAL_URL and GPU_PORTAL_TOKEN override the stored login.

    \b
    Exit codes:
      0  done
      1  the portal refused (its reason is printed)
      2  usage error
      3  cannot reach the portal, or not logged in
      4  not found (or not yours to see)
      gpu run --wait: the job's own (docs/cli.md)
      gpu exec, gpu shell: the command's own (128 + N when a signal N ended it)
    """


@cli.command()
@click.argument("url", envvar=config.URL_ENV)
@click.option("--username", prompt=True, help="Your portal username [asked].")
@click.option("--password-stdin", is_flag=True, help="Read the password from stdin (scripts), not a prompt.")
def login(url: str, username: str, password_stdin: bool) -> None:
    """Log in to the portal at URL and keep its token in your config folder (readable by you only).

    \b
      gpu login http://localhost:8000/
      echo "$PASSWORD" | gpu login https://gpu.lab.example --username alice --password-stdin
    """
    url = config.portal_url(url)
    if password_stdin:
        password = sys.stdin.readline().rstrip("\r\n")
    else:
        password = click.prompt("Password", hide_input=True)
    with Portal(url) as portal:
        # Named after this machine, so the profile page says which token to revoke when it is lost.
        name = f"gpu CLI on {socket.gethostname()}"[:100]
        token = portal.post("token/", data={"username": username, "password": password, "name": name}).get(
            "token"
        )
    if not token:
        raise Refused(f"{url} answered without a token: is it the GPU lab portal?")
    try:
        path = config.save(config.Login(url=url, token=token), username)
    except OSError as exc:  # config.json a folder, a read-only home: no token left live and unkept
        with suppress(click.ClickException), Portal(url, token, retry_seconds=0) as portal:
            portal.request("DELETE", "token/current/")
        raise Unreachable(
            f"Cannot write {config.config_path()} ({exc.strerror or exc}): not logged in."
        ) from None
    click.echo(f"Logged in to {url} as {username}; the token is in {path}.")
    if os.environ.get(config.TOKEN_ENV):
        click.echo(f"Note: {config.TOKEN_ENV} is set, and overrides this login while it is.", err=True)


@cli.command()
def logout() -> None:
    """Revoke the stored login's token at the portal and forget the login. Where the portal cannot
    be reached the login is forgotten all the same: revoke the token on your profile page then."""
    try:
        stored = config.stored_login()
    except Unreachable as exc:  # a corrupt or unreadable file: forgetting it is what was asked
        click.echo(f"{exc.format_message()} Deleting it; revoke its token on your profile page.", err=True)
        stored = None
    if stored is not None:
        try:
            with Portal(stored.url, stored.token) as portal:
                portal.request("DELETE", "token/current/")
        except click.ClickException as exc:  # unreachable, refused, already revoked
            click.echo(
                f"The token was not revoked ({exc.format_message()}); revoke it on your profile page.",
                err=True,
            )
    url = config.forget()
    click.echo(f"Logged out of {url}." if url else "Not logged in.")


for command in (
    cards.status,
    cards.book,
    cards.release,
    cards.images,
    jobs.run,
    jobs.queue,
    jobs.jobs,
    jobs.history,
    jobs.logs,
    jobs.cancel,
    interactive.exec_,
    interactive.shell,
):
    cli.add_command(command)
