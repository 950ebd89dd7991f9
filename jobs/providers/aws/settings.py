"""``TRAINBOT_AWS_*`` settings the AWS provider owns (issue 24: each provider its own).

The older AWS settings (region, image, subnets …) are still read by
:mod:`jobs.process.settings` and passed in by :func:`jobs.providers.aws.provider.from_settings`.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from jobs.providers.provider_settings import ProviderSettings
from jobs.providers.runner_install import Mode, RunnerInstall

__all__ = ["AwsSettings"]


class AwsSettings(ProviderSettings):
    """How the runner gets onto an EC2 instance."""

    PREFIX: ClassVar[str] = "TRAINBOT_AWS_"

    #: ``wheel`` (the control plane's own wheel, downloaded from the control plane's
    #: ``/v1/runner-wheel`` with the attempt's token: instances need no index for
    #: trainbot and no bucket access), ``index`` (``trainbot==<version>`` from
    #: ``runner_index_url``) or ``image`` (the AMI has it; nothing is installed).
    runner_install: Mode = "wheel"
    #: pip's ``--index-url`` on the instance; unset: pip's own (PyPI).
    runner_index_url: str | None = None
    #: A built ``trainbot-<version>-py3-none-any.whl`` for ``wheel``; unset: the one the
    #: container image ships, else built from the control plane's source at its start.
    runner_wheel: Path | None = None
    #: The names of the only Secrets Manager secrets the instance role may read (the
    #: shipped deploy/aws/runner-instance-policy.json grants ``trainbot/*``): preflight
    #: refuses an ``aws-sm://`` secret outside it. Change the policy with it.
    secrets_prefix: str = "trainbot/"

    def runner(self) -> RunnerInstall:
        return RunnerInstall(
            mode=self.runner_install, index_url=self.runner_index_url, wheel=self.runner_wheel
        )
