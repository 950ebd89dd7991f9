"""``trainbot``: the control plane, its front ends, and the client of its API.

    trainbot demo [--events FILE]   the whole product on this machine, in a few minutes
    trainbot shell                  a terminal chat over the same commands as Slack, alone
    trainbot serve                  the control plane: HTTP (ingest, Slack), scheduler, database
    trainbot migrate                bring the database schema up to date and exit

The client of a team's ``trainbot serve`` (TRAINBOT_URL, and TRAINBOT_TOKEN from
``/train token`` in Slack; standard library only, so the base install runs it):

    trainbot launch spec.yaml [--set key.path=value …]   trainbot list [mine|active|all]
    trainbot status [RUN]   trainbot logs RUN [ATTEMPT [NODE]]   trainbot stop RUN
    trainbot resubmit RUN [from=STEP] [key.path=value …]   trainbot ack ALERT

    trainbot pack DIR STORE_URI     pack a code directory for ``code.archive`` (as
                                    ``trainbot-runner pack``)

Settings come from ``TRAINBOT_*`` environment variables; every one has an embedded
default (SQLite in ~/.trainbot, the local spot provider, a local checkpoint store, the
terminal as chat).
"""

from __future__ import annotations

import argparse
import errno
import getpass
import importlib.metadata
import logging
import os
import re
import signal
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from bot.commands import BotError
from jobs.domain.errors import SettingsError, TrainbotError
from jobs.providers import registration

if TYPE_CHECKING:
    from jobs.process.bootstrap import ControlPlane
    from jobs.process.settings import Settings


log = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="trainbot",
        description="Chat-ops for long training runs on spot GPUs.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    demo = sub.add_parser("demo", help="run the whole story locally: preflight to digest")
    demo.add_argument("--events", type=Path, help="write every event as JSON lines here")
    demo.add_argument(
        "--state-dir", type=Path, help="keep the demo's database and checkpoints here"
    )
    demo.add_argument("--timeout", type=float, default=900.0, help="give up after N seconds")
    sub.add_parser("shell", help="a terminal chat over the command layer")
    sub.add_parser(
        "migrate", help="bring the database schema up to date, then exit (a deploy's Job)"
    )
    serve = sub.add_parser("serve", help="run the control plane until stopped")
    serve.add_argument(
        "--host", help="address to listen on (default: TRAINBOT_INGEST_HOST, else 127.0.0.1)"
    )
    serve.add_argument(
        "--port",
        type=_port,
        help="port to listen on; 0 picks a free one (default: TRAINBOT_INGEST_PORT, else 8787)",
    )
    serve.add_argument(
        "--admin-host",
        help="address of /healthz, /readyz and /metrics (default: TRAINBOT_ADMIN_HOST, "
        "else 127.0.0.1)",
    )
    serve.add_argument(
        "--admin-port",
        type=_port,
        help="port of /healthz, /readyz and /metrics; 0 picks a free one (default: "
        "TRAINBOT_ADMIN_PORT, else the port + 1)",
    )
    _client_commands(sub)
    pack = sub.add_parser(
        "pack",
        help="pack a code directory into a content-addressed archive in the store",
        description="Pack DIR (without .git, .venv, __pycache__ and the patterns of its "
        ".trainbotignore) into code-<sha256>.tar.gz under STORE_URI (s3://…, gs://…, a "
        "path or file://…), and print the spec line that runs it: code.archive: URI. "
        "The same as trainbot-runner pack.",
    )
    pack.add_argument("dir", type=Path)
    pack.add_argument("store_uri")
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    return p


#: The client's commands (:mod:`bot.client`): each is the ``/train`` verb of its name.
CLIENT_COMMANDS = ("launch", "list", "status", "logs", "stop", "resubmit", "ack")


