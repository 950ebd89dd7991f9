"""The local spot provider: the contract, then what only real processes can show.

Every instance is a real process group; workloads are small ``python -c`` scripts that
report through files, so each test waits on what the process did, not on a clock.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import suppress
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from jobs.providers import PROVIDERS, make_provider
from jobs.providers.base import (
    BucketLocation,
    CapacityError,
    InstanceNotFound,
    InstanceState,
    Provider,
    ProviderError,
    ResourceRequest,
)
from jobs.providers.local import ZONE, LocalProvider
from tests.jobs.providers.contract import ProviderContract, launch_request, wait_for_state

CPU = ResourceRequest(cloud="local", region="local", cpus=1)

# Helpers every workload script starts with: write a file atomically.
_PRELUDE = """
import json, os, signal, subprocess, sys, time
def put(path, text):
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)
"""


def script(body: str, *args: object) -> list[str]:
    return [sys.executable, "-c", _PRELUDE + body, *map(str, args)]


# Exits 75 on SIGTERM, like trainbot-runner after committing a checkpoint.
RUNNER_LIKE = """
signal.signal(signal.SIGTERM, lambda *_: sys.exit(75))
if len(sys.argv) > 1:
    put(sys.argv[1], str(os.getpid()))
time.sleep(120)
"""

# Notes each SIGTERM in argv[2] and keeps running.
STUBBORN = """
def on_term(*_):
    with open(sys.argv[2], "a") as f:
        f.write("TERM\\n")
signal.signal(signal.SIGTERM, on_term)
put(sys.argv[1], str(os.getpid()))
while True:
    time.sleep(1)
"""


def wait_for_file(path: Path, *, timeout_s: float = 10.0) -> str:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)
    return path.read_text()


def pid_gone(pid: int) -> bool:
    """No such process, or only its zombie (a reparented orphan waits for init)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False
    return raw.rpartition(")")[2].split()[0] in ("Z", "X")


