"""The GCP checkpoint-token broker: ``POST /v1/credentials`` over real HTTP into the real
app, with Google's two token endpoints faked at the network edge.

google-auth's ``downscoped.Credentials`` builds its STS URL from a private pattern, so the
broker calls google-auth's token-exchange client (``google.oauth2.sts.Client``) with the
endpoint as a parameter, and impersonates through google-auth's
``impersonated_credentials`` with ``iam_endpoint_override``. :class:`FakeGoogle` speaks
both documented protocols: the STS token exchange (form-encoded, ``options`` the
URL-encoded JSON access boundary) and IAM Credentials ``generateAccessToken``. No fake
evaluates a boundary, as Google does, so :func:`boundary_allows` judges the boundary STS
actually received, parsing its CEL condition.
"""

from __future__ import annotations

import functools
import json
import re
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest
import yaml
from google.auth.credentials import AnonymousCredentials
from sqlalchemy import Engine

from jobs.domain.errors import NotFound, PermissionDenied
from jobs.process.bootstrap import build_credential_broker
from jobs.process.settings import Settings
from jobs.providers.gcp import GcpProvider
from jobs.providers.gcp.credentials import (
    AVAILABLE_PERMISSIONS,
    TOKEN_KIND,
    StorageTokenBroker,
    gcs_scope,
)
from runner.store import gcs as gcs_store
from tests.fakes.loopback import LoopbackServer, QuietHandler, read_body, reply_json
from tests.jobs.broker_contract import (
    TOKEN,
    Plane,
    assert_store_credentials,
    assert_tokens_refused,
)
from tests.jobs.rows import add_running_attempt, migrated_sqlite
from tests.paths import ROOT

BUCKET = "ckpt-bucket"
STORAGE_SA = "trainbot-runner-storage@trainbot-test.iam.gserviceaccount.com"
#: The control plane's own (source) token, as application-default credentials give it.
CONTROL_PLANE_TOKEN = "ya29.control-plane"
STS_GRANT = "urn:ietf:params:oauth:grant-type:token-exchange"
ACCESS_TOKEN_TYPE = "urn:ietf:params:oauth:token-type:access_token"


# -- Google's token endpoints, faked at the network edge ------------------------------------


@dataclass
class FakeGoogle:
    """``POST /v1/token`` (STS) and ``POST /v1/projects/-/serviceAccounts/SA:
    generateAccessToken`` (IAM Credentials), with what each received."""

    url: str = ""
    #: Service account minted for -> the caller's Authorization header, per call.
    minted: list[tuple[str, str | None]] = field(default_factory=list)
    #: The tokens IAM issued; how long each lives.
    sa_tokens: list[str] = field(default_factory=list)
    sa_lifetime: timedelta = timedelta(hours=1)
    #: Each exchange: the form fields, with ``options`` decoded to JSON.
    exchanges: list[dict[str, Any]] = field(default_factory=list)
    issued: list[str] = field(default_factory=list)
    refuse_exchange: bool = False
    refuse_mint: bool = False

    def subject_tokens(self) -> set[str]:
        return {CONTROL_PLANE_TOKEN, *self.sa_tokens}


