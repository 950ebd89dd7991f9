"""The process's log output: text or JSON lines, with run and attempt ids, never a secret.

``TRAINBOT_LOG_FORMAT`` picks the format (:func:`configure_logging`): ``text`` (the
default on a terminal) or ``json``, one object per line with ``time``, ``level``,
``logger`` and ``message``, plus ``run_id`` and ``attempt_id`` where the code that logs
knows them, and ``exception`` with the traceback. Unset, a process whose stderr is not a
terminal (a container, a service) writes JSON, for log shippers.

The ids come from a context variable, set by the code paths that know them with
:func:`log_context` (an ingest request once its token names the attempt, the service's
background work for its run); a thread started from there inherits them only where its
starter copies the context (``contextvars.copy_context``).

Secrets never reach the output, in either format: :class:`RedactSecrets` rewrites every
record's message and traceback before it is formatted, by pattern (Slack tokens
``xoxb-``/``xoxp-``/``xapp-``…, ``Bearer`` credentials, the values of names that say
token, secret, password, key or creds (``AWS_SECRET_ACCESS_KEY=``, ``MY_CREDS:``), every
value of a spec's ``env`` (``env.NAME=``, an ``"env": {…}`` mapping), Slack's ``v0=``
signatures, URL passwords) and by value (the settings' secrets, read from the
:class:`~jobs.process.settings.Settings` fields typed ``SecretStr``). That is the last line of
defence: code that logs what a person typed logs it parsed, with ``env`` masked by
structure (a command's ``repr``), and a failure whose messages may quote it as a
:func:`bare_traceback`.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import traceback
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime, timezone
from types import MappingProxyType
from typing import IO, TYPE_CHECKING, Literal

from pydantic import SecretStr

from jobs.domain.errors import SettingsError

if TYPE_CHECKING:
    from jobs.process.settings import Settings

__all__ = [
    "REDACTED",
    "ContextFilter",
    "JsonFormatter",
    "LogFormat",
    "RedactSecrets",
    "announce",
    "bare_traceback",
    "configure_logging",
    "log_context",
    "secret_values",
]

LogFormat = Literal["text", "json"]
REDACTED = "[redacted]"
#: The ids a record may carry, in the order the text format shows them.
CONTEXT_KEYS = ("run_id", "attempt_id")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s%(context)s: %(message)s"

_CONTEXT: ContextVar[Mapping[str, str]] = ContextVar(
    "trainbot_log_context", default=MappingProxyType({})
)

#: What a secret looks like where no setting names it. Each pattern's first group, when
#: it has one, is kept (the label) and the rest replaced.
_PATTERNS = [
    re.compile(r"\bx(?:ox[abeoprs]|app)-[A-Za-z0-9-]{6,}"),  # Slack bot/user/app tokens
    re.compile(r"(\bBearer\s+)[^\s\"',;]+", re.IGNORECASE),
    re.compile(r"\bv0=[0-9a-f]{16,}"),  # Slack request signatures
    # A name that says secret anywhere in it: AWS_SECRET_ACCESS_KEY=, MY_CREDS=, X-Token:.
    re.compile(
        r"""((?:\b|_)(?:token|signature|password|passwd|(?:secret|api[_-]?key|cred"""
        r"""|access[_-]?key|private[_-]?key)[A-Za-z0-9_]*)["']?\s*[=:]\s*["']?)[^\s"',;&}]+""",
        re.IGNORECASE,
    ),
    # A spec's env, whatever the names in it: env.NAME=value, and an env mapping as JSON
    # or a repr prints it (its values flat, as the spec keeps them).
    re.compile(r"""(\benv\.[A-Za-z_][A-Za-z0-9_]*["']?\s*=\s*["']?)[^\s"',;&}…]+""", re.I),
    re.compile(r"""(["']env["']\s*:\s*)\{[^{}]*\}"""),
    re.compile(r"(://[^/\s:@]+:)[^/\s@]+(?=@)"),  # user:password@ in URLs
]
#: Values shorter than this are not redacted by value (they would match everywhere).
_MIN_SECRET_LEN = 8


@contextmanager
def log_context(**ids: str | None) -> Iterator[None]:
    """Within the block, records carry these ids (``run_id``, ``attempt_id``); None is
    left out, and inner blocks add to (or override) outer ones."""
    current = _CONTEXT.get()
    token = _CONTEXT.set({**current, **{k: v for k, v in ids.items() if v}})
    try:
        yield
    finally:
        _CONTEXT.reset(token)


def secret_values(settings: Settings) -> list[str]:
    """The values of the settings' ``SecretStr`` fields that are set: every secret the
    process was given, whatever new ones the settings grow."""
    values = []
    for name in type(settings).model_fields:
        value = getattr(settings, name)
        if isinstance(value, SecretStr) and value.get_secret_value():
            values.append(value.get_secret_value())
    return values


class RedactSecrets(logging.Filter):
    """Rewrites each record's message and traceback with secrets replaced; keeps all."""

    def __init__(self, values: Iterable[str] = ()) -> None:
        super().__init__()
        self._values: list[str] = []
        self.add_values(values)

    def add_values(self, values: Iterable[str]) -> None:
        """Also redact these exact values (longest first, so none is left half-shown)."""
        found = {v for v in values if v and len(v) >= _MIN_SECRET_LEN} | set(self._values)
        self._values = sorted(found, key=len, reverse=True)

    def redact(self, text: str) -> str:
        for value in self._values:
            if value in text:
                text = text.replace(value, REDACTED)
        for pattern in _PATTERNS:
            text = pattern.sub(_keep_label, text)
        return text

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a bad format string: logging reports it; show the raw parts
            message = f"{record.msg} {record.args}"
        redacted = self.redact(message)
        if redacted != message or record.args:
            record.msg, record.args = redacted, None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = self.redact(record.exc_text)
        if record.stack_info:
            record.stack_info = self.redact(record.stack_info)
        return True


def bare_traceback(exc: BaseException) -> str:
    """Where ``exc`` (and what caused it) was raised, with every exception's type and none
    of their messages: for a failure whose messages may quote what a person typed (a
    database error lists the values of the row it could not write)."""
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and all(current is not seen for seen in chain):
        chain.append(current)
        cause = current.__cause__
        current = (
            cause if cause is not None or current.__suppress_context__ else current.__context__
        )
    parts = []
    for each in reversed(chain):
        frames = "".join(traceback.format_list(traceback.extract_tb(each.__traceback__)))
        kind = type(each)
        parts.append(
            f"Traceback (most recent call last):\n{frames}{kind.__module__}.{kind.__qualname__}"
        )
    return "\n".join(parts) + " (messages not logged: they can quote the command's values)"


def _keep_label(match: re.Match[str]) -> str:
    return (match.group(1) if match.re.groups else "") + REDACTED


class ContextFilter(logging.Filter):
    """Puts the context's run and attempt ids on each record (``extra=`` ones win)."""

    def filter(self, record: logging.LogRecord) -> bool:
        context = _CONTEXT.get()
        shown = []
        for key in CONTEXT_KEYS:
            value = getattr(record, key, None) or context.get(key)
            setattr(record, key, value)
            if value:
                shown.append(value)
        record.context = f" [{' '.join(shown)}]" if shown else ""
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key in CONTEXT_KEYS:
            value = getattr(record, key, None)
            if value:
                entry[key] = value
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            entry["exception"] = record.exc_text
        if record.stack_info:
            entry["stack"] = record.stack_info
        return json.dumps(entry, ensure_ascii=False, default=str)


def make_handler(
    fmt: LogFormat, *, stream: IO[str] | None = None, secrets: Iterable[str] = ()
) -> logging.Handler:
    """A stream handler in ``fmt`` that adds the context ids and redacts secrets."""
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    handler.addFilter(RedactSecrets(secrets))
    handler.addFilter(ContextFilter())
    return handler


def configure_logging(
    fmt: LogFormat | None = None,
    *,
    level: int | str = logging.WARNING,
    secrets: Iterable[str] = (),
    stream: IO[str] | None = None,
    force: bool = False,
) -> logging.Handler | None:
    """Send the process's logs to ``stream`` (stderr) in ``fmt``, like ``basicConfig``.

    ``fmt`` None: text on a terminal, JSON otherwise. Like ``basicConfig``, nothing is
    changed when the root logger already has handlers (an embedding program's, or a
    test runner's), unless ``force``. Returns the handler installed, or None.
    """
    root = logging.getLogger()
    if root.handlers and not force:
        return None
    out = stream if stream is not None else sys.stderr
    if fmt is None:
        fmt = "text" if _is_terminal(out) else "json"
    for old in list(root.handlers):
        root.removeHandler(old)
        old.close()
    handler = make_handler(fmt, stream=out, secrets=secrets)
    root.addHandler(handler)
    root.setLevel(level)
    return handler


def announce(message: str, *, to: IO[str] | None = None, **fields: object) -> None:
    """Say one thing on stdout (the start-up banner, the migration's result): a JSON
    record like the logs' (``time``, ``level``, ``logger``, ``message``, then ``fields``)
    where the process logs JSON, else the plain ``message``. Printed whatever the log
    level, as a command's own output is."""
    out = to if to is not None else sys.stdout
    json_logs = any(
        isinstance(handler.formatter, JsonFormatter) for handler in logging.getLogger().handlers
    )
    if json_logs:
        entry: dict[str, object] = {
            "time": datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
            "level": "info",
            "logger": "trainbot",
            "message": message,
            **fields,
        }
        out.write(json.dumps(entry, ensure_ascii=False, default=str) + "\n")
    else:
        out.write(message + "\n")
    out.flush()


def _is_terminal(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


#: ``TRAINBOT_LOG_LEVEL``'s values, any case; ``warn`` and ``fatal`` are read as their
#: long names.
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
_LEVEL_ALIASES = {"warn": "warning", "fatal": "critical"}


def level_name(raw: str) -> str | None:
    level = raw.strip().lower()
    level = _LEVEL_ALIASES.get(level, level)
    return level if level in LOG_LEVELS else None


def parse_log_level(raw: str | None) -> int:
    """``TRAINBOT_LOG_LEVEL``'s value as a :mod:`logging` level (unset: WARNING), read
    before the other settings, since logging starts first. Raises :class:`SettingsError`,
    one line, for a value that is not a level."""
    if not raw:
        return logging.WARNING
    level = level_name(raw)
    if level is None:
        raise SettingsError(
            f"bad setting: TRAINBOT_LOG_LEVEL={raw!r}: expected one of "
            f"{', '.join(LOG_LEVELS)} (any case)"
        )
    return int(logging.getLevelName(level.upper()))
