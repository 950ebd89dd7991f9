"""A spec's ``image:`` without a container runtime: the spec refuses a bad reference (and
setup beside an image), the runner is told docker on the clouds and podman on the local
provider, and preflight on the local provider says what to install when podman is
missing. The boot scripts' part is in providers/test_boot_scripts.py; a real container
runs in tests/runner/test_container_run.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from jobs.domain.errors import SpecError
from jobs.preflight.image import ImageCheck
from jobs.preflight.report import PreflightPlan, Status
from jobs.providers.local import LocalProvider
from jobs.spec import JobSpec, spec_from_text
from jobs.spec.changes import apply_changes, changed_paths, checks_for
from jobs.spec.env import code_env, image_env
from tests.jobs.test_preflight import context

IMAGE = "nvcr.io/nvidia/pytorch:24.05-py3"


def test_a_bad_image_reference_is_refused_clearly() -> None:
    with pytest.raises(SpecError) as refused:
        spec_from_text("command: python train.py\nimage: My Image:latest\n", name="t")
    said = str(refused.value)
    assert "image" in said and "is not a container image reference" in said
    assert "[registry/]name[:tag]" in said


def test_setup_with_an_image_is_refused_with_what_to_do_instead() -> None:
    with pytest.raises(SpecError) as refused:
        spec_from_text(
            "command: python train.py\nimage: ghcr.io/team/train:1\n"
            "setup: pip install -r requirements.txt\n",
            name="t",
        )
    assert "setup does not run inside the image yet" in str(refused.value)
    assert "Dockerfile" in str(refused.value)


def test_the_runner_is_told_podman_here_and_docker_on_a_cloud() -> None:
    gpu = JobSpec(
        name="t", command=["python", "t.py"], image=IMAGE, resources={"accelerator": "T4:1"}
    )
    assert image_env(gpu, local=False) == {
        "TRAINBOT_IMAGE": IMAGE,
        "TRAINBOT_CONTAINER_RUNTIME": "docker",
        "TRAINBOT_CONTAINER_GPUS": "1",
    }
    cpu = JobSpec(name="t", command=["python", "t.py"], image=IMAGE)
    assert code_env(cpu, local=True)["TRAINBOT_CONTAINER_RUNTIME"] == "podman"
    assert "TRAINBOT_CONTAINER_GPUS" not in image_env(cpu, local=True)
    assert image_env(JobSpec(name="t", command=["x"]), local=False) == {}


def test_preflight_on_the_local_provider_says_to_install_podman(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    spec = JobSpec(name="t", command=["python", "t.py"], image="localhost/train:dev")
    with LocalProvider(tmp_path / "state", gpu_names=[]) as local:
        found = ImageCheck().run(context(tmp_path, spec, local), prior=PreflightPlan())
    assert found.status is Status.FAIL
    assert found.detail == (
        "the spec's image localhost/train:dev needs podman, which is not installed on this machine"
    )
    assert found.remedy == "apt-get install podman (Debian, Ubuntu)"
    plain = JobSpec(name="t", command=["python", "t.py"])
    with LocalProvider(tmp_path / "state2", gpu_names=[]) as local:
        assert (
            ImageCheck().run(context(tmp_path, plain, local), prior=PreflightPlan()).status
            is Status.PASS
        )


def test_a_resubmit_moves_the_run_to_another_image_and_says_so() -> None:
    stored = JobSpec(name="t", command=["python", "t.py"], image="ghcr.io/team/train:1.2")
    old = stored.model_dump(mode="json")
    moved = apply_changes(old, ["image=ghcr.io/team/train:1.3"], name="t")
    assert moved.image == "ghcr.io/team/train:1.3"
    assert ("image", "ghcr.io/team/train:1.2", "ghcr.io/team/train:1.3") in changed_paths(
        old, moved.model_dump(mode="json")
    )
    assert checks_for(changed_paths(old, moved.model_dump(mode="json"))) == ("image",)
    with pytest.raises(SpecError) as refused:
        apply_changes(old, ["image=Not An Image"], name="t")
    assert "is not a container image reference" in str(refused.value)