def _client_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    shared = argparse.ArgumentParser(add_help=False)
    shared.add_argument("--json", action="store_true", help="print the server's answer as JSON")
    launch = sub.add_parser(
        "launch",
        parents=[shared],
        help="client: launch a spec file (or a spec the server has, by name)",
    )
    launch.add_argument("spec", help="a spec file (spec.yaml), or the name of a server spec")
    launch.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY.PATH=VALUE",
        help="override a spec value for this run (repeatable): --set budget.usd=5",
    )
    launch.add_argument(
        "--idempotency-key",
        dest="key",
        metavar="KEY",
        help="launch once per key: a retry (a CI job's) gets the first launch's run",
    )
    listing = sub.add_parser("list", parents=[shared], help="client: list runs")
    listing.add_argument("args", nargs="?", choices=("mine", "active", "all"), metavar="SCOPE")
    status = sub.add_parser("status", parents=[shared], help="client: a run's state")
    status.add_argument("args", nargs="?", metavar="RUN")
    logs = sub.add_parser("logs", parents=[shared], help="client: a run's last output lines")
    logs.add_argument("args", nargs="+", metavar="RUN [ATTEMPT [NODE]]")
    stop = sub.add_parser("stop", parents=[shared], help="client: stop a run of yours")
    stop.add_argument("args", nargs=1, metavar="RUN")
    resubmit = sub.add_parser("resubmit", parents=[shared], help="client: a new attempt of a run")
    resubmit.add_argument("args", nargs="+", metavar="RUN [from=STEP] [key.path=value …]")
    ack = sub.add_parser("ack", parents=[shared], help="client: acknowledge an alert")
    ack.add_argument("args", nargs=1, metavar="ALERT")


def _client(args: argparse.Namespace) -> int:
    from bot import client

    if args.cmd == "launch":
        return client.run("launch", [args.spec], sets=args.sets, key=args.key, as_json=args.json)
    words = args.args if isinstance(args.args, list) else [args.args] if args.args else []
    return client.run(args.cmd, words, as_json=args.json)


def _pack(root: Path, store_uri: str) -> int:
    """``trainbot-runner pack``'s work (:func:`runner.code.pack`), for whoever has only
    the control plane's command at hand; the spec line to use, or one line why not."""
    from runner.code import pack
    from runner.errors import RunnerError

    try:
        uri = pack(root, store_uri)
    except RunnerError as exc:
        print(f"trainbot: {exc}", file=sys.stderr)
        return 2
    print(f"code.archive: {uri}")
    return 0


class _Terminated(Exception):
    """SIGTERM reached the shell: it quits as on Ctrl-D, cleaning up."""


def _shell() -> int:
    """The one-person local mode: this machine's control plane, for the person at the
    terminal. It binds free ports of its own (a second shell does not collide with the
    first), refuses the team's shared database (the client is for that), and on the way
    out (Ctrl-D, Ctrl-C, SIGTERM) stops its runs and their training processes and gives
    the scheduler lease back."""
    from bot.console import ConsoleNotifier, Shell
    from jobs.process.bootstrap import ControlPlane
    from jobs.process.settings import load_settings

    settings = load_settings(shell_environ(os.environ))
    problem = shell_problem(settings)
    if problem is not None:
        raise SettingsError(problem)
    cp = ControlPlane(settings, notifier=ConsoleNotifier())
    # Made before the start, so that the preflights it resumes ask the shell's launchers.
    shell = Shell(cp.deps, user=getpass.getuser())

    def terminated(signum: int, frame: object) -> None:
        raise _Terminated  # in the main thread, wherever it waits (reading a line)

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        started = False
        try:
            _start(cp)
            started = True
            return shell.loop()
        except KeyboardInterrupt:
            return 130
        except _Terminated:
            return 128 + signal.SIGTERM
        finally:
            close_shell(cp, started=started)
    finally:
        signal.signal(signal.SIGTERM, previous)