def wait_gone(pid: int, *, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not pid_gone(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    return tmp_path / "state"


@pytest.fixture
def make_local(state_dir: Path) -> Iterator[Callable[..., LocalProvider]]:
    """LocalProviders with a short window; every instance they know is ended at teardown."""
    made: list[LocalProvider] = []

    def make(**options: object) -> LocalProvider:
        options.setdefault("termination_window_s", 0.5)
        options.setdefault("terminate_grace_s", 1.0)
        provider = LocalProvider(state_dir, **options)  # type: ignore[arg-type]
        made.append(provider)
        return provider

    yield make
    for provider in made:
        provider.close()
        for info in provider.list_instances():
            if not info.state.is_terminal():
                with suppress(ProviderError):
                    provider.terminate(info.instance_id)


@pytest.fixture
def provider(make_local: Callable[..., LocalProvider]) -> LocalProvider:
    return make_local()


@pytest.fixture
def resource_request() -> ResourceRequest:
    return CPU


@pytest.fixture
def workload() -> list[str]:
    return script(RUNNER_LIKE)


class TestLocalProviderContract(ProviderContract):
    @pytest.fixture
    def unknown_instance_id(self) -> str:
        return "local-000000000000"


def start(provider: LocalProvider, command: list[str], *, run_id: str | None = None) -> str:
    return provider.launch(launch_request(CPU, command, zone=ZONE, run_id=run_id)).instance_id


# -- spot behaviour ------------------------------------------------------------------------


def test_preemption_sends_sigterm_then_sigkill_after_the_window(
    provider: LocalProvider, tmp_path: Path
) -> None:
    ready, terms = tmp_path / "ready", tmp_path / "terms"
    instance_id = start(provider, script(STUBBORN, ready, terms))
    pid = int(wait_for_file(ready))
    notice = datetime(2030, 1, 2, 3, 4, 5, tzinfo=timezone.utc)

    begun = time.monotonic()
    provider.preempt(instance_id, now=notice)
    assert time.monotonic() - begun < 0.4, "preempt must not wait for the window"
    assert wait_for_file(terms) == "TERM\n"
    during = provider.status(instance_id)
    assert during.state is InstanceState.RUNNING
    assert "preemption notice" in during.reason

    assert wait_gone(pid), "the timer sends SIGKILL without anyone asking for status"
    assert time.monotonic() - begun >= 0.5
    status = provider.status(instance_id)
    assert status.state is InstanceState.PREEMPTED
    assert status.preempted_at == notice
    assert status.exit_code is None
    assert "termination window" in status.reason
    provider.preempt(instance_id)  # preempting a gone instance does nothing
    assert provider.status(instance_id).preempted_at == notice


def test_runner_exiting_75_on_sigterm_is_preempted_within_the_window(
    make_local: Callable[..., LocalProvider], tmp_path: Path
) -> None:
    provider = make_local(termination_window_s=30)
    ready = tmp_path / "ready"
    instance_id = start(provider, script(RUNNER_LIKE, ready))
    wait_for_file(ready)
    begun = time.monotonic()
    provider.preempt(instance_id)
    status = wait_for_state(provider, instance_id, {InstanceState.PREEMPTED}, timeout_s=5)
    assert time.monotonic() - begun < 5, "it exited on SIGTERM, not by SIGKILL"
    assert status.exit_code == 75
    assert status.preempted_at is not None
    assert "checkpoint is committed" in status.reason


def test_exit_codes_map_to_states(provider: LocalProvider) -> None:
    ok = start(provider, script("print('done')"))
    failed = start(provider, script("sys.exit(3)"))
    self_preempted = start(provider, script("sys.exit(75)"))
    missing = start(provider, ["/nonexistent/trainbot-runner", "exec"])
    done = {InstanceState.SUCCEEDED, InstanceState.FAILED, InstanceState.PREEMPTED}

    assert wait_for_state(provider, ok, done).state is InstanceState.SUCCEEDED
    status = wait_for_state(provider, failed, done)
    assert (status.state, status.exit_code) == (InstanceState.FAILED, 3)
    assert "exited 3" in status.reason and str(provider.log_path(failed)) in status.reason
    status = wait_for_state(provider, self_preempted, done)
    assert (status.state, status.exit_code) == (InstanceState.PREEMPTED, 75)
    assert status.preempted_at is not None
    status = wait_for_state(provider, missing, done)
    assert (status.state, status.exit_code) == (InstanceState.FAILED, 127)
    assert "cannot start" in provider.log_path(missing).read_text()


def test_random_preemptions_follow_the_seeded_exponential(
    make_local: Callable[..., LocalProvider],
) -> None:
    mean, seed = 0.3, 0
    provider = make_local(mean_time_between_preemptions_s=mean, seed=seed)
    draws = random.Random(seed)
    expected = [draws.expovariate(1 / mean) for _ in range(2)]

    spot_ids = []
    for delay in expected:
        before = time.time()
        instance_id = start(provider, script(RUNNER_LIKE))
        after = time.time()
        when = provider.scheduled_preemptions()[instance_id].timestamp()
        assert before + delay <= when <= after + delay
        spot_ids.append(instance_id)
    on_demand = provider.launch(
        launch_request(
            ResourceRequest(cloud="local", region="local", spot=False),
            script(RUNNER_LIKE),
            zone=ZONE,
        )
    ).instance_id
    assert on_demand not in provider.scheduled_preemptions()

    for instance_id in spot_ids:
        status = wait_for_state(provider, instance_id, {InstanceState.PREEMPTED}, timeout_s=8)
        assert status.preempted_at is not None
    assert provider.status(on_demand).state is InstanceState.RUNNING
    assert provider.scheduled_preemptions() == {}


def test_scheduled_preemption_fires_at_its_time(provider: LocalProvider) -> None:
    instance_id = start(provider, script(RUNNER_LIKE))
    at = datetime.now(timezone.utc) + timedelta(seconds=0.3)
    provider.schedule_preemption(instance_id, at=at)
    assert provider.scheduled_preemptions() == {instance_id: at}
    status = wait_for_state(provider, instance_id, {InstanceState.PREEMPTED}, timeout_s=5)
    assert status.preempted_at is not None and status.preempted_at >= at
    with pytest.raises(ProviderError, match="exactly one"):
        provider.schedule_preemption(instance_id, at=at, after_s=1)


# -- state that survives the control plane ---------------------------------------------------


def test_a_new_provider_sees_and_controls_instances_of_the_old_one(
    make_local: Callable[..., LocalProvider], tmp_path: Path
) -> None:
    old = make_local(termination_window_s=0.3)
    ready, stubborn_ready, terms = tmp_path / "ready", tmp_path / "s-ready", tmp_path / "terms"
    req = launch_request(CPU, script(RUNNER_LIKE, ready), zone=ZONE, run_id="run-survives")
    running = old.launch(req).instance_id
    failing = start(old, script("sys.exit(3)"), run_id="run-fails")
    stubborn = start(old, script(STUBBORN, stubborn_ready, terms))
    pid = int(wait_for_file(ready))
    wait_for_file(stubborn_ready)
    old.preempt(stubborn)
    wait_for_file(terms)
    old.close()  # dies before its SIGKILL timer fires

    new = make_local()
    listed = {i.instance_id: i for i in new.list_instances()}
    assert {running, failing, stubborn} <= set(listed)
    assert listed[running].run_id == "run-survives"
    assert new.status(running).state is InstanceState.RUNNING
    assert new.launch(req).instance_id == running, "a retried launch adopts the instance"
    failed = wait_for_state(new, failing, {InstanceState.FAILED})
    assert failed.exit_code == 3
    # The old provider's SIGKILL timer died with it; the new one enforces the window.
    wait_for_state(new, stubborn, {InstanceState.PREEMPTED}, timeout_s=5)

    new.terminate(running)
    assert wait_gone(pid)
    assert new.status(running).state is InstanceState.TERMINATED
    assert len([i for i in new.list_instances() if i.run_id == "run-survives"]) == 1


def test_a_reused_pid_is_not_taken_for_the_instance(provider: LocalProvider) -> None:
    instance_id = start(provider, script(RUNNER_LIKE))
    wait_for_state(provider, instance_id, {InstanceState.RUNNING})
    provider.terminate(instance_id)
    # Pretend the wrapper's pid now belongs to an unrelated process group.
    stranger = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        record = provider.state_dir / "instances" / instance_id / "process.json"
        data = json.loads(record.read_text())
        data.update(pid=stranger.pid, pgid=stranger.pid)
        record.write_text(json.dumps(data))
        assert provider.status(instance_id).state is InstanceState.TERMINATED
        provider.terminate(instance_id)
        provider.preempt(instance_id)
        assert stranger.poll() is None, "the stranger must not be signalled"
    finally:
        stranger.kill()
        stranger.wait()


# -- the instance's environment --------------------------------------------------------------


def test_scratch_env_and_secrets(
    provider: LocalProvider, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRAINBOT_SLACK_BOT_TOKEN", "xoxb-control-plane-secret")
    out = tmp_path / "env.json"
    body = "put(sys.argv[1], json.dumps(dict(os.environ)))"
    token = "runner-token-6c1f0e"
    req = launch_request(
        CPU,
        script(body, out),
        zone=ZONE,
        env={"TRAINBOT_RUNNER_TOKEN": token, "FOO": "bar"},
        scratch_bytes=123_456_789,
    )
    assert token not in repr(req)
    instance_id = provider.launch(req).instance_id
    env = json.loads(wait_for_file(out))
    wait_for_state(provider, instance_id, {InstanceState.SUCCEEDED})

    scratch = provider.state_dir / "instances" / instance_id / "scratch"
    assert env["TRAINBOT_SCRATCH_DIR"] == str(scratch) == str(provider.scratch_dir(instance_id))
    assert scratch.is_dir()
    assert env["TRAINBOT_SCRATCH_BYTES"] == "123456789"
    assert (env["TRAINBOT_RUNNER_TOKEN"], env["FOO"]) == (token, "bar")
    assert "PATH" in env
    # torch's threads: the instance's cores, not every core of the machine.
    assert env["OMP_NUM_THREADS"] == "1"
    assert "TRAINBOT_SLACK_BOT_TOKEN" not in env, "control-plane secrets stay out"
    for path in provider.state_dir.rglob("*"):
        if path.is_file():
            assert token not in path.read_text(errors="replace"), f"token persisted in {path}"

    provider.terminate(instance_id)
    assert not scratch.exists(), "terminating an instance frees its scratch volume"
    assert provider.status(instance_id).state is InstanceState.SUCCEEDED
    assert provider.log_path(instance_id).exists()


def test_log_captures_stdout_and_stderr(provider: LocalProvider) -> None:
    body = "print('step 1 loss 2.5', flush=True); print('warning: slow disk', file=sys.stderr)"
    instance_id = start(provider, script(body))
    wait_for_state(provider, instance_id, {InstanceState.SUCCEEDED})
    text = provider.log_path(instance_id).read_text()
    assert "step 1 loss 2.5" in text and "warning: slow disk" in text


def test_terminate_kills_the_whole_group_after_the_grace(
    make_local: Callable[..., LocalProvider], tmp_path: Path
) -> None:
    provider = make_local(terminate_grace_s=0.3)
    ready = tmp_path / "ready"
    # Ignores SIGTERM, and so does its child (the disposition is inherited).
    body = """
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen(["sleep", "60"])
put(sys.argv[1], str(child.pid))
time.sleep(120)
"""
    instance_id = start(provider, script(body, ready))
    grandchild = int(wait_for_file(ready))
    assert provider.quota(CPU).used >= 1, "a running instance takes its cores"
    begun = time.monotonic()
    provider.terminate(instance_id)
    assert time.monotonic() - begun >= 0.3
    assert wait_gone(grandchild, timeout_s=2)
    status = provider.status(instance_id)
    assert status.state is InstanceState.TERMINATED
    assert "terminated by the control plane" in status.reason


# -- questions and errors --------------------------------------------------------------------


def test_quota_and_capacity_follow_this_machine(make_local: Callable[..., LocalProvider]) -> None:
    provider = make_local(gpu_names=["NVIDIA A100-SXM4-80GB", "NVIDIA A100-SXM4-80GB"])
    cores = os.cpu_count() or 1
    too_many = provider.quota(ResourceRequest(cloud="local", region="local", cpus=cores + 1))
    assert (too_many.ok, too_many.unit, too_many.limit) == (False, "cores", cores)
    assert str(cores) in too_many.remedy

    def gpus(kind: str, count: int) -> ResourceRequest:
        return ResourceRequest(
            cloud="local", region="local", accelerator_type=kind, accelerator_count=count
        )

    quota = provider.quota(gpus("A100", 2))
    assert (quota.ok, quota.unit, quota.limit, quota.needed) == (True, "GPUs", 2, 2)
    assert provider.quota(gpus("nvidia-tesla-a100", 1)).ok
    h100 = provider.quota(gpus("H100", 1))
    assert (h100.ok, h100.limit) == (False, 0)
    assert "cloud" in h100.remedy

    zones = provider.capacity(dataclasses.replace(gpus("A100", 1), zones=("us-east-1a", ZONE)))
    assert [(z.zone, z.available) for z in zones] == [(ZONE, True), ("us-east-1a", False)]
    assert not provider.capacity(gpus("H100", 1))[0].available


def test_gpus_are_counted_from_nvidia_smi_output(
    make_local: Callable[..., LocalProvider], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stand-in ``nvidia-smi`` on PATH prints what the real one prints on a 2-GPU box."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "nvidia-smi"
    fake.write_text(
        "#!/bin/sh\n"
        'test "$1" = "-L" || exit 2\n'
        "echo 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0b1c6f3e-2a4d-4c1e-9f7a-1d2e3f4a5b6c)'\n"
        "echo 'GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-7e8f9a0b-1c2d-3e4f-5a6b-7c8d9e0f1a2b)'\n"
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    provider = make_local()

    def gpus(kind: str, count: int) -> ResourceRequest:
        return ResourceRequest(
            cloud="local", region="local", accelerator_type=kind, accelerator_count=count
        )

    two = provider.quota(gpus("H100", 2))
    assert (two.ok, two.limit) == (True, 2)
    assert not provider.quota(gpus("H100", 3)).ok
    assert provider.quota(gpus("A100", 1)).limit == 0


@pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="needs nvidia-smi and a GPU")
def test_gpus_come_from_nvidia_smi(make_local: Callable[..., LocalProvider]) -> None:
    listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=True)
    count = sum(line.startswith("GPU ") for line in listed.stdout.splitlines())
    provider = make_local()
    quota = provider.quota(
        ResourceRequest(cloud="local", region="local", accelerator_type="gpu", accelerator_count=1)
    )
    assert (quota.ok, quota.limit) == (count >= 1, count)
    model = listed.stdout.split(":", 1)[1].split("(UUID")[0].split()[-1]  # "H200", "A100-…"
    typed = ResourceRequest(
        cloud="local", region="local", accelerator_type=model, accelerator_count=count
    )
    assert provider.quota(typed).ok


def test_price_and_bucket_location(make_local: Callable[..., LocalProvider]) -> None:
    provider = make_local(spot_usd_per_hour=0.75, on_demand_usd_per_hour=2.5)
    quote = provider.price(CPU)
    assert (quote.spot_usd_per_hour, quote.on_demand_usd_per_hour) == (0.75, 2.5)
    for local in ("/data/shards", "file:///data/shards", "checkpoints/run-1"):
        assert provider.bucket_location(local) == BucketLocation.region("local")
    for remote in ("s3://bucket/data", "gs://bucket/data"):
        assert provider.bucket_location(remote) is None


def test_launch_refuses_what_it_cannot_do(provider: LocalProvider) -> None:
    with pytest.raises(CapacityError) as zone_error:
        provider.launch(launch_request(CPU, script(RUNNER_LIKE), zone="us-east-1a"))
    assert zone_error.value.zone == "us-east-1a" and ZONE in str(zone_error.value)
    with pytest.raises(ProviderError, match="command is empty"):
        provider.launch(launch_request(CPU, [], zone=ZONE))
    with pytest.raises(InstanceNotFound):
        provider.status("../../etc")
    assert provider.list_instances() == []


def test_registry_builds_the_local_provider(state_dir: Path) -> None:
    assert "local" in PROVIDERS
    built = make_provider("local", state_dir=state_dir)
    assert isinstance(built, LocalProvider) and isinstance(built, Provider)
    assert built.name == "local"
    with pytest.raises(ProviderError, match="unknown provider 'azure': use one of aws, gcp, local"):
        make_provider("azure")
    with pytest.raises(ProviderError, match="termination_window_s"):
        LocalProvider(state_dir, termination_window_s=-1)


def test_instances_run_at_a_lower_cpu_priority(
    make_local: Callable[..., LocalProvider], tmp_path: Path
) -> None:
    """The training run yields the CPU to the control plane on the same machine."""
    body = "put(sys.argv[1], str(os.nice(0)))"
    own = os.nice(0)
    for name, options, expected in (
        ("default", {}, own + 10),
        ("same", {"nice": 0}, own),
        ("seven", {"nice": 7}, own + 7),
    ):
        instance_id = start(make_local(**options), script(body, tmp_path / name))
        assert int(wait_for_file(tmp_path / name)) == min(19, expected), name
        wait_for_state(make_local(), instance_id, {InstanceState.SUCCEEDED})
    with pytest.raises(ProviderError, match="nice is 20; use 0"):
        LocalProvider(tmp_path / "refused", nice=20)
