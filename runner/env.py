"""The runner's environment: every ``TRAINBOT_*`` variable the control plane (or the
supervisor, or a provider's boot) hands a runner, declared once.

Each :class:`Var` names its variable, its type, its default, whether the control plane
must send it, and what it means. The control plane writes an attempt's variables with
:func:`render` (typed values in, strings out); the runner reads each one with
:meth:`Var.get`, whose error names the variable and what it expects. A spec's own
``env`` is not part of this contract: it passes through untouched.

Standard library only: ``trainbot-runner exec`` imports it before torch, and the control
plane imports it too.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar
from urllib.parse import urlsplit

from runner.errors import RunnerError

__all__ = [
    "DEFAULT_TERMINATION_WINDOW_S",
    "TERMINATION_WINDOWS_S",
    "VARS",
    "EnvError",
    "Kind",
    "Var",
    "missing_required",
    "parse",
    "render",
    "termination_window_s",
]

T = TypeVar("T")
D = TypeVar("D")

#: Seconds between a provider's preemption notice and the kill that follows it, per
#: preemption source: AWS's two-minute spot notice, GCP's 30 s preemption notice.
TERMINATION_WINDOWS_S: Mapping[str, float] = {"aws": 120.0, "gcp": 30.0}
#: The window assumed when none is given (a local run, a script started by hand): the
#: shortest provider's, so that an emergency checkpoint planned for it fits any of them.
DEFAULT_TERMINATION_WINDOW_S = min(TERMINATION_WINDOWS_S.values())


class EnvError(RunnerError):
    """A ``TRAINBOT_*`` variable holds what its declaration does not accept."""


class _Refused(ValueError):
    """Raised by a kind's parser: the words after "expected" in the error."""


@dataclass(frozen=True)
class Kind(Generic[T]):
    """How one type of value is written into a variable and read back."""

    #: What a good value is, in words: the error's "expected …".
    expected: str
    #: The text → the value; raises ValueError (or _Refused with its own words).
    parse: Callable[[str], T]
    #: The value's Python type, checked when the control plane renders it.
    type: type | tuple[type, ...]
    #: The value → the text (default: ``str``).
    render: Callable[[Any], str] = str


def _positive(convert: Callable[[str], float]) -> Callable[[str], float]:
    def parse(raw: str) -> float:
        value = convert(raw)
        if not math.isfinite(value) or value <= 0:
            raise _Refused
        return value

    return parse


def _whole(low: int, high: int | None = None) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        value = int(raw)
        if value < low:
            raise _Refused(f"{low} or more")
        if high is not None and value > high:
            raise _Refused(f"{high} or less")
        return value

    return parse


def _flag(raw: str) -> bool:
    word = raw.strip().lower()
    if word in ("1", "true", "yes", "on"):
        return True
    if word in ("0", "false", "no", "off"):
        return False
    raise _Refused