def shell_environ(environ: Mapping[str, str]) -> dict[str, str]:
    """The shell's settings: its ports are free ones unless set, so two shells (or a
    shell beside ``trainbot serve``) on one machine do not collide."""
    from jobs.process.settings import ENV_PREFIX

    chosen = dict(environ)
    for name in ("INGEST_PORT", "ADMIN_PORT"):
        chosen.setdefault(f"{ENV_PREFIX}{name}", "0")
    return chosen


def shell_problem(settings: Settings) -> str | None:
    """Why ``trainbot shell`` must not start with these settings, or None."""
    if settings.database_url.startswith(("postgresql", "postgres")):
        return (
            "TRAINBOT_DATABASE_URL is a PostgreSQL database, a team's control plane's: "
            "trainbot shell is the one-person local mode and would become another replica "
            "of it. Use the client against the team's control plane (TRAINBOT_URL and "
            "TRAINBOT_TOKEN from /train token; trainbot list, trainbot launch spec.yaml), "
            "or unset TRAINBOT_DATABASE_URL for a shell of your own"
        )
    return None


def _start(cp: ControlPlane) -> None:
    """Start the control plane; a port that is taken is one line saying what to do."""
    try:
        cp.start()
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        settings = cp.settings
        raise SettingsError(
            f"a port is already in use (public {settings.ingest_host}:{settings.ingest_port}, "
            f"admin {settings.admin_host}:{settings.admin_port}): another trainbot is "
            "listening there. Stop it, or choose free ports (TRAINBOT_INGEST_PORT and "
            "TRAINBOT_ADMIN_PORT; 0 picks one)"
        ) from None


def close_shell(cp: ControlPlane, *, started: bool = True) -> None:
    """Quit the shell leaving nothing behind: its active runs are stopped (a checkpoint
    flushed, the instance terminated), the scheduler lease released and the server
    closed; then any training process of an on-this-machine provider still alive ends."""
    from sqlmodel import select

    from jobs.database.db import session_scope
    from jobs.database.models import Run
    from jobs.domain.actor import Actor
    from jobs.usecases.service import stop

    if started:
        with session_scope(cp.deps.engine) as session:
            runs = session.exec(select(Run)).all()
            active = [run.id for run in runs if not run.state.is_terminal()]
        quitter = Actor(user=getpass.getuser(), channel="console", is_admin=True)
        for run_id in active:
            try:
                stop(cp.deps, run_id, quitter, reason="the shell quit")
            except TrainbotError as exc:
                log.warning("could not stop %s on the way out: %s", run_id, exc)
        if active:
            print(f"trainbot shell: stopped {', '.join(active)} on the way out", file=sys.stderr)
    local = [
        provider
        for name, provider in cp.deps.providers.items()
        if registration(name).on_this_machine
    ]
    cp.close()  # waits for the stops; releases the lease; closes the server
    for provider in local:
        for instance in provider.list_instances():
            if not instance.state.is_terminal():
                provider.terminate(instance.instance_id)


def _migrate() -> int:
    """The schema upgrade alone, for a deploy step that runs before the replicas start
    (they also migrate at start, under the same lock; then there is nothing left to do)."""
    from jobs.database.db import current_revision, make_engine, migrate
    from jobs.process.logs import announce
    from jobs.process.settings import load_settings

    settings = load_settings(purpose="migrate")
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    engine = make_engine(settings.database_url)
    try:
        migrate(engine)
        revision = current_revision(engine)
        announce(f"trainbot: database at revision {revision}", revision=revision)
    finally:
        engine.dispose()
    return 0


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port: use 0-65535")
    return port


