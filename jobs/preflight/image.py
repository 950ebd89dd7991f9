"""The image check: the spec's container image can run where the run's instances are.

On the local provider the instances are this machine: podman must be installed, the
image must be in its storage (no registry is asked: a pull is the person's to run), its
``python`` must run the runner library (its own trainbot, or the runner's mounted, which
needs the same Python version) and, for GPUs, podman must have the NVIDIA CDI spec; each
problem says what to do. A cloud instance pulls the image with docker when the attempt
starts (:mod:`runner.container`); one it cannot run ends that attempt as
``image_unavailable``, saying why.
"""

from __future__ import annotations

import os

from jobs.preflight.report import CheckResult, PreflightContext, PreflightPlan, Status
from runner.container import Container, ContainerError

__all__ = ["ImageCheck"]


class ImageCheck:
    """The spec's ``image`` can run the command on the run's instances."""

    name: str = "image"

    def run(self, ctx: PreflightContext, *, prior: PreflightPlan) -> CheckResult:
        image = ctx.spec.image
        if image is None:
            return CheckResult(self.name, Status.PASS, "no container image", data={})
        gpus = ctx.spec.resources.accelerator is not None
        if not ctx.provider.capabilities.runs_on_this_machine:
            return CheckResult(
                self.name,
                Status.PASS,
                f"{image}: docker on each {ctx.provider.name} instance pulls it when the "
                "attempt starts; an image it cannot pull or run ends that attempt as "
                "image_unavailable, saying why",
                data={"image": image, "runtime": "docker", "checked": False},
            )
        container = Container(image, runtime="podman", gpus=gpus, runtime_env=dict(os.environ))
        try:
            facts = container.check(pull=False)
        except ContainerError as exc:
            return CheckResult(
                self.name,
                Status.FAIL,
                str(exc).partition(": ")[0],
                str(exc).partition(": ")[2] or "fix the image, then run preflight again",
                data={"image": image, "runtime": "podman"},
            )
        library = (
            f"its own trainbot {facts.trainbot}"
            if facts.trainbot
            else "the runner's library, mounted"
        )
        return CheckResult(
            self.name,
            Status.PASS,
            f"{image} runs here with podman: Python {facts.python}, {library}",
            data={"image": image, "runtime": "podman", "python": facts.python},
        )