def _handler(google: FakeGoogle) -> type[BaseHTTPRequestHandler]:
    class Handler(QuietHandler):
        def do_POST(self) -> None:
            body = read_body(self)
            minting = re.fullmatch(
                r"/v1/projects/-/serviceAccounts/(.+):generateAccessToken", self.path
            )
            if self.path == "/v1/token":
                return self._exchange(body)
            if minting:
                return self._mint(urllib.parse.unquote(minting.group(1)), body)
            return self._answer(404, {"error": {"code": 404, "message": self.path}})

        def _exchange(self, body: bytes) -> None:
            assert self.headers["Content-Type"] == "application/x-www-form-urlencoded"
            form = {k: v[0] for k, v in urllib.parse.parse_qs(body.decode()).items()}
            # ``options`` is itself URL-encoded JSON inside the form (google-auth and the
            # STS reference both say so).
            form["options"] = json.loads(urllib.parse.unquote(form["options"]))
            google.exchanges.append(form)
            if google.refuse_exchange:
                return self._answer(
                    400, {"error": "invalid_request", "error_description": "boundary refused"}
                )
            if (
                form.get("grant_type") != STS_GRANT
                or form.get("subject_token_type") != ACCESS_TOKEN_TYPE
                or form.get("requested_token_type") != ACCESS_TOKEN_TYPE
                or form.get("subject_token") not in google.subject_tokens()
            ):
                return self._answer(
                    400, {"error": "invalid_grant", "error_description": "bad subject token"}
                )
            token = f"ya29.downscoped-{len(google.issued) + 1}"
            google.issued.append(token)
            return self._answer(
                200,
                {
                    "access_token": token,
                    "issued_token_type": ACCESS_TOKEN_TYPE,
                    "token_type": "Bearer",
                    "expires_in": 3599,
                },
            )

        def _mint(self, account: str, body: bytes) -> None:
            google.minted.append((account, self.headers.get("Authorization")))
            request = json.loads(body)
            assert request["lifetime"] == "3600s" and request["scope"]
            if google.refuse_mint or self.headers.get("Authorization") != (
                f"Bearer {CONTROL_PLANE_TOKEN}"
            ):
                return self._answer(
                    403,
                    {
                        "error": {
                            "code": 403,
                            "message": "Permission 'iam.serviceAccounts.getAccessToken' denied",
                        }
                    },
                )
            token = f"ya29.storage-sa-{len(google.sa_tokens) + 1}"
            google.sa_tokens.append(token)
            expires = datetime.now(timezone.utc) + google.sa_lifetime
            return self._answer(
                200, {"accessToken": token, "expireTime": expires.strftime("%Y-%m-%dT%H:%M:%SZ")}
            )

        def _answer(self, status: int, body: dict[str, Any]) -> None:
            reply_json(self, status, body)

    return Handler


@pytest.fixture
def google() -> Iterator[FakeGoogle]:
    fake = FakeGoogle()
    with LoopbackServer(_handler(fake)) as server:
        fake.url = server.url
        yield fake


def control_plane_credentials() -> Any:
    """What application-default credentials are on the control plane: a bearer token."""
    from google.oauth2.credentials import Credentials

    return Credentials(token=CONTROL_PLANE_TOKEN)


def make_broker(google: FakeGoogle, *, service_account: str | None = STORAGE_SA) -> Any:
    return StorageTokenBroker(
        service_account=service_account,
        source_credentials=control_plane_credentials(),
        sts_endpoint=f"{google.url}/v1/token",
        iam_endpoint_override=(
            f"{google.url}/v1/projects/-/serviceAccounts/{service_account}:generateAccessToken"
        ),
    )


# -- a tiny evaluator of the boundary's CEL condition --------------------------------------------


_CEL_TOKEN = re.compile(r"\s*(\|\||'(?:[^'\\]|\\.)*'|[A-Za-z_][A-Za-z_0-9]*|[().,])")
_LIST_PREFIX = "storage.googleapis.com/objectListPrefix"


def _tokens(expression: str) -> list[str]:
    out, pos = [], 0
    while pos < len(expression.rstrip()):
        found = _CEL_TOKEN.match(expression, pos)
        assert found, f"unexpected CEL at {expression[pos:]!r}"
        out.append(found.group(1))
        pos = found.end()
    return out


def cel_allows(expression: str, *, resource_name: str, list_prefix: str | None) -> bool:
    """Evaluate the subset of CEL a boundary condition uses here: ``||`` of
    ``resource.name.startsWith('…')`` and ``api.getAttribute('…', '…').startsWith('…')``.
    Anything else fails the test, so a condition that grew some other clause is noticed."""
    tokens = _tokens(expression)

    def take(*expected: str) -> str:
        token = tokens.pop(0)
        assert not expected or token in expected, (token, expected)
        return token

    def literal() -> str:
        token = take()
        assert token.startswith("'") and "\\" not in token, token
        return token[1:-1]

    def term() -> bool:
        if take("resource", "api") == "resource":
            take(".")
            take("name")
            subject = resource_name
        else:
            take(".")
            take("getAttribute")
            take("(")
            name = literal()
            take(",")
            default = literal()
            take(")")
            assert name == _LIST_PREFIX, name
            subject = list_prefix if list_prefix is not None else default
        take(".")
        take("startsWith")
        take("(")
        prefix = literal()
        take(")")
        return subject.startswith(prefix)

    result = term()
    while tokens:
        take("||")
        result = term() or result
    return result


