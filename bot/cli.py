"""``trainbot``: the control plane and its front ends.

    trainbot demo [--events FILE]   the whole product on this machine, in a few minutes
    trainbot shell                  a terminal chat over the same commands as Slack
    trainbot serve                  the control plane: HTTP (ingest, Slack), scheduler, database
    trainbot migrate                bring the database schema up to date and exit

Settings come from ``TRAINBOT_*`` environment variables; every one has an embedded
default (SQLite in ~/.trainbot, the local spot provider, a local checkpoint store, the
terminal as chat).
"""

from __future__ import annotations

import argparse
import getpass
import importlib.metadata
import logging
import os
import re
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from bot.commands import BotError
from jobs.errors import SettingsError, TrainbotError
from jobs.providers import registration

if TYPE_CHECKING:
    from jobs.bootstrap import ControlPlane
    from jobs.settings import Settings


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
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    return p


def _shell() -> int:
    from bot.console import ConsoleNotifier, Shell
    from jobs.bootstrap import ControlPlane
    from jobs.settings import load_settings

    settings = load_settings()
    cp = ControlPlane(settings, notifier=ConsoleNotifier())
    # Made before the start, so that the preflights it resumes ask the shell's launchers.
    shell = Shell(cp.deps, user=getpass.getuser())
    with cp:
        return shell.loop()


def _migrate() -> int:
    """The schema upgrade alone, for a deploy step that runs before the replicas start
    (they also migrate at start, under the same lock; then there is nothing left to do)."""
    from jobs.db import current_revision, make_engine, migrate
    from jobs.logs import announce
    from jobs.settings import load_settings

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
    from jobs.bootstrap import ControlPlane
    from jobs.settings import ENV_PREFIX, google_credentials_environ, load_settings

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
    from jobs.logs import announce

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
    from jobs.bootstrap import ControlPlane

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
    """Logs to stderr as TRAINBOT_LOG_FORMAT says (jobs.logs), the settings' secrets
    redacted by value. Settings that do not validate are reported by the command itself;
    the logs then use the defaults and redact by pattern only."""
    from jobs.logs import configure_logging, secret_values
    from jobs.settings import load_settings, parse_log_level

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
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
