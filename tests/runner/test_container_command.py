"""runner.container without a container runtime: the command line docker and podman are
given (mounts, environment by name, GPUs, the init process), the image references the
spec takes, and an attempt whose runtime is missing ends as ``image_unavailable`` before
its command runs. tests/runner/test_container_run.py runs a real container."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from runner import EXIT_FAILED
from runner import env as contract
from runner.container import LIBRARY_DIR, Container, ImageFacts, check_image_ref
from runner.dryrun import run_dry_run
from runner.supervisor import Supervisor
from runner.telemetry.events_file import FileSink

IMAGE = "ghcr.io/team/train:1.2"


def _pairs(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, word in enumerate(argv[:-1]) if word == flag]


def test_docker_gets_the_runs_paths_its_environment_by_name_and_the_gpus(tmp_path: Path) -> None:
    code, scratch, missing = tmp_path / "code", tmp_path / "scratch", tmp_path / "nowhere"
    (code / "data").mkdir(parents=True)
    scratch.mkdir()
    container = Container(
        IMAGE, runtime="docker", gpus=True, facts=ImageFacts(python="3.11", trainbot=None)
    )
    env = {
        "PATH": "/host/venv/bin:/usr/bin",
        "HOME": "/root",
        "LD_LIBRARY_PATH": "/host/lib",
        "PYTHONPATH": "/host/checkout",
        "XDG_RUNTIME_DIR": "/run/user/0",
        "TRAINBOT_TOKEN": "tok-not-on-argv",
        "WANDB_API_KEY": "secret-not-on-argv",
        "OMP_NUM_THREADS": "4",
        "TRAINBOT_RUN_ID": "r-7",
        "TRAINBOT_ATTEMPT_ID": "a-2",
        "TRAINBOT_INSTANCE_ID": "local-0123456789ab",
    }
    argv = container.command(
        ["python", "train.py", "--lr", "3e-4"],
        env=env,
        cwd=code,
        paths=[scratch, code / "data", None, missing],
    )

    assert argv[:2] == ["docker", "run"]
    assert argv[-5:] == [IMAGE, "python", "train.py", "--lr", "3e-4"]
    options = argv[: argv.index(IMAGE)]
    for flag in ("--rm", "--init", "--sig-proxy=true"):
        assert flag in options
    assert _pairs(options, "--gpus") == ["all"]
    assert _pairs(options, "--network") == ["host"]
    assert _pairs(options, "--ipc") == ["host"]
    assert _pairs(options, "--workdir") == [str(code)]
    assert _pairs(options, "--name") == [container.name]
    assert _pairs(options, "--label") == [
        "trainbot.run=r-7",
        "trainbot.attempt=a-2",
        "trainbot.instance=local-0123456789ab",
    ]
    volumes = _pairs(options, "--volume")
    # The run's paths at the same paths inside, one under another not twice; one not
    # made yet is made (what the command writes there outlives the container).
    assert volumes[:3] == [f"{p}:{p}" for p in (code, missing, scratch)]
    assert missing.is_dir()
    library = {v.split(":")[1]: v for v in volumes[3:]}
    runner_dir = Path(sys.modules["runner"].__file__ or "").parent
    assert library[f"{LIBRARY_DIR}/runner"] == f"{runner_dir}:{LIBRARY_DIR}/runner:ro"
    assert f"{LIBRARY_DIR}/msgspec" in library and f"{LIBRARY_DIR}/boto3" in library
    assert all(v.endswith(":ro") for v in volumes[3:])
    passed = _pairs(options, "--env")
    # Values go through the runtime's own environment: never a secret on a command line.
    assert {"TRAINBOT_TOKEN", "WANDB_API_KEY", "OMP_NUM_THREADS"} <= set(passed)
    assert not any("not-on-argv" in word for word in argv)
    for host_only in ("PATH", "HOME", "LD_LIBRARY_PATH", "PYTHONPATH", "XDG_RUNTIME_DIR"):
        assert host_only not in passed
    assert f"PYTHONPATH={LIBRARY_DIR}" in passed


def test_podman_gets_the_cdi_device_and_an_image_with_trainbot_gets_no_library(
    tmp_path: Path,
) -> None:
    container = Container(
        "localhost/train:dev", runtime="podman", gpus=True, facts=ImageFacts("3.12", "0.1.0")
    )
    argv = container.command(["python", "t.py"], env={}, cwd=tmp_path, paths=[])
    options = argv[: argv.index("localhost/train:dev")]
    assert _pairs(options, "--device") == ["nvidia.com/gpu=all"]
    assert "--gpus" not in options and "--init" in options
    assert _pairs(options, "--volume") == [f"{tmp_path}:{tmp_path}"]
    assert not any(word.startswith("PYTHONPATH=") for word in options)
    cpu = Container("localhost/train:dev", runtime="podman", facts=ImageFacts("3.12", "0.1.0"))
    assert "--device" not in cpu.command(["x"], env={}, cwd=tmp_path, paths=[])


@pytest.mark.parametrize(
    "ref",
    [
        "python:3.12-slim",
        "nvcr.io/nvidia/pytorch:24.05-py3",
        "localhost:5000/team/train",
        "ghcr.io/team/train@sha256:" + "a" * 64,
        "registry.example.com/a/b/c:v1.2_3",
    ],
)
def test_image_references_docker_takes_are_taken(ref: str) -> None:
    assert check_image_ref(ref) == ref


@pytest.mark.parametrize(
    "ref",
    ["", "Team/Train:1", "train:1 --privileged", "docker://train", "train:", "-v/:/host"],
    ids=repr,
)
def test_a_bad_image_reference_is_refused_with_the_grammar(ref: str) -> None:
    with pytest.raises(ValueError) as refused:
        check_image_ref(ref)
    assert "[registry/]name[:tag]" in str(refused.value)
    assert "resources.image_id is the machine image" in str(refused.value)


def test_without_the_runtime_the_attempt_ends_image_unavailable_before_the_command(
    tmp_path: Path,
) -> None:
    ran = tmp_path / "ran"
    events = tmp_path / "events.jsonl"
    empty = tmp_path / "bin"
    empty.mkdir()
    env = {
        "PATH": str(empty),
        **contract.render(
            {
                contract.IMAGE: IMAGE,
                contract.CONTAINER_RUNTIME: "docker",
                contract.SCRATCH_DIR: tmp_path,
            }
        ),
    }
    sink = FileSink(events)
    supervisor = Supervisor(
        [sys.executable, "-c", f"open({str(ran)!r}, 'w')"],
        sink=sink,
        env=env,
        install_signals=False,
        sample_s=60,
    )
    assert supervisor.run() == EXIT_FAILED
    sink.close()
    assert not ran.exists(), "the command ran without its image"
    [end] = [e for e in map(json.loads, events.read_text().splitlines()) if e["type"] == "exit"]
    assert end["data"]["reason"] == "image_unavailable"
    assert end["data"]["code"] == EXIT_FAILED
    said = end["data"]["log_tail"]
    assert f"the spec's image {IMAGE} needs docker, which is not installed" in said
    assert "Deep Learning images" in said


def test_the_dry_run_of_an_image_without_its_runtime_says_what_to_install(
    tmp_path: Path,
) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    report = run_dry_run(
        [sys.executable, "-c", "print('never runs')"],
        checkpoint_uri=str(tmp_path / "ck"),
        run_id="r-image",
        steps=3,
        timeout_s=30,
        env={
            "PATH": str(empty),
            **contract.render(
                {contract.IMAGE: "localhost/train:dev", contract.CONTAINER_RUNTIME: "podman"}
            ),
        },
    )
    assert not report.ok
    [problem] = report.problems
    assert problem.startswith("the spec's image localhost/train:dev needs podman")
    assert "apt-get install podman" in problem and "image_unavailable" in problem