def boundary_allows(
    options: dict[str, Any], resource_name: str, *, list_prefix: str | None = None
) -> bool:
    """Whether the access boundary STS received allows a Cloud Storage request on
    ``resource_name`` (``projects/_/buckets/B`` for a listing, ``…/objects/O`` otherwise)."""
    rules = options["accessBoundary"]["accessBoundaryRules"]
    for rule in rules:
        bucket = rule["availableResource"].removeprefix("//storage.googleapis.com/")
        if resource_name != bucket and not resource_name.startswith(bucket + "/objects/"):
            continue
        assert rule["availablePermissions"] == list(AVAILABLE_PERMISSIONS)
        condition = rule.get("availabilityCondition")
        if condition is None or cel_allows(
            condition["expression"], resource_name=resource_name, list_prefix=list_prefix
        ):
            return True
    return False


def test_the_matcher_itself_reads_the_clauses_it_is_given() -> None:
    expression = "resource.name.startsWith('a/') || api.getAttribute('%s', '').startsWith('b/')"
    expression %= _LIST_PREFIX
    assert cel_allows(expression, resource_name="a/x", list_prefix=None)
    assert cel_allows(expression, resource_name="z", list_prefix="b/x")
    assert not cel_allows(expression, resource_name="z", list_prefix=None)
    with pytest.raises(AssertionError):
        cel_allows("true || resource.name.startsWith('a')", resource_name="a", list_prefix=None)


# -- the control plane ----------------------------------------------------------------------


#: A run with one running attempt whose token is TOKEN (pass token=None: revoked).
add_attempt = functools.partial(
    add_running_attempt, provider="gcp", token=TOKEN, checkpoint_uri=f"gs://{BUCKET}/ckpt"
)


engine = pytest.fixture(migrated_sqlite, name="engine")


@pytest.fixture
def plane(engine: Engine, google: FakeGoogle) -> Iterator[Plane]:
    served = Plane(engine, make_broker(google))
    yield served
    served.server.shutdown()


def _objects(path: str) -> str:
    return f"projects/_/buckets/{BUCKET}/objects/{path}"


# -- tests ------------------------------------------------------------------------------------


def test_a_live_attempt_gets_a_token_downscoped_to_its_own_prefix(
    engine: Engine, plane: Plane, google: FakeGoogle
) -> None:
    add_attempt(engine)
    add_attempt(engine, run_id="r-10", attempt_id="a-10", token="tok-10")

    status, body, headers = plane.credentials()

    assert status == 200, body
    assert set(body) == {"Version", "Kind", "AccessToken", "Expiration"}
    assert body["Version"] == 1 and body["Kind"] == TOKEN_KIND == "gcp-access-token"
    assert body["AccessToken"] == google.issued[-1]
    assert headers["Cache-Control"] == "no-store"
    expires = datetime.fromisoformat(body["Expiration"])
    assert timedelta(minutes=55) < expires - datetime.now(timezone.utc) <= timedelta(hours=1)
    # The control plane impersonated the storage account with its own token, and
    # exchanged that account's token (not its own) at STS.
    assert google.minted == [(STORAGE_SA, f"Bearer {CONTROL_PLANE_TOKEN}")]
    [exchange] = google.exchanges
    assert exchange["subject_token"] == google.sa_tokens[0]
    # The boundary STS received names this run's prefix and nothing else.
    options = exchange["options"]
    [rule] = options["accessBoundary"]["accessBoundaryRules"]
    assert rule["availableResource"] == f"//storage.googleapis.com/projects/_/buckets/{BUCKET}"
    assert "ckpt/r-1/" in rule["availabilityCondition"]["expression"]
    for key in ("ckpt/r-1/step-0000000010/shard-00000.bin", "ckpt/r-1/manifest.json"):
        assert boundary_allows(options, _objects(key)), key
    for elsewhere in (
        "ckpt/r-10/step-0000000010/x",
        "ckpt/r-1-dry-run/x",
        "ckpt/r-2/x",
        "ckpt/r-1",
        "ckpt/x",
        "r-1/x",
        "x",
    ):
        assert not boundary_allows(options, _objects(elsewhere)), elsewhere
    assert not boundary_allows(options, "projects/_/buckets/data/objects/ckpt/r-1/x")
    bucket = f"projects/_/buckets/{BUCKET}"
    for listed in ("ckpt/r-1/", "ckpt/r-1/step-0000000010/"):
        assert boundary_allows(options, bucket, list_prefix=listed), listed
    for listed in (None, "", "ckpt/", "ckpt/r-1", "ckpt/r-10/", "ckpt/r-1-dry-run/", "r-1/"):
        assert not boundary_allows(options, bucket, list_prefix=listed), listed
    # Neither token reaches the answer's error paths or a second mint: the storage
    # account's token is reused while it has long to live.
    assert plane.credentials()[0] == 200
    assert len(google.minted) == 1 and len(google.exchanges) == 2