def _serve(
    host: str | None = None,
    port: int | None = None,
    *,
    admin_host: str | None = None,
    admin_port: int | None = None,
) -> int:
    from bot.console import ConsoleNotifier
    from jobs.process.bootstrap import ControlPlane
    from jobs.process.google_env import google_credentials_environ
    from jobs.process.settings import ENV_PREFIX, load_settings

    # The flags win over the environment, as in uvicorn and gunicorn; the settings are
    # validated with them (a public URL derived from the port, for one).
    overrides = {
        f"{ENV_PREFIX}INGEST_HOST": host,
        f"{ENV_PREFIX}INGEST_PORT": None if port is None else str(port),
        f"{ENV_PREFIX}ADMIN_HOST": admin_host,
        f"{ENV_PREFIX}ADMIN_PORT": None if admin_port is None else str(admin_port),
    }
    environ = {**os.environ, **{k: v for k, v in overrides.items() if v is not None}}
    settings = load_settings(environ)
    # A key file only where one is mounted; else Workload Identity or the instance's account.
    os.environ.update(google_credentials_environ(settings))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if _wants_slack(settings):
        return _serve_slack(settings, stop)
    with ControlPlane(settings, notifier=ConsoleNotifier()) as cp:
        assert cp.server is not None
        _banner(
            f"trainbot control plane on {cp.server.url}; health and metrics on "
            f"{cp.server.admin_url} (Ctrl-C to stop)",
            url=cp.server.url,
            admin_url=cp.server.admin_url,
        )
        stop.wait()
        _drain(cp)
    return 0


def _banner(message: str, **fields: object) -> None:
    """The start-up line: a JSON record where the logs are JSON (a container's log
    shipper reads one format), with the version and Python it runs on."""
    from jobs.process.logs import announce

    try:
        version = importlib.metadata.version("trainbot")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    python = ".".join(map(str, sys.version_info[:3]))
    announce(message, to=sys.stdout, event="started", version=version, python=python, **fields)


#: Seconds a stopping replica gives the HTTP requests in flight to finish.
DRAIN_S = 20.0


def _drain(cp: ControlPlane) -> None:
    """SIGTERM: hand the scheduler lease over (after the jobs running finish), so another
    replica leads at once instead of when the lease expires; then stop accepting and let
    the requests in flight finish. Closing the control plane does the rest."""
    log.info("stopping: releasing the scheduler lease and draining requests")
    if cp.elector is not None:
        cp.elector.stop(release=True)
    if cp.server is not None:
        cp.server.shutdown(timeout=DRAIN_S)


def _wants_slack(settings: Settings) -> bool:
    """Slack when asked for, or when both of its credentials are there."""
    has_credentials = settings.slack_bot_token is not None and (
        settings.slack_signing_secret is not None
    )
    return settings.notifier == "slack" or has_credentials


def launch_policy_problem(settings: Settings) -> str | None:
    """Why the Slack app must not start with these settings, or None.

    The local provider runs each launched command on this machine, the one that holds
    the Slack secrets and the database: that is for one person, so with Slack in front of
    it someone has to say who that person (or group) is.
    """
    if not settings.launchers and any(
        registration(name).on_this_machine for name in settings.configured_providers
    ):
        return (
            "TRAINBOT_LAUNCHERS is not set: with the Slack app and the local provider, "
            "anyone in an allowed channel could run a program on this machine. Set "
            "TRAINBOT_LAUNCHERS to the Slack user ids or @group handles who may launch "
            "(for example TRAINBOT_LAUNCHERS=U0123ABCD,@ml-leads), or use a cloud provider "
            "(TRAINBOT_PROVIDER=aws or gcp)"
        )
    return None


