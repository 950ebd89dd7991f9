"""Process settings, from ``TRAINBOT_*`` environment variables.

Every setting has a default that gives the embedded setup: SQLite and checkpoints under
the state directory, the local spot provider, the console notifier, the ingest API on
127.0.0.1:8787. A laptop needs no variables at all; production sets the database URL,
the provider, an object store and the Slack secrets.

The state directory defaults to ``~/.trainbot`` rather than ``./.trainbot`` so that
``trainbot shell`` and ``trainbot serve`` started from different directories see the
same runs. Set ``TRAINBOT_STATE_DIR`` to keep a project's state apart.

Settings are validated once, at start (:func:`load_settings`); a bad value stops the
process with a :class:`~jobs.domain.errors.SettingsError` naming each variable and its fix.

Secret settings (the ``SecretStr`` fields, the database URL and password) may also come
from files, as Kubernetes and compose mount them: ``TRAINBOT_X_FILE=/path``, or a
directory of them, ``TRAINBOT_SECRETS_DIR`` (:mod:`jobs.process.secret_files`).
"""

from __future__ import annotations

import json
import os
import re
import typing
import zoneinfo
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import time
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from jobs.domain.errors import SettingsError, describe_validation_error
from jobs.process.logs import LOG_LEVELS, level_name
from jobs.process.secret_files import read_secret_files
from jobs.providers import PROVIDERS, known_names, registration
from runner.env import DEFAULT_TERMINATION_WINDOW_S

__all__ = [
    "ENV_PREFIX",
    "SHIPPED_SPECS_DIR",
    "Settings",
    "env_name",
    "load_settings",
]

#: Every variable this module reads starts with this.
ENV_PREFIX = "TRAINBOT_"

#: Seconds the scheduler lease lasts unless renewed (``TRAINBOT_SCHEDULER_LEASE_S``).
SCHEDULER_LEASE_S = 30.0

#: The example specs that ship inside the package (``tiny``, ``diverge``).
SHIPPED_SPECS_DIR = Path(__file__).resolve().parents[1] / "specs"

_HHMM = re.compile(r"^([01]?\d|2[0-3]):([0-5]\d)$")
_LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
_ANY_HOSTS = ("0.0.0.0", "::", "")

CommaList = Annotated[list[str], NoDecode]

# Set while load_settings() builds a Settings from a mapping it has already read, so the
# model does not read os.environ a second time behind the mapping's back.
_FROM_MAPPING: ContextVar[bool] = ContextVar("_FROM_MAPPING", default=False)


def env_name(field: str) -> str:
    """The environment variable that sets a :class:`Settings` field."""
    return f"{ENV_PREFIX}{field.upper()}"


def _default_cores() -> int:
    return os.cpu_count() or 1