def test_without_a_storage_account_the_control_planes_own_token_is_downscoped(
    google: FakeGoogle,
) -> None:
    broker = make_broker(google, service_account=None)
    body = broker.issue(
        checkpoint_uri=f"gs://{BUCKET}/team/ckpt/", run_prefix="r-7", run_id="r-7", attempt_id="a"
    )
    assert body["AccessToken"] == google.issued[-1]
    assert google.minted == []
    [exchange] = google.exchanges
    assert exchange["subject_token"] == CONTROL_PLANE_TOKEN
    assert boundary_allows(exchange["options"], _objects("team/ckpt/r-7/x"))
    assert not boundary_allows(exchange["options"], _objects("team/ckpt/r-70/x"))


def test_the_storage_accounts_token_is_renewed_before_it_runs_short(google: FakeGoogle) -> None:
    google.sa_lifetime = timedelta(minutes=10)  # under the broker's 15-minute floor
    broker = make_broker(google)
    for _ in range(2):
        broker.issue(
            checkpoint_uri=f"gs://{BUCKET}/ckpt", run_prefix="r-1", run_id="r-1", attempt_id="a"
        )
    assert len(google.sa_tokens) == 2
    assert [e["subject_token"] for e in google.exchanges] == google.sa_tokens


def test_unknown_revoked_and_missing_tokens_get_401(
    engine: Engine, plane: Plane, google: FakeGoogle
) -> None:
    add_attempt(engine)
    assert_tokens_refused(engine, plane)
    assert len(google.exchanges) == 1  # only the live call reached Google


def test_without_a_broker_or_a_gs_store_the_answer_is_404(
    engine: Engine, google: FakeGoogle
) -> None:
    add_attempt(engine)
    add_attempt(engine, run_id="r-2", attempt_id="a-2", token="tok-2", checkpoint_uri="s3://b/c")
    add_attempt(engine, run_id="r-3", attempt_id="a-3", token="tok-3", checkpoint_uri=None)
    unconfigured = Plane(engine, None)
    configured = Plane(engine, make_broker(google))
    try:
        status, body, _ = unconfigured.credentials()
        assert status == 404 and "not configured" in body["error"]
        for token in ("tok-2", "tok-3"):
            status, body, _ = configured.credentials(token)
            assert status == 404 and "gs://" in body["error"], body
    finally:
        unconfigured.server.shutdown()
        configured.server.shutdown()
    assert google.exchanges == [] and google.minted == []


@pytest.mark.parametrize(
    ("checkpoint_uri", "run_prefix"),
    [
        (f"gs://{BUCKET}/ckpt", "r-1') || true || ('"),
        (f"gs://{BUCKET}/ckpt", "r-1\\"),
        (f"gs://{BUCKET}/ckpt", 'r-1"'),
        (f"gs://{BUCKET}/ckpt", "r 1"),
        (f"gs://{BUCKET}/ckpt", "r-1\n"),
        (f"gs://{BUCKET}/ckpt", "../r-2"),
        (f"gs://{BUCKET}/ckpt", ""),
        (f"gs://{BUCKET}/ckpt", "/"),
        (f"gs://{BUCKET}/ck'pt", "r-1"),
        (f"gs://{BUCKET}/ckpt?", "r-1"),
        (f"gs://{BUCKET}/ckpt#x", "r-1"),
        (f"gs://{BUCKET}/ckpt%27", "r-1"),
        ("gs://Bad_Bucket/ckpt", "r-1"),
        (f"gs://{BUCKET}/ckpt", "r" * 600),
    ],
)
def test_a_location_a_boundary_cannot_name_safely_is_refused(
    checkpoint_uri: str, run_prefix: str
) -> None:
    with pytest.raises(PermissionDenied, match="cannot scope"):
        gcs_scope(checkpoint_uri, run_prefix)


