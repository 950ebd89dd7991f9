"""``TRAINBOT_GCP_*`` settings the GCP provider owns (issue 24: each provider its own).

The older GCP settings (project, region, zones …) are still read by :mod:`jobs.process.settings`
and passed in by :func:`jobs.providers.gcp.provider.from_settings`.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from jobs.providers.gcp.launch import DEFAULT_IMAGE
from jobs.providers.provider_settings import ProviderSettings
from jobs.providers.runner_install import Mode, RunnerInstall

__all__ = ["GcpSettings"]


class GcpSettings(ProviderSettings):
    """The boot image, and how the runner gets onto a Compute Engine instance."""

    PREFIX: ClassVar[str] = "TRAINBOT_GCP_"

    #: The boot image: an image or image family URL
    #: (``projects/P/global/images/NAME`` or ``projects/P/global/images/family/F``);
    #: default a Deep Learning VM family with the NVIDIA driver and CUDA.
    image: str = DEFAULT_IMAGE
    #: ``wheel`` (the control plane's own wheel, downloaded from the control plane's
    #: ``/v1/runner-wheel`` with the attempt's token: the runner's service account needs
    #: no bucket access for it), ``index`` (``trainbot==<version>`` from
    #: ``runner_index_url``) or ``image`` (the image has it; nothing is installed).
    runner_install: Mode = "wheel"
    #: pip's ``--index-url`` on the instance; unset: pip's own (PyPI).
    runner_index_url: str | None = None
    #: A built ``trainbot-<version>-py3-none-any.whl`` for ``wheel``; unset: the one the
    #: container image ships, else built from the control plane's source at its start.
    runner_wheel: Path | None = None
    #: The ids of the only Secret Manager secrets the runner's service account may read
    #: (grant it roles/secretmanager.secretAccessor on each): preflight refuses a
    #: ``gcp-sm://`` secret outside it.
    secrets_prefix: str = "trainbot-"
    #: Secret Manager's API; unset: Google's (a test's fake, else).
    secrets_endpoint: str | None = None

    def runner(self) -> RunnerInstall:
        return RunnerInstall(
            mode=self.runner_install, index_url=self.runner_index_url, wheel=self.runner_wheel
        )