class Settings(BaseSettings):
    """Everything the control plane process needs to know before it starts."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_ignore_empty=True,
        extra="ignore",
        validate_default=True,
    )

    #: Where the embedded database, local checkpoints and spools live.
    state_dir: Path = Path("~/.trainbot")
    #: SQLAlchemy URL. Empty means ``sqlite:///{state_dir}/trainbot.db``.
    database_url: str = ""
    #: The PostgreSQL password, apart from the URL (``TRAINBOT_DATABASE_PASSWORD_FILE`` from
    #: a mounted secret); put into the URL at load. Unset: the URL's own, if any.
    database_password: SecretStr | None = None
    #: The default provider: it launches a spec that names no ``resources.cloud``.
    provider: str = "local"
    #: Every provider this control plane configures (``local,aws,gcp``); a spec's
    #: ``resources.cloud`` picks one of them. The default ``provider`` is always one.
    providers: CommaList = Field(default_factory=list)
    #: Root URI for checkpoints when a spec names none. Empty means ``{state_dir}/checkpoints``.
    checkpoint_uri: str = ""
    #: Directory of job specs (``<name>.yaml``). Defaults to the examples shipped in the package.
    specs_dir: Path = SHIPPED_SPECS_DIR
    #: Where specs are read from, in order, instead of ``specs_dir``: directories
    #: (``/etc/trainbot/specs``) and git repositories fetched at every launch
    #: (``git+https://host/specs.git#branch=main&path=specs``), each ``[label=]location``,
    #: comma-separated. The first source holding a name wins; ``label/name`` picks one.
    #: See jobs/spec/sources.py.
    spec_sources: CommaList = Field(default_factory=list)
    #: Seconds a spec repository's fetch may take before the launch is refused.
    spec_git_timeout_s: float = Field(default=30.0, gt=0, le=600)
    #: Where alerts and run updates are posted.
    notifier: Literal["console", "slack"] = "console"
    #: Address the HTTP server (Slack endpoints, runner ingest API) listens on.
    ingest_host: str = "127.0.0.1"
    #: Port of the HTTP server; 0 picks a free one (tests).
    ingest_port: int = Field(default=8787, ge=0, le=65535)
    #: Base URL runners use to reach the ingest API. Empty means derived from host and port.
    public_url: str = ""
    #: Address of the admin listener (``/healthz``, ``/readyz``, ``/metrics``): loopback by
    #: default; the pod's own address (``0.0.0.0`` in a pod) for kubelet probes and scrapes.
    admin_host: str = "127.0.0.1"
    #: Port of the admin listener; 0 picks a free one (tests). Never the public port.
    #: Unset: the public port + 1 (8788), or 0 when the public port is 0.
    admin_port: int | None = Field(default=None, ge=0, le=65535)
    #: Seconds a request's head and body may take to arrive on the public port.
    request_deadline_s: float = Field(default=20.0, ge=1.0, le=600.0)
    #: Connections at once from one client address on the public port; 0: no cap (set 0
    #: behind a proxy or load balancer that hides the clients' addresses).
    max_connections_per_client: int = Field(default=256, ge=0)
    #: Slack app credentials; required when the notifier is Slack.
    slack_signing_secret: SecretStr | None = None
    slack_bot_token: SecretStr | None = None
    slack_app_token: SecretStr | None = None
    #: The Slack Web API's base URL: Slack's own, GovSlack's (``https://slack-gov.com/api/``),
    #: or a local fake (tests, benchmarks).
    slack_api_url: str = "https://slack.com/api/"
    #: Channels (ids or names) where commands are accepted; empty means every channel.
    allowed_channels: CommaList = Field(default_factory=list)
    #: Slack user ids or groups who may launch; empty means everyone in an allowed channel
    #: (refused at start with the Slack app and the local provider, which runs commands
    #: on this machine).
    launchers: CommaList = Field(default_factory=list)
    #: Slack user ids who may stop anyone's run and change team budgets.
    admins: CommaList = Field(default_factory=list)
    #: Workspace ids (``T…``) whose members count as the team. Empty means the bot's own
    #: workspace (asked of Slack with ``auth.test`` at start).
    slack_team_ids: CommaList = Field(default_factory=list)
    #: Whether people from other organisations in a shared (Slack Connect) channel may
    #: use trainbot. Off: they are refused, and audited.
    allow_external_users: bool = False
    #: Where a spec's ``checkpoint.uri`` may point: URIs of roots the admin set up. Empty
    #: means ``checkpoint_uri`` alone. A run's own directory under the root is always
    #: its id, chosen by trainbot.
    checkpoint_locations: CommaList = Field(default_factory=list)
    #: Staging buckets, one per region, where a dataset in another region is copied for
    #: a run (``region=URI`` pairs: ``us-west-2=s3://team-stage-usw2,europe-west4=gs://…``).
    #: A region without one is offered no copy.
    staging_buckets: CommaList = Field(default_factory=list)
    #: Days a staged copy is kept after the last run that used it finished (or after the
    #: copy finished, if none has); the scheduled cleanup deletes it then.
    staging_keep_days: float = Field(default=7.0, gt=0)
    #: Bytes per part of an S3 multipart staging copy (5 MiB to 5 GiB).
    staging_part_bytes: int = Field(default=64 * 2**20, ge=5 * 2**20, le=5 * 2**30)
    #: AWS provider: the role runners assume, through the control plane, for their own
    #: run's checkpoint prefix only (a session policy narrows it). Unset: the instance
    #: profile's own permissions are used.
    aws_runner_storage_role_arn: str | None = None
    #: Local provider: seconds between the preemption notice (SIGTERM) and the kill, like
    #: GCP's 30 s window.
    local_termination_window_s: float = Field(default=DEFAULT_TERMINATION_WINDOW_S, gt=0)
    #: Local provider: the pretend spot price, so the demo shows spend.
    local_price_per_hour_usd: float = Field(default=1.0, ge=0)
    #: Local provider: mean seconds between simulated preemptions; unset means none.
    local_mean_time_between_preemptions_s: float | None = Field(default=None, gt=0)
    #: AWS provider: region, instance profile for the runner, networking and image.
    aws_region: str | None = None
    aws_instance_profile: str | None = None
    #: ``us-east-1a=subnet-1,us-east-1b=subnet-2``
    aws_subnet_ids: str | None = None
    #: ``sg-1,sg-2``
    aws_security_group_ids: str | None = None
    aws_image_id: str | None = None
    #: An S3/EC2-compatible endpoint (tests, LocalStack); unset means AWS.
    aws_endpoint_url: str | None = None
    #: Other regions runs may fail over to (``us-west-2,eu-west-1``: the regions the specs'
    #: ``resources.regions`` list): ``list_instances`` looks there from the start, so a
    #: restarted control plane finds orphans in them.
    aws_regions: CommaList = Field(default_factory=list)
    #: AWS provider: who each run's AWS Budget notifies at its thresholds, email addresses
    #: (``a@x.io,b@x.io``) and/or an SNS topic ARN; with neither, AWS notifies nobody.
    aws_budget_emails: CommaList = Field(default_factory=list)
    aws_budget_sns_topic_arn: str | None = None
    #: Days a run's cloud budget is kept after the run ends (its last costs arrive late in
    #: the billing data); 0 removes it when the run ends.
    cloud_budget_keep_days: float = Field(default=0.0, ge=0)
    #: The longest a spec's ``debug.keep_failed_instance`` keeps a failed attempt's
    #: instance running (seconds); a longer ask is cut to it, 0 turns the option off.
    keep_failed_instance_max_s: float = Field(default=4 * 3600.0, ge=0)
    #: GCP provider: project, region, zones, the runner's service account.
    gcp_project: str | None = None
    gcp_region: str | None = None
    gcp_zones: CommaList = Field(default_factory=list)
    #: Other regions runs may fail over to (``us-east1,europe-west4``: the regions the
    #: specs' ``resources.regions`` list); a multi- or dual-region data bucket that covers
    #: one of them, and not ``gcp_region``, counts as being there.
    gcp_regions: CommaList = Field(default_factory=list)
    gcp_service_account: str | None = None
    #: GCP provider: the service account whose bucket-wide checkpoint access the control
    #: plane impersonates and downscopes to each run's own prefix (a Credential Access
    #: Boundary) for its runner. Unset: runners use their instance's service account.
    gcp_runner_storage_service_account: str | None = None
    #: A Compute API endpoint (tests); unset means Google's.
    gcp_api_endpoint: str | None = None
    #: Mean seconds between preemptions to plan checkpoints for (Daly's interval); unset
    #: means the provider's own figure (6 h for spot capacity).
    assumed_mtbp_s: float | None = Field(default=None, gt=0)
    #: Local provider: CPU cores its instances may use together.
    local_cores: int = Field(default_factory=_default_cores, ge=1)
    #: Local provider: how much lower than the control plane's CPU priority its instances
    #: run (as ``nice -n``), so a training run on the same machine never slows Slack's
    #: answers; 0 runs them at the control plane's own priority.
    local_nice: int = Field(default=10, ge=0, le=19)
    #: IANA time zone for the daily digest and "yesterday".
    timezone: str = "UTC"
    #: Local time of day the spend digest is posted.
    digest_time: time = time(9, 0)
    #: An instance silent this long is terminated, so nothing bills forever.
    heartbeat_deadline_s: float = Field(default=900.0, gt=0)
    #: An unacknowledged critical alert pages the on-call group after this long.
    escalation_delay_s: float = Field(default=900.0, gt=0)
    #: The second escalation level, paged when the on-call has not acknowledged within
    #: ``escalation_repeat_s`` of their page: a Slack user group or user (``@ml-leads``,
    #: ``S0LEADS``, ``U0ADA``). Unset: the on-call is paged again instead.
    escalation_level2: str | None = None
    #: Seconds between escalation pages after the first: the next level, then repeats.
    escalation_repeat_s: float = Field(default=900.0, gt=0)
    #: Pages at the last level after the first one there; 0 pages each level once.
    escalation_max_repeats: int = Field(default=3, ge=0)
    #: Seconds the scheduler lease lasts unless renewed (every third of it): a leader
    #: that dies is replaced within about this long, and each replica writes the lease
    #: row that often. Every replica should use the same value.
    scheduler_lease_s: float = Field(default=SCHEDULER_LEASE_S, ge=1.0, le=3600.0)
    #: PagerDuty Events API v2 integration key. Set: a critical alert that escalates
    #: triggers a PagerDuty incident, and acknowledging or resolving it in chat
    #: acknowledges or resolves the incident.
    pagerduty_routing_key: SecretStr | None = None
    #: The secret runner tokens are derived from (at least 32 characters: ``openssl rand
    #: -hex 32``), the same on every replica that shares the database, so that any
    #: replica can relaunch another's attempt with the token whose hash is stored. Unset:
    #: a secret made once in the state directory, for one process.
    runner_token_secret: SecretStr | None = Field(default=None, min_length=32)
    #: PagerDuty Events API base URL (tests); unset means PagerDuty's.
    pagerduty_url: str = "https://events.pagerduty.com"
    #: Cloud dry runs under way at once in one channel; one more fails its preflight
    #: with a reply that says so (each holds a cloud instance, and a waiting thread).
    dry_runs_per_channel: int = Field(default=2, ge=1, le=64)
    #: The instance types a spec may name in ``dry_run.instance_type``; unset: the
    #: provider's one-GPU and small CPU types (``jobs.preflight.cloud_dry_run``).
    dry_run_instance_types: CommaList = Field(default_factory=list)
    #: A dry run's instance may cost at most this per hour (spot, or on demand when the
    #: run asks for on-demand capacity), whichever type it gets.
    dry_run_max_usd_per_hour: float = Field(default=8.0, gt=0)
    #: Log lines: ``text``, or ``json`` (one object per line, with the run and attempt
    #: ids, for log shippers). Unset: text on a terminal, JSON otherwise (jobs.process.logs).
    log_format: Literal["text", "json"] | None = None
    #: The lowest level logged: ``debug``, ``info``, ``warning``, ``error`` or ``critical``,
    #: any case (``-v``: info).
    log_level: str = "warning"
    #: A Google service-account key file used only when it is there (an optional Secret
    #: mounted at this path); absent, Google credentials come from the pod's Workload
    #: Identity or the instance's account (Application Default Credentials).
    gcp_credentials_file: Path | None = None

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # No .env files or secret directories: the environment is the one source, so
        # what an operator sees with `env | grep TRAINBOT_` is what the process uses.
        if _FROM_MAPPING.get():
            return (init_settings,)
        return (init_settings, env_settings)

    @field_validator("log_level", mode="before")
    @classmethod
    def _known_level(cls, value: Any) -> Any:
        level = level_name(str(value))
        if level is None:
            raise ValueError(f"expected one of {', '.join(LOG_LEVELS)} (any case)")
        return level

    @field_validator("state_dir", "specs_dir", mode="after")
    @classmethod
    def _absolute_dir(cls, value: Path) -> Path:
        return value.expanduser().absolute()

    @field_validator("staging_buckets", mode="after")
    @classmethod
    def _staging_pairs(cls, value: list[str]) -> list[str]:
        for pair in value:
            region, _, uri = pair.partition("=")
            if not region.strip() or not uri.strip().startswith(("s3://", "gs://")):
                raise ValueError(
                    f"{pair!r} is not REGION=BUCKET_URI (us-west-2=s3://team-stage-usw2)"
                )
        return value

    @field_validator("spec_sources", mode="after")
    @classmethod
    def _known_spec_sources(cls, value: list[str]) -> list[str]:
        from jobs.spec.sources import parse_sources

        parse_sources(value)  # a ValueError says what is wrong and how to write it
        return value

    @field_validator(
        "allowed_channels",
        "launchers",
        "admins",
        "slack_team_ids",
        "checkpoint_locations",
        "staging_buckets",
        "gcp_zones",
        "gcp_regions",
        "aws_budget_emails",
        "aws_regions",
        "dry_run_instance_types",
        "providers",
        "spec_sources",
        mode="before",
    )
    @classmethod
    def _split_commas(cls, value: Any) -> Any:
        if isinstance(value, str) and value.strip().startswith("["):
            try:
                return json.loads(value)
            except json.JSONDecodeError:
                raise ValueError(
                    'expected a comma-separated list (C01,C02) or a JSON list (["C01", "C02"])'
                ) from None
        if isinstance(value, str):
            return [item.strip() for item in value.split(",") if item.strip()]
        return value

    @field_validator("provider", mode="after")
    @classmethod
    def _registered_provider(cls, value: str) -> str:
        return _registered([value])[0]

    @field_validator("providers", mode="after")
    @classmethod
    def _registered_providers(cls, value: list[str]) -> list[str]:
        return _registered(value)

    @field_validator("timezone")
    @classmethod
    def _known_timezone(cls, value: str) -> str:
        try:
            zoneinfo.ZoneInfo(value)
        except (zoneinfo.ZoneInfoNotFoundError, ValueError):
            raise ValueError(
                "unknown time zone: use an IANA name such as UTC or Europe/Berlin"
            ) from None
        return value

    @field_validator("digest_time", mode="before")
    @classmethod
    def _parse_hhmm(cls, value: Any) -> Any:
        if isinstance(value, time):
            return value
        match = _HHMM.match(str(value).strip())
        if match is None:
            raise ValueError("expected HH:MM in 24-hour time, e.g. 09:00")
        return time(int(match.group(1)), int(match.group(2)))

    @field_validator("public_url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        if value and not value.startswith(("http://", "https://")):
            raise ValueError("expected an http:// or https:// URL the runners can reach")
        return value.rstrip("/")

    @field_validator("slack_api_url")
    @classmethod
    def _api_url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError("expected an http:// or https:// URL such as https://slack.com/api/")
        return value.rstrip("/") + "/"  # the Slack SDK appends the method's name

    @model_validator(mode="after")
    def _derive_and_check(self) -> Settings:
        problems = []
        if not self.database_url:
            self.database_url = f"sqlite:///{self.state_dir / 'trainbot.db'}"
        if self.database_password is not None:
            problem = self._put_password_in_url(self.database_password.get_secret_value())
            if problem is not None:
                problems.append(problem)
        if not self.checkpoint_uri:
            self.checkpoint_uri = (self.state_dir / "checkpoints").as_uri()
        if self.admin_port is None:
            after = self.ingest_port + 1 if self.ingest_port < 65535 else self.ingest_port - 1
            self.admin_port = after if self.ingest_port else 0
        if not self.public_url and self.ingest_port != 0:  # port 0: known once bound
            host = "127.0.0.1" if self.ingest_host in _ANY_HOSTS else self.ingest_host
            if ":" in host:
                host = f"[{host}]"
            self.public_url = f"http://{host}:{self.ingest_port}"
        problems += self._inconsistencies()
        if problems:
            raise SettingsError(_summary(problems), problems=problems)
        return self

    def _put_password_in_url(self, password: str) -> str | None:
        """Puts ``password`` into ``database_url``; None, or why it cannot."""
        name = env_name("database_password")
        try:
            url = make_url(self.database_url)
        except ArgumentError:
            return None  # make_engine reports a malformed URL, naming the variable
        if url.get_backend_name() != "postgresql":
            return f"{name} is set but the database is not PostgreSQL; unset it"
        if url.password is not None:
            return (
                f"{name} is set and {env_name('database_url')} holds a password too: keep "
                f"one (the password setting, so that the URL holds no secret)"
            )
        self.database_url = url.set(password=password).render_as_string(hide_password=False)
        return None

    def _inconsistencies(self) -> list[str]:
        problems: list[str] = []
        if self.admin_port and self.admin_port == self.ingest_port:
            problems.append(
                f"{env_name('admin_port')}={self.admin_port} is also the public port: health "
                f"and metrics need a port of their own; pick another"
            )
        if self.notifier == "slack":
            for field in ("slack_signing_secret", "slack_bot_token"):
                if getattr(self, field) is None:
                    problems.append(
                        f"{env_name(field)} is not set: the Slack notifier needs it; copy it "
                        "from the Slack app's settings, or set TRAINBOT_NOTIFIER=console"
                    )
        if any(not registration(name).on_this_machine for name in self.configured_providers):
            if self.checkpoint_uri.startswith(("file:", "/")) or "://" not in self.checkpoint_uri:
                problems.append(
                    f"{env_name('checkpoint_uri')}={self.checkpoint_uri!r}: cloud instances "
                    f"cannot reach a local directory; set it to s3://bucket/prefix"
                )
            host = self.public_url.split("://", 1)[-1].split("/", 1)[0].rsplit(":", 1)[0]
            if host.strip("[]") in _LOOPBACK_HOSTS:
                problems.append(
                    f"{env_name('public_url')}={self.public_url!r}: cloud instances cannot "
                    f"reach a loopback address; set it to the control plane's public "
                    f"https:// URL"
                )
        return problems

    @property
    def configured_providers(self) -> tuple[str, ...]:
        """Every configured provider's name, the default first."""
        return tuple(dict.fromkeys([self.provider, *self.providers]))

    @property
    def tz(self) -> zoneinfo.ZoneInfo:
        """The digest time zone as an object (validated at load)."""
        return zoneinfo.ZoneInfo(self.timezone)


