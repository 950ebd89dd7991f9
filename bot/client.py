"""The command-line client of ``trainbot serve``'s commands API (:mod:`bot.api`).

``trainbot launch spec.yaml --set budget.usd=5``, ``list``, ``status``, ``logs``, ``stop``,
``resubmit``, ``ack``: each becomes the text of a ``/train`` command, posted to
``$TRAINBOT_URL/v1/commands`` with the person's token from ``/train token``, and decided
on the server exactly as in chat. Standard library only (urllib, tomllib), so it runs on
the base install, without the control plane's dependencies.

Where the server and token come from, first found wins: ``TRAINBOT_URL`` and
``TRAINBOT_TOKEN``; then ``url`` and ``token`` in ``~/.config/trainbot/client.toml``
(``$XDG_CONFIG_HOME/trainbot/client.toml``; ``TRAINBOT_CLIENT_CONFIG`` names another file).

Exit codes: 0 done; 1 refused or failed (the server's reason on stderr), or the server
cannot be reached or refuses the token; 2 a usage problem (here, or the command as the
server parsed it).
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import sys
import tomllib
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

__all__ = [
    "API_PATH",
    "Answer",
    "ClientConfig",
    "ClientError",
    "command_text",
    "load_config",
    "run",
    "send",
]

#: The commands endpoint (``bot.api.API_PATH``; repeated so this module imports nothing).
API_PATH = "/v1/commands"
#: Seconds to wait for an answer; a launch answers once the run is created.
TIMEOUT_S = 60.0
#: Exit codes.
OK, FAILED, USAGE = 0, 1, 2


class ClientError(Exception):
    """Why the client could not get an answer; ``code`` is the exit code."""

    def __init__(self, message: str, *, code: int = FAILED) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class ClientConfig:
    #: The control plane's public URL (``http://host:8787``), no trailing slash.
    url: str
    token: str


@dataclass(frozen=True)
class Answer:
    """The server's answer to one command."""

    #: ``ok``, ``invalid`` (did not parse), ``refused``, ``failed``.
    status: str
    text: str
    run_id: str | None = None
    alert_id: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def exit_code(self) -> int:
        return OK if self.ok else USAGE if self.status == "invalid" else FAILED


def config_path(environ: Mapping[str, str]) -> Path:
    named = environ.get("TRAINBOT_CLIENT_CONFIG")
    if named:
        return Path(named).expanduser()
    base = environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "trainbot" / "client.toml"


def load_config(environ: Mapping[str, str] | None = None) -> ClientConfig:
    """The server and token: the environment first, then the config file."""
    env = os.environ if environ is None else environ
    url, token = env.get("TRAINBOT_URL", "").strip(), env.get("TRAINBOT_TOKEN", "").strip()
    path = config_path(env)
    if (not url or not token) and path.is_file():
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            raise ClientError(f"cannot read {path}: {exc}", code=USAGE) from None
        url = url or str(data.get("url") or "").strip()
        token = token or str(data.get("token") or "").strip()
    missing = [
        name for name, value in (("TRAINBOT_URL", url), ("TRAINBOT_TOKEN", token)) if not value
    ]
    if missing:
        raise ClientError(
            f"{' and '.join(missing)} not set: export TRAINBOT_URL=<the control plane's URL> "
            "and TRAINBOT_TOKEN=<a token from /train token in Slack>, or put url and token "
            f"in {path}",
            code=USAGE,
        )
    if not url.startswith(("http://", "https://")):
        raise ClientError(f"TRAINBOT_URL {url!r} is not an http:// or https:// URL", code=USAGE)
    return ClientConfig(url=url.rstrip("/"), token=token)


def send(
    config: ClientConfig,
    text: str,
    *,
    spec: str | None = None,
    key: str | None = None,
    timeout: float = TIMEOUT_S,
) -> Answer:
    """Post one command; a refusal or failure is an :class:`Answer`, not an exception.
    :class:`ClientError` when no answer came: the server, the network or the token.
    ``key``: a launch is made once per key (a CI job's retry gets the first's run)."""
    body: dict[str, Any] = {"text": text}
    if spec is not None:
        body["spec"] = spec
    headers = {
        "Authorization": f"Bearer {config.token}",
        "Content-Type": "application/json",
        "Accept": "application/json",
    }
    if key:
        headers["Idempotency-Key"] = key
    request = urllib.request.Request(
        config.url + API_PATH,
        data=json.dumps(body, ensure_ascii=False).encode("utf-8"),
        method="POST",
        headers=headers,
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return _answer(response.read())
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        if exc.code == 401:
            raise ClientError(
                f"{config.url} refused the token (unknown, revoked or expired): get a new one "
                "with /train token in Slack and set TRAINBOT_TOKEN"
            ) from None
        try:
            return _answer(raw)
        except ClientError:
            raise ClientError(f"{config.url} answered HTTP {exc.code}: {_error_of(raw)}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        if isinstance(reason, socket.timeout | TimeoutError):
            why = f"no answer within {timeout:.0f} s"
        else:
            why = str(reason)
        raise ClientError(
            f"cannot reach the control plane at {config.url} ({why}): is trainbot serve "
            "running there, and is TRAINBOT_URL right?"
        ) from None


def _answer(raw: bytes) -> Answer:
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        data = None
    if not isinstance(data, dict) or "status" not in data or "text" not in data:
        raise ClientError(f"the server's answer is not a trainbot answer: {_error_of(raw)}")
    return Answer(
        status=str(data["status"]),
        text=str(data["text"]),
        run_id=data.get("run_id"),
        alert_id=data.get("alert_id"),
    )


def _error_of(raw: bytes) -> str:
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return raw[:200].decode("utf-8", "replace") or "(no body)"
    if isinstance(data, dict) and "error" in data:
        return str(data["error"])
    return str(data)[:200]


# --- commands as /train text ------------------------------------------------------------


def command_text(verb: str, args: Sequence[str]) -> str:
    """The ``/train`` text of a verb and its arguments, quoted as the server splits it."""
    return shlex.join([verb, *args])


def launch_request(spec: str, sets: Sequence[str]) -> tuple[str, str | None]:
    """``trainbot launch SPEC --set k=v``: a spec file (its text is sent, named by its
    stem) or, when no such file exists, the name of a spec in the server's specs directory."""
    path = Path(spec)
    if path.suffix in (".yaml", ".yml") or path.is_file():
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ClientError(
                f"there is no spec file at {path}: check the path", code=USAGE
            ) from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ClientError(f"cannot read the spec file {path}: {exc}", code=USAGE) from None
        return command_text("launch", [path.stem, *sets]), text
    return command_text("launch", [spec, *sets]), None


def run(
    verb: str,
    args: Sequence[str],
    *,
    sets: Sequence[str] = (),
    key: str | None = None,
    as_json: bool = False,
    environ: Mapping[str, str] | None = None,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """One client command, printed as a person reads it (or as JSON); the exit code."""
    out = out if out is not None else sys.stdout
    err = err if err is not None else sys.stderr
    try:
        config = load_config(environ)
        if verb == "launch":
            text, spec = launch_request(args[0], sets)
        else:
            text, spec = command_text(verb, args), None
        answer = send(config, text, spec=spec, key=key)
    except ClientError as exc:
        print(f"trainbot: {exc}", file=err)
        return exc.code
    if as_json:
        fields = {"ok": answer.ok, "status": answer.status, "text": answer.text}
        fields |= {"run_id": answer.run_id, "alert_id": answer.alert_id}
        print(json.dumps(fields), file=out)
    else:
        print(answer.text, file=out if answer.ok else err)
    return answer.exit_code
