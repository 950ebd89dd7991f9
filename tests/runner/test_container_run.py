"""A spec's ``image:`` on the local provider: the command runs in a podman container, the
runner outside it (runner.container).

The tiny example runs in an image that has torch and no trainbot (the runner's library
is mounted into it), is preempted by the local provider (SIGTERM through podman to the
training process), exits 75 with its checkpoint committed, and a second attempt resumes
from it and ends with the parameters of an uninterrupted run, bit for bit.

The image is built once per machine from the Debian base that tests/deploy builds
(../shared/containers.md), with the torch of this checkout's environment copied in (no
registry and no package index needed) and kept in podman's storage as a cache. Gated
like the other container tests: ``TRAINBOT_TEST_CONTAINERS=1`` (``.ci/run`` sets it).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from jobs.preflight.image import ImageCheck
from jobs.preflight.report import PreflightPlan, Status
from jobs.providers.base import InstanceState, ResourceRequest
from jobs.providers.local import REGION, ZONE, LocalProvider
from jobs.spec import JobSpec
from jobs.spec.env import image_env
from runner import EXIT_PREEMPTED
from runner import env as contract
from runner.checkpoint import list_committed
from runner.container import Container, ContainerError
from runner.dryrun import run_dry_run
from runner.store import LocalStore
from tests.deploy.test_container import (
    BASE_IMAGE,
    ENABLE_ENV,
    Podman,
    _build_base,
    _containers_conf,
    build_lock,
)
from tests.fakes.ingest import FakeIngest
from tests.jobs.providers.contract import launch_request, wait_for_state
from tests.jobs.test_preflight import context
from tests.paths import ROOT
from tests.waiting import wait_until

pytestmark = [pytest.mark.container, pytest.mark.timeout(900)]

PY = f"{sys.version_info[0]}.{sys.version_info[1]}"
#: The training image: the base, this environment's torch, no trainbot.
TORCH_IMAGE = f"localhost/trainbot-test-torch:{torch.__version__.replace('+', '-')}-py{PY}"
#: What ``import torch`` and the tiny example need from site-packages (torch's own deps).
_TORCH_FILES = (
    "torch", "torchgen", "numpy", "numpy.libs", "typing_extensions.py", "tqdm", "sympy",
    "mpmath", "filelock", "networkx", "jinja2", "markupsafe", "fsspec",
)  # fmt: skip
STEPS = 40
TOKEN = "container-token"


@pytest.fixture(scope="module")
def podman() -> Podman:
    if os.environ.get(ENABLE_ENV) != "1":
        pytest.skip(f"container tests build images for minutes: set {ENABLE_ENV}=1")
    if shutil.which("podman") is None:
        pytest.skip("podman is not installed (Debian: apt-get install podman buildah runc)")
    return Podman(_containers_conf())


@pytest.fixture(scope="module")
def torch_image(podman: Podman) -> str:
    """Built once per machine (the torch version is in its tag), then reused."""
    if podman.image_exists(TORCH_IMAGE):
        return TORCH_IMAGE
    if not podman.image_exists(BASE_IMAGE):
        _build_base(podman)
    with build_lock("torch-image"):
        if not podman.image_exists(TORCH_IMAGE):  # not built by another worker meanwhile
            _build_torch_image(podman)
    return TORCH_IMAGE


def _build_torch_image(podman: Podman) -> None:
    site = Path(torch.__file__).resolve().parents[1]
    infos = [
        p.name for p in site.glob("*.dist-info") if p.name.split("-")[0].lower() in _TORCH_FILES
    ]
    files = " ".join([*_TORCH_FILES, *infos])
    target = f"/usr/local/lib/python{PY}/dist-packages"
    with tempfile.TemporaryDirectory(prefix="trainbot-torch-image-") as context:
        Path(context, "Containerfile").write_text(
            f"FROM {BASE_IMAGE}\n"
            f"RUN mkdir -p {target} && cd /host-site && cp -a {files} {target}/ "
            "&& python -c 'import torch'\n"
        )
        started = time.monotonic()
        podman.run(
            "build", "--volume", f"{site}:/host-site:ro", "-t", TORCH_IMAGE, context,
            timeout=900,
        )  # fmt: skip
        print(f"built {TORCH_IMAGE} in {time.monotonic() - started:.0f} s")


def _tiny(*args: str) -> list[str]:
    return ["python", "-m", "runner.examples.tiny", "--steps", str(STEPS), "--seed", "3", *args]


def _last_json(text: str) -> dict[str, object]:
    line = next(ln for ln in reversed(text.splitlines()) if ln.startswith("{"))
    return dict(json.loads(line))


def test_tiny_example_in_podman_is_preempted_exits_75_and_resumes_bit_identical(
    podman: Podman, torch_image: str, tmp_path: Path
) -> None:
    store = tmp_path / "store"
    # The parameters of an uninterrupted run, on this machine without a container (beside
    # the first attempt: it only has to be done by the end).
    reference = subprocess.Popen(
        [sys.executable, *_tiny()[1:]],
        env={**os.environ, "OMP_NUM_THREADS": "1", contract.CHECKPOINT_URI.name: str(tmp_path / "ref")},
        stdout=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip

    spec = JobSpec(name="tiny-in-a-container", command=_tiny(), image=torch_image)
    provider = LocalProvider(tmp_path / "instances", termination_window_s=30)
    with FakeIngest(TOKEN) as ingest, provider:
        env = {
            **image_env(spec, local=True),
            "CONTAINERS_CONF": podman.env["CONTAINERS_CONF"],
            "OMP_NUM_THREADS": "1",
            **contract.render(
                {
                    contract.CHECKPOINT_URI: str(store),
                    contract.RUN_ID: "run-image",
                    contract.CHECKPOINT_EVERY_STEPS: 5,
                    contract.INGEST_URL: ingest.url,
                    contract.TOKEN: TOKEN,
                }
            ),
        }
        runner = [sys.executable, "-m", "runner.cli", "exec", "--"]

        def launch(attempt: str, *extra: str) -> str:
            request = launch_request(
                ResourceRequest(cloud="local", region=REGION, cpus=1),
                [*runner, *spec.command, *extra],
                zone=ZONE,
                run_id="run-image",
                attempt_id=attempt,
                env={**env, contract.ATTEMPT_ID.name: attempt, "PYTHONPATH": str(ROOT)},
            )
            return provider.launch(request).instance_id

        def events(attempt: str, type_: str) -> list[dict[str, object]]:
            with ingest.cond:
                return [e.data for e in ingest.accepted if e.attempt == attempt and e.type == type_]

        # Attempt 1: slowed down so that the notice comes mid-run, after a checkpoint.
        first = launch("attempt-1", "--step-delay", "0.1")
        wait_until(
            lambda: events("attempt-1", "checkpoint_committed") or events("attempt-1", "exit"),
            timeout=120,
            what="a checkpoint committed from the container",
        )
        assert not events("attempt-1", "exit"), provider.instance_log(first, lines=60)
        provider.preempt(first)
        ended = wait_for_state(
            provider, first, {InstanceState.PREEMPTED, InstanceState.FAILED}, timeout_s=60
        )
        log1 = provider.instance_log(first, lines=60)
        assert ended.state is InstanceState.PREEMPTED, log1
        assert ended.exit_code == EXIT_PREEMPTED, log1  # the 75 came back through podman
        [said] = [
            e["message"] for e in events("attempt-1", "log") if "runs in" in str(e["message"])
        ]
        assert f"the command runs in {torch_image} (podman, Python {PY}" in str(said)
        assert "runner library: the runner's, mounted" in str(said)
        exits = events("attempt-1", "exit")
        assert [e["reason"] for e in exits] == ["preempted"], exits
        # Its checkpoints are in the store on this machine, not in the container.
        committed = [c.step for c in list_committed(LocalStore(store / "run-image"))]
        assert committed and 0 < max(committed) < STEPS, committed
        # --rm, and the runner's own removal: nothing is left behind.
        left = podman.run("ps", "-a", "-q", "--filter", "label=trainbot.run=run-image").stdout
        assert left.split() == [], left

        # Attempt 2, on a fresh instance: restores the newest step and finishes.
        second = launch("attempt-2")
        done = wait_for_state(
            provider, second, {InstanceState.SUCCEEDED, InstanceState.FAILED}, timeout_s=180
        )
        log2 = provider.instance_log(second, lines=80)
        assert done.state is InstanceState.SUCCEEDED, log2
        restored = events("attempt-2", "restored")
        assert restored and int(str(restored[0]["step"])) == max(committed), restored
        result = _last_json(log2)
        assert result["step"] == STEPS
        out, _ = reference.communicate(timeout=120)
        expected = _last_json(out)
        assert expected["step"] == STEPS
        assert result["params_sha256"] == expected["params_sha256"], "not bit-identical"


def test_the_dry_run_runs_in_the_image(podman: Podman, torch_image: str, tmp_path: Path) -> None:
    spec = JobSpec(name="tiny-dry-run", command=_tiny(), image=torch_image)
    report = run_dry_run(
        spec.command,
        checkpoint_uri=str(tmp_path / "store"),
        run_id="tiny-dry-run",
        steps=3,
        timeout_s=120,
        env={
            "PATH": os.environ["PATH"],
            "PYTHONPATH": str(ROOT),
            "OMP_NUM_THREADS": "1",
            "CONTAINERS_CONF": podman.env["CONTAINERS_CONF"],
            **image_env(spec, local=True),
        },
    )
    assert report.ok, report.problems
    assert report.steps_before_kill == 3 and report.steps_after_restore >= 2
    assert report.restored_sha256 == report.saved_sha256
    # The killed first phase's container went with it.
    left = podman.run("ps", "-a", "-q", "--filter", "label=trainbot.run=tiny-dry-run").stdout
    assert left.split() == [], left


def test_a_missing_image_is_refused_with_what_to_do(podman: Podman) -> None:
    container = Container(
        "localhost/trainbot-test-absent:none", runtime="podman", runtime_env=podman.env
    )
    with pytest.raises(ContainerError) as refused:
        container.check(pull=False)
    said = str(refused.value)
    assert "localhost/trainbot-test-absent:none is not in podman's storage" in said
    assert "podman pull localhost/trainbot-test-absent:none" in said
    assert "podman build -t" in said


def test_preflight_passes_an_image_podman_can_run(
    podman: Podman, torch_image: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CONTAINERS_CONF", podman.env["CONTAINERS_CONF"])
    spec = JobSpec(name="t", command=["python", "t.py"], image=torch_image)
    with LocalProvider(tmp_path / "state", gpu_names=[]) as local:
        found = ImageCheck().run(context(tmp_path, spec, local), prior=PreflightPlan())
    assert found.status is Status.PASS, found
    assert found.detail == (
        f"{torch_image} runs here with podman: Python {PY}, the runner's library, mounted"
    )


def test_a_runner_killed_past_the_window_leaves_no_container(
    podman: Podman, torch_image: str, tmp_path: Path
) -> None:
    """podman's client dies with the runner's group; the container would train on beside
    the next attempt. The local provider removes it by its instance's label."""
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    stubborn += "print('ready', flush=True); time.sleep(120)"
    spec = JobSpec(name="stubborn", command=["python", "-c", stubborn], image=torch_image)
    with LocalProvider(tmp_path / "instances", termination_window_s=1) as provider:
        env = {
            **image_env(spec, local=True),
            "CONTAINERS_CONF": podman.env["CONTAINERS_CONF"],
            **contract.render({contract.CHECKPOINT_URI: str(tmp_path / "store")}),
        }
        request = launch_request(
            ResourceRequest(cloud="local", region=REGION, cpus=1),
            [sys.executable, "-m", "runner.cli", "exec", "--", *spec.command],
            zone=ZONE,
            env={**env, "PYTHONPATH": str(ROOT)},
        )
        instance = provider.launch(request).instance_id
        label = f"label=trainbot.instance={instance}"
        wait_until(
            lambda: "ready" in provider.instance_log(instance, lines=20),
            timeout=60,
            what="the command to start in its container",
        )
        assert podman.run("ps", "-q", "--filter", label).stdout.split(), "not in a container"
        provider.preempt(instance)
        ended = wait_for_state(provider, instance, {InstanceState.PREEMPTED}, timeout_s=60)
        assert "termination window" in ended.reason, ended
        wait_until(
            lambda: not podman.run("ps", "-aq", "--filter", label).stdout.split(),
            timeout=30,
            what="the killed runner's container to be removed",
        )