def _registered(names: list[str]) -> list[str]:
    """``names``, lower-cased, each a provider of the registry (``jobs.providers``)."""
    wanted = [name.strip().lower() for name in names]
    unknown = [name for name in wanted if name not in PROVIDERS]
    if unknown:
        got = f" (not {unknown[0]!r})" if len(wanted) > 1 else ""
        raise ValueError(f"expected one of {known_names()}{got}")
    return list(dict.fromkeys(wanted))


def _summary(problems: list[str]) -> str:
    if len(problems) == 1:
        return f"bad setting: {problems[0]}"
    lines = "\n".join(f"  - {problem}" for problem in problems)
    return f"{len(problems)} bad settings:\n{lines}"


def _is_secret(field: str) -> bool:
    return field in _file_fields()


def _file_fields() -> tuple[str, ...]:
    """The fields that may come from files: every secret, and the database URL (which may
    hold the password)."""
    secret = [
        name
        for name, info in Settings.model_fields.items()
        if info.annotation is SecretStr or SecretStr in typing.get_args(info.annotation)
    ]
    return ("database_url", *secret)


def _google_key_problem(by_upper: Mapping[str, str]) -> str | None:
    """A ``GOOGLE_APPLICATION_CREDENTIALS`` that names no file fails every Google call
    (checked where Google is used: the GCP provider, or a ``gs://`` store)."""
    path = by_upper.get("GOOGLE_APPLICATION_CREDENTIALS") or ""
    providers = ",".join(by_upper.get(env_name(f)) or "" for f in ("provider", "providers"))
    uses_google = "gcp" in providers.lower() or any(
        (by_upper.get(env_name(f)) or "").startswith("gs://")
        for f in ("checkpoint_uri", "checkpoint_locations")
    )
    if uses_google and path and not Path(path).is_file():
        return (
            f"GOOGLE_APPLICATION_CREDENTIALS={path}: no such file; unset it to use the "
            f"pod's Workload Identity or the instance's account, or set "
            f"{env_name('gcp_credentials_file')} to a key file used only when it is there"
        )
    return None