def test_scopes_are_normalised_and_other_stores_are_not_served() -> None:
    assert gcs_scope(f"gs://{BUCKET}//ckpt/", "/r-1/") == (BUCKET, "ckpt/r-1")
    assert gcs_scope(f"gs://{BUCKET}", "r-1") == (BUCKET, "r-1")
    for uri in ("s3://b/ckpt", "file:///ckpt", "gs:///ckpt", ""):
        with pytest.raises(NotFound):
            gcs_scope(uri, "r-1")


def test_a_prefix_that_would_break_the_condition_gets_403_over_http(
    engine: Engine, plane: Plane, google: FakeGoogle
) -> None:
    # Only trainbot writes Run.checkpoint_prefix; a row written before the rules, or by a
    # bug, still must not reach STS.
    add_attempt(engine, checkpoint_prefix="r-1') || true || ('")
    status, body, _ = plane.credentials()
    assert status == 403 and "cannot scope" in body["error"]
    assert google.exchanges == [] and google.minted == []


def test_when_google_refuses_the_runner_is_told_to_retry(
    engine: Engine, plane: Plane, google: FakeGoogle
) -> None:
    add_attempt(engine)
    google.refuse_mint = True
    status, body, headers = plane.credentials()
    assert status == 503 and headers["Retry-After"] == "5", body
    google.refuse_mint = False
    google.refuse_exchange = True
    status, body, headers = plane.credentials()
    assert status == 503 and headers["Retry-After"] == "5", body
    assert not google.issued


def test_the_broker_says_what_to_set_for_a_bad_account() -> None:
    from jobs.providers.base import ProviderError

    with pytest.raises(ProviderError, match="TRAINBOT_GCP_RUNNER_STORAGE_SERVICE_ACCOUNT"):
        StorageTokenBroker(service_account="trainbot-runner-storage")


# -- wiring and deploy/ -----------------------------------------------------------------------


def test_the_broker_is_built_and_announced_to_runners_only_on_gcp_with_the_account(
    tmp_path: Path, engine: Engine
) -> None:
    base = {"state_dir": tmp_path}
    gcp = {
        "provider": "gcp",
        "checkpoint_uri": f"gs://{BUCKET}/ckpt",
        "public_url": "https://cp.example",
    }
    assert build_credential_broker(Settings(**base, **gcp)) is None
    built = build_credential_broker(
        Settings(**base, **gcp, gcp_runner_storage_service_account=STORAGE_SA)
    )
    assert isinstance(built, StorageTokenBroker) and built.service_account == STORAGE_SA
    add_attempt(engine)
    # The attempt's own provider (its env is its provider's); built without a call to GCP.
    provider = GcpProvider(
        project="trainbot-test", region="us-central1", credentials=AnonymousCredentials()
    )
    assert_store_credentials(
        engine,
        provider,
        [
            (Settings(**base, **gcp, gcp_runner_storage_service_account=STORAGE_SA), "broker"),
            (Settings(**base, **gcp), None),
            (Settings(**base, gcp_runner_storage_service_account=STORAGE_SA), None),
        ],
    )


def test_deploy_gives_checkpoints_to_the_storage_account_and_not_the_instances() -> None:
    roles = yaml.safe_load((ROOT / "deploy" / "gcp" / "roles.yaml").read_text())["roles"]
    storage = set(roles["trainbotRunnerStorage"]["includedPermissions"])
    # The storage account holds every permission the store asks for, and nothing else.
    assert storage == set(gcs_store._PERMISSION.values())
    assert roles["trainbotMintRunnerStorageTokens"]["includedPermissions"] == [
        "iam.serviceAccounts.getAccessToken"
    ]
    readme = (ROOT / "deploy" / "gcp" / "README.md").read_text()
    commands = readme.replace("\\\n", " ")
    bucket_bindings = re.findall(
        r"buckets add-iam-policy-binding gs://\S+ (--member=\S+)", commands
    )
    # The storage account (runners, through downscoped tokens) and the control plane
    # (retention's deletes); never the instances' own account, which the code shares.
    assert bucket_bindings == ["--member=serviceAccount:$STORAGE", "--member=serviceAccount:$CP"]
    assert "--member=serviceAccount:$RUNNER" not in bucket_bindings
    mint = re.findall(r"add-iam-policy-binding (\S+) .*trainbotMintRunnerStorageTokens", commands)
    assert mint == ["$STORAGE"]
    assert "TRAINBOT_GCP_RUNNER_STORAGE_SERVICE_ACCOUNT=$STORAGE" in readme