def _serve_slack(settings: Settings, stop: threading.Event) -> int:
    """The control plane with the Slack app at /slack/events (and Socket Mode when an
    app-level token is set); alerts and run updates go to Slack."""
    from slack_sdk import WebClient

    from bot.slack_notifier import SlackNotifier
    from bot.slack_wsgi import attach
    from jobs.process.bootstrap import ControlPlane

    problem = launch_policy_problem(settings)
    if problem is not None:
        raise SettingsError(problem)
    assert settings.slack_bot_token is not None
    client = WebClient(
        token=settings.slack_bot_token.get_secret_value(), base_url=settings.slack_api_url
    )
    notifier = SlackNotifier(client)
    try:
        cp = ControlPlane(settings, notifier=notifier)
        front = attach(cp, client=client, notifier=notifier)
        with cp:
            try:
                front.start()
                assert cp.server is not None
                socket_mode = " and Socket Mode" if front.socket is not None else ""
                _banner(
                    f"trainbot control plane on {cp.server.url}; Slack at "
                    f"{cp.server.url}/slack/events{socket_mode}; health and metrics on "
                    f"{cp.server.admin_url} (Ctrl-C to stop)",
                    url=cp.server.url,
                    admin_url=cp.server.admin_url,
                    slack_url=f"{cp.server.url}/slack/events",
                    socket_mode=front.socket is not None,
                )
                stop.wait()
                _drain(cp)
            finally:
                front.close()  # Slack work in flight finishes before the control plane stops
    finally:
        notifier.close()  # flushes the Slack post queue (paced, so it may take seconds)
    return 0


def missing_server_extra() -> list[str]:
    """The distributions of the ``server`` extra that are not installed here.

    Instances install the runner alone (``pip install trainbot``); the control plane's
    dependencies come with ``trainbot[server]``. The list is read from the installed
    metadata, so it is pyproject's own; a source tree without metadata reports nothing.
    """
    try:
        requirements = importlib.metadata.requires("trainbot") or []
    except importlib.metadata.PackageNotFoundError:
        return []
    missing: list[str] = []
    for requirement in requirements:
        spec, _, marker = requirement.partition(";")
        name = re.match(r"[A-Za-z0-9._-]+", spec.strip())
        if name is None or not re.search(r"""extra\s*==\s*["']server["']""", marker):
            continue
        try:
            importlib.metadata.distribution(name.group(0))
        except importlib.metadata.PackageNotFoundError:
            missing.append(name.group(0))
    return missing


def _configure_logging(*, verbose: bool) -> None:
    """Logs to stderr as TRAINBOT_LOG_FORMAT says (jobs.process.logs), the settings' secrets
    redacted by value. Settings that do not validate are reported by the command itself;
    the logs then use the defaults and redact by pattern only."""
    from jobs.process.logs import configure_logging, parse_log_level, secret_values
    from jobs.process.settings import load_settings

    # Raises SettingsError (one line, shown by main) for a value that is not a level.
    level = logging.INFO if verbose else parse_log_level(os.environ.get("TRAINBOT_LOG_LEVEL"))
    try:
        settings = load_settings()
    except SettingsError:
        configure_logging(level=level)
        return
    configure_logging(settings.log_format, level=level, secrets=secret_values(settings))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.cmd in CLIENT_COMMANDS:  # the client: standard library only, no settings
        return _client(args)
    if args.cmd == "pack":  # the runner's own code: the base install runs it
        return _pack(args.dir, args.store_uri)
    missing = missing_server_extra()
    if missing:
        print(
            f"trainbot: `trainbot {args.cmd}` runs the control plane, which is not installed "
            f"here (missing {', '.join(missing)}); this install has the runner only "
            "(trainbot-runner). Install the control plane with: pip install 'trainbot[server]'",
            file=sys.stderr,
        )
        return 2
    try:
        _configure_logging(verbose=args.verbose)
        if args.cmd == "demo":
            from bot.demo import run_demo

            return run_demo(events=args.events, state_dir=args.state_dir, timeout_s=args.timeout)
        if args.cmd == "shell":
            return _shell()
        if args.cmd == "migrate":
            return _migrate()
        return _serve(
            host=args.host,
            port=args.port,
            admin_host=args.admin_host,
            admin_port=args.admin_port,
        )
    except (TrainbotError, BotError) as exc:
        print(f"trainbot: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        print(
            f"trainbot: a port is already in use ({exc.strerror}): another trainbot is "
            "listening there; stop it, or choose free ones (--port, --admin-port; 0 picks one)",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