@contextmanager
def _only_init_values() -> Iterator[None]:
    token = _FROM_MAPPING.set(True)
    try:
        yield
    finally:
        _FROM_MAPPING.reset(token)


def load_settings(
    env: Mapping[str, str] | None = None, *, purpose: Literal["serve", "migrate"] = "serve"
) -> Settings:
    """Read and validate the settings from ``env`` (default: ``os.environ``).

    ``purpose="migrate"``: for ``trainbot migrate``, which posts nothing, so the notifier's
    secrets are not asked for (the migration Job mounts the database's alone).

    Variables are matched case-insensitively; empty ones count as unset; unknown
    ``TRAINBOT_*`` variables are ignored (the runner and the tests use a few of their
    own). Raises :class:`SettingsError` listing every bad variable by its name.
    """
    source = os.environ if env is None else env
    by_upper = {key.upper(): value for key, value in source.items()}
    from_files, problems = read_secret_files(by_upper, [env_name(f) for f in _file_fields()])
    by_upper.update(from_files)
    google = _google_key_problem(by_upper)
    if google is not None:
        problems.append(google)
    values: dict[str, Any] = {}
    for field in Settings.model_fields:
        raw = by_upper.get(env_name(field))
        if raw is not None and raw != "":
            values[field] = raw
    if purpose == "migrate":
        values.pop("notifier", None)
    try:
        with _only_init_values():
            settings = Settings(**values)
    except SettingsError as exc:
        problems += exc.problems
        raise SettingsError(_summary(problems), problems=problems) from None
    except ValidationError as exc:
        for error in exc.errors():
            field = str(error["loc"][0]) if error["loc"] else ""
            shown = "<hidden>" if _is_secret(field) else repr(values.get(field))
            problems.append(
                f"{env_name(field)}={shown}: {describe_validation_error(error, with_value=False)}"
            )
        raise SettingsError(_summary(problems), problems=problems) from None
    if problems:
        raise SettingsError(_summary(problems), problems=problems)
    return settings
