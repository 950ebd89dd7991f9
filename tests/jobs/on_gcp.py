"""A GCP provider on the fake Compute API (:mod:`tests.fakes.gce_api`), as the control
plane's tests build one: the fake's project, us-central1, anonymous credentials and the
runner's service account."""

from __future__ import annotations

from typing import Any

from google.auth.credentials import AnonymousCredentials

from jobs.providers.gcp import GcpProvider
from tests.fakes.gce_api import FakeComputeApi

#: The service account the instances run as (the fake knows no other).
RUNNER_SA = "trainbot-runner@trainbot-test.iam.gserviceaccount.com"


def gcp_on(api: FakeComputeApi, **options: Any) -> GcpProvider:
    """A GcpProvider talking to ``api``; ``options`` add to or replace the defaults."""
    values: dict[str, Any] = {
        "project": api.project,
        "region": "us-central1",
        "api_endpoint": api.url,
        "credentials": AnonymousCredentials(),
        "service_account": RUNNER_SA,
        **options,
    }
    return GcpProvider(**values)