def _url(raw: str) -> str:
    parts = urlsplit(raw.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise _Refused
    return raw.strip()


def _seconds_text(value: float) -> str:
    """Full precision, without a trailing ``.0``: 120.0 → "120", 0.25 → "0.25"."""
    text = repr(float(value))
    return text[:-2] if text.endswith(".0") else text


def _choice(*options: str) -> Kind[str]:
    def parse(raw: str) -> str:
        if raw.strip() not in options:
            raise _Refused
        return raw.strip()

    return Kind(" or ".join(repr(o) for o in options), parse, str)


def _words(raw: str) -> list[str]:
    value = json.loads(raw)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _Refused
    return value


def _names(raw: str) -> dict[str, str]:
    value = json.loads(raw)
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise _Refused
    return value


def _commit(raw: str) -> str:
    text = raw.strip().lower()
    if len(text) != 40 or any(c not in "0123456789abcdef" for c in text):
        raise _Refused
    return text


TEXT: Kind[str] = Kind("text", str, str)
#: A list of strings, written as JSON (shell commands, paths).
WORDS: Kind[list[str]] = Kind("a JSON list of strings", _words, list, json.dumps)
#: A mapping of strings to strings, written as JSON (secret references by variable).
NAMES: Kind[dict[str, str]] = Kind("a JSON object of strings", _names, dict, json.dumps)
COMMIT: Kind[str] = Kind("a 40-character git commit sha", _commit, str)
URL: Kind[str] = Kind("an http:// or https:// URL", _url, str)
PATH: Kind[Path] = Kind("a path", Path, (str, Path))
SECONDS: Kind[float] = Kind(
    "a positive number of seconds", _positive(float), (int, float), _seconds_text
)
RATE: Kind[float] = Kind("a positive number", _positive(float), (int, float), _seconds_text)
COUNT: Kind[int] = Kind("a whole number", _whole(1), int)
INDEX: Kind[int] = Kind("a whole number", _whole(0), int)
PORT: Kind[int] = Kind("a port number", _whole(1, 65535), int)
FLAG: Kind[bool] = Kind("1 or 0 (true or false)", _flag, bool, lambda v: "1" if v else "0")


@dataclass(frozen=True)
class Var(Generic[T, D]):
    """One variable: its name, type, default and meaning."""

    name: str
    kind: Kind[T]
    #: What an unset (or blank) variable means.
    default: D
    doc: str
    #: The control plane sends it to every attempt (:func:`missing_required`); a runner
    #: started by hand falls back to the default.
    required: bool = False
    #: A spec's ``env`` may set it (it tunes the run only); every other ``TRAINBOT_*``
    #: name is the control plane's to set (``jobs.spec.env``).
    tunable: bool = False
    #: A format for the rendered number (".3f"), where the text is rounded on purpose.
    fmt: str | None = None

    def get(self, environ: Mapping[str, str] | None = None) -> T | D:
        """The typed value in ``environ`` (default: this process's), or the default."""
        env = os.environ if environ is None else environ
        raw = env.get(self.name, "")
        if not raw.strip():
            return self.default
        try:
            return self.kind.parse(raw)
        except ValueError as exc:
            words = str(exc) if isinstance(exc, _Refused) and str(exc) else self.kind.expected
            raise EnvError(f"{self.name}={raw!r}: expected {words}") from None

    def render(self, value: T) -> str:
        """The text the runner reads back as ``value``."""
        if not isinstance(value, self.kind.type) or (
            isinstance(value, bool) and self.kind.type in (int, (int, float))
        ):
            raise EnvError(
                f"{self.name}: cannot send {value!r} ({type(value).__name__}), "
                f"expected {self.kind.expected}"
            )
        text = format(value, self.fmt) if self.fmt else self.kind.render(value)
        if self.kind.parse is not str:  # text and paths go as given
            self.get({self.name: text})  # the runner must accept what it is sent
        return text


_VARS: list[Var[Any, Any]] = []


def _var(name: str, kind: Kind[T], default: D, doc: str, **more: Any) -> Var[T, D]:
    declared = Var(name, kind, default, doc, **more)
    _VARS.append(declared)
    return declared


# --- who the runner is, and where it reports ------------------------------------------

RUN_ID = _var("TRAINBOT_RUN_ID", TEXT, "local", "the run's id", required=True)
ATTEMPT_ID = _var(
    "TRAINBOT_ATTEMPT_ID", TEXT, "local-1", "the attempt's id, on every event", required=True
)
TOKEN = _var(
    "TRAINBOT_TOKEN", TEXT, None, "the attempt's (node's) ingest token; secret", required=True
)
INGEST_URL = _var("TRAINBOT_INGEST_URL", URL, None, "the control plane's events URL")
INSTANCE_ID = _var("TRAINBOT_INSTANCE_ID", TEXT, None, "the local provider's instance id")
DRY_RUN_ID = _var("TRAINBOT_DRY_RUN_ID", TEXT, None, "a cloud dry run's id: report to it")
SPOOL_DIR = _var("TRAINBOT_SPOOL_DIR", PATH, None, "where unsent events wait")
EVENTS_FILE = _var("TRAINBOT_EVENTS_FILE", PATH, None, "the JSONL file the supervisor tails")
LOG_LEVEL = _var("TRAINBOT_LOG_LEVEL", TEXT, "WARNING", "trainbot-runner's logging level")

# --- checkpoints ----------------------------------------------------------------------

CHECKPOINT_URI = _var(
    "TRAINBOT_CHECKPOINT_URI", TEXT, "checkpoints", "the store root: a path or URI", required=True
)
CHECKPOINT_PREFIX = _var(
    "TRAINBOT_CHECKPOINT_PREFIX", TEXT, None, "the run's directory in the store (default: run id)"
)
CHECKPOINT_INTERVAL_S = _var(
    "TRAINBOT_CHECKPOINT_INTERVAL_S", SECONDS, None, "checkpoint every T seconds", fmt=".3f"
)
CHECKPOINT_AUTO_MTBP_S = _var(
    "TRAINBOT_CHECKPOINT_AUTO_MTBP_S",
    SECONDS,
    None,
    'an "auto" interval: follow the measured save cost with this MTBP',
    fmt=".3f",
)
CHECKPOINT_EVERY_STEPS = _var(
    "TRAINBOT_CHECKPOINT_EVERY_STEPS", COUNT, None, "checkpoint every N steps"
)
CHECKPOINT_DIR = _var(
    "TRAINBOT_CHECKPOINT_DIR", PATH, None, "the folder exec --sync-dir syncs to the store"
)
RESUME_MAX_STEP = _var(
    "TRAINBOT_RESUME_MAX_STEP", COUNT, None, "restore the newest checkpoint at or before it"
)
MEASURED_WRITE_BPS = _var(
    "TRAINBOT_MEASURED_WRITE_BPS", RATE, None, "the dry run's write, bytes/s", fmt=".0f"
)
MEASURED_STALL_S = _var(
    "TRAINBOT_MEASURED_STALL_S", SECONDS, None, "the dry run's save stall", fmt=".6f"
)
STORE_CREDENTIALS = _var(
    "TRAINBOT_STORE_CREDENTIALS",
    _choice("broker", "default"),
    None,
    "'broker': the store asks the control plane for short-lived credentials",
)
S3_ENDPOINT_URL = _var("TRAINBOT_S3_ENDPOINT_URL", URL, None, "an S3-compatible endpoint")

# --- preemption -----------------------------------------------------------------------

TERMINATION_WINDOW_S = _var(
    "TRAINBOT_TERMINATION_WINDOW_S",
    SECONDS,
    None,
    "notice-to-kill seconds (unset: the source's, else DEFAULT_TERMINATION_WINDOW_S)",
)
PREEMPTION_SOURCES = _var(
    "TRAINBOT_PREEMPTION_SOURCES", TEXT, "", 'notices to poll: "aws", "gcp", "none" or ""'
)
AWS_METADATA_URL = _var(
    "TRAINBOT_AWS_METADATA_URL", URL, "http://169.254.169.254", "the EC2 metadata service"
)
GCP_METADATA_URL = _var(
    "TRAINBOT_GCP_METADATA_URL", URL, "http://metadata.google.internal", "the GCE metadata server"
)
TRAIN_THROUGH_NOTICE = _var(
    "TRAINBOT_TRAIN_THROUGH_NOTICE", FLAG, False, "train on while the flush still fits"
)
NOTICE_FILE = _var("TRAINBOT_NOTICE_FILE", PATH, None, "where the supervisor relays a notice")

# --- the session and its machine ------------------------------------------------------

METRICS_EVERY = _var("TRAINBOT_METRICS_EVERY", COUNT, 1, "a metrics event every N steps")
MAX_STEPS = _var("TRAINBOT_MAX_STEPS", COUNT, None, "stop (with a checkpoint) after N steps")
STOP_FILE = _var("TRAINBOT_STOP_FILE", PATH, None, "a file whose appearance asks for a stop")
DRY_RUN_PHASE = _var(
    "TRAINBOT_DRY_RUN_PHASE", _choice("save", "verify"), None, "the dry run's phase"
)
DATA_URI = _var(
    "TRAINBOT_DATA_URI",
    TEXT,
    None,
    "the run's data (its staged copy, if any); a dry run reads a sample",
)
SCRATCH_DIR = _var("TRAINBOT_SCRATCH_DIR", PATH, None, "the instance's scratch disk")
SCRATCH_BYTES = _var("TRAINBOT_SCRATCH_BYTES", INDEX, None, "the scratch disk's declared size")
SYSTEM_SAMPLE_S = _var(
    "TRAINBOT_SYSTEM_SAMPLE_S", SECONDS, 10.0, "seconds between system samples", tunable=True
)
# A step standing still past max(factor × its median time, floor) is a hung run; the
# supervisor dumps its stacks a little before (runner.stacks; the spec's alerts.hung).
HANG_FACTOR = _var("TRAINBOT_HANG_FACTOR", RATE, 20.0, "a hung step: this many median step times")
HANG_FLOOR_S = _var("TRAINBOT_HANG_FLOOR_S", SECONDS, 600.0, "a hung step: at least this long")

# --- several processes, several nodes (runner.nodes) ----------------------------------

TORCHRUN = _var("TRAINBOT_TORCHRUN", FLAG, False, "run the command under torchrun")
NPROC_PER_NODE = _var("TRAINBOT_NPROC_PER_NODE", COUNT, 1, "processes on each node")
NNODES = _var("TRAINBOT_NNODES", COUNT, 1, "nodes in the attempt's gang")
NODE_RANK = _var("TRAINBOT_NODE_RANK", INDEX, 0, "this node's rank in its gang")
MASTER_ADDR = _var("TRAINBOT_MASTER_ADDR", TEXT, None, "node 0's address")
MASTER_PORT = _var("TRAINBOT_MASTER_PORT", PORT, 29500, "node 0's rendezvous port")

# --- the run's code and its environment (runner.code, runner.setup) ------------------

CODE_REPO = _var("TRAINBOT_CODE_REPO", TEXT, None, "the git repository the code comes from")
CODE_COMMIT = _var(
    "TRAINBOT_CODE_COMMIT", COMMIT, None, "the commit pinned at submit, checked out on every node"
)
CODE_ARCHIVE = _var(
    "TRAINBOT_CODE_ARCHIVE", TEXT, None, "a packed code archive (s3://, gs://, file://) instead"
)
CODE_DIR = _var(
    "TRAINBOT_CODE_DIR", PATH, None, "where the code goes (default: code/ on the scratch disk)"
)
GIT_SSH_KEY_FILE = _var(
    "TRAINBOT_GIT_SSH_KEY_FILE",
    PATH,
    None,
    "an admin's deploy key for private repositories (git over ssh); never sent through chat",
)
SETUP = _var("TRAINBOT_SETUP", WORDS, None, "shell commands run in the code dir before the command")
SETUP_VENV = _var(
    "TRAINBOT_SETUP_VENV", TEXT, None, "the virtualenv setup installs into (relative: in the code)"
)
SETUP_CACHE = _var(
    "TRAINBOT_SETUP_CACHE", FLAG, False, "archive what setup built and restore it next time"
)
SETUP_CACHE_PATHS = _var(
    "TRAINBOT_SETUP_CACHE_PATHS", WORDS, None, "more paths the environment archive holds"
)
SETUP_KEY_FILES = _var(
    "TRAINBOT_SETUP_KEY_FILES", WORDS, None, "more files whose contents key the archive"
)
MACHINE_IMAGE = _var(
    "TRAINBOT_MACHINE_IMAGE", TEXT, None, "the machine image, part of the environment's key"
)

# --- the command's container image (runner.container) -------------------------------

IMAGE = _var("TRAINBOT_IMAGE", TEXT, None, "the container image the command runs in")
CONTAINER_RUNTIME = _var(
    "TRAINBOT_CONTAINER_RUNTIME", TEXT, "docker", "what runs the image: docker or podman"
)
CONTAINER_GPUS = _var(
    "TRAINBOT_CONTAINER_GPUS", FLAG, False, "give the container the instance's GPUs"
)

# --- the instance's end (deploy/aws/user-data.sh, deploy/gcp/startup-script.sh) -------

KEEP_FAILED_S = _var(
    "TRAINBOT_KEEP_FAILED_S",
    COUNT,
    None,
    "seconds the boot script keeps the instance up after the runner failed"
    " (debug.keep_failed_instance); the control plane terminates it by then",
)

# --- secrets, read on the instance (runner.secrets) -----------------------------------

SECRETS = _var(
    "TRAINBOT_SECRETS",
    NAMES,
    None,
    "the spec's secrets: variable → reference (aws-sm://, gcp-sm://, local://), never a value",
)
LOCAL_SECRETS_DIR = _var(
    "TRAINBOT_LOCAL_SECRETS_DIR", PATH, None, "the admin's directory of local:// secrets"
)
AWS_SECRETS_REGION = _var(
    "TRAINBOT_AWS_SECRETS_REGION", TEXT, None, "the region of the aws-sm:// secrets"
)
GCP_SECRETS_URL = _var(
    "TRAINBOT_GCP_SECRETS_URL", URL, None, "Secret Manager's API (default: Google's)"
)

#: Every declared variable, by name.
VARS: Mapping[str, Var[Any, Any]] = {v.name: v for v in _VARS}


def render(values: Mapping[Var[Any, Any], object]) -> dict[str, str]:
    """The variables for ``values`` (a None value is not sent), checked as the runner
    will read them: a value it would refuse is refused here, naming the variable."""
    return {var.name: var.render(value) for var, value in values.items() if value is not None}


def parse(environ: Mapping[str, str]) -> dict[str, Any]:
    """Every declared variable's value in ``environ`` (its default where unset), by name:
    the first bad one raises :class:`EnvError`."""
    return {name: var.get(environ) for name, var in VARS.items()}


def termination_window_s(environ: Mapping[str, str] | None = None, *, source: str = "") -> float:
    """The termination window: :data:`TERMINATION_WINDOW_S` when set, else the window of
    the preemption ``source`` ("aws", "gcp"), else :data:`DEFAULT_TERMINATION_WINDOW_S`."""
    given: float | None = TERMINATION_WINDOW_S.get(environ)
    if given is not None:
        return given
    return TERMINATION_WINDOWS_S.get(source, DEFAULT_TERMINATION_WINDOW_S)


def missing_required(environ: Mapping[str, str]) -> list[str]:
    """The variables the control plane must send that ``environ`` lacks."""
    return [n for n, v in VARS.items() if v.required and not environ.get(n, "").strip()]
