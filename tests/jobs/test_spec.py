from __future__ import annotations

import json
from pathlib import Path

import pytest

from jobs.domain.errors import SpecError, TrainbotError
from jobs.process.settings import SHIPPED_SPECS_DIR
from jobs.spec import (
    TUNABLE_ENV,
    JobSpec,
    KeepBest,
    apply_overrides,
    list_specs,
    load_spec,
    parse_spec,
)


@pytest.fixture
def specs_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "specs"
    directory.mkdir()
    (directory / "gpt-small.yaml").write_text(
        "command: python train.py --model gpt-small\n"
        "resources:\n"
        "  cloud: aws\n"
        "  region: us-east-1\n"
        "  accelerator: A100:8\n"
        "budget:\n"
        "  usd: 500\n"
    )
    return directory


def write_spec(directory: Path, name: str, text: str) -> None:
    (directory / f"{name}.yaml").write_text(text)


def spec_error(specs_dir: Path, name: str = "gpt-small", overrides: tuple[str, ...] = ()) -> str:
    with pytest.raises(SpecError) as caught:
        load_spec(name, specs_dir=specs_dir, overrides=overrides)
    assert "Traceback" not in str(caught.value)
    return str(caught.value)


# --- shipped specs and defaults -------------------------------------------------------


def test_shipped_specs_load() -> None:
    assert {"tiny", "diverge", "slow-input"} <= set(list_specs(SHIPPED_SPECS_DIR))
    tiny = load_spec("tiny", specs_dir=SHIPPED_SPECS_DIR)
    assert tiny.name == "tiny"
    assert tiny.command[:3] == ["python", "-m", "runner.examples.tiny"]
    assert tiny.resources.cloud == "local" and tiny.checkpoint.interval == "auto"
    diverge = load_spec("diverge", specs_dir=SHIPPED_SPECS_DIR)
    assert diverge.command[:5] == ["python", "-m", "runner.examples.tiny", "--lr", "5.0"]
    slow = load_spec("slow-input", specs_dir=SHIPPED_SPECS_DIR)
    assert "--data-delay" in slow.command and slow.resources.disk_gb < 1


def test_defaults_fill_everything_but_the_command(specs_dir: Path) -> None:
    write_spec(specs_dir, "bare", "command: [python, train.py]\n")
    spec = load_spec("bare", specs_dir=specs_dir)
    assert spec.name == "bare"
    assert spec.resources.cloud is None  # the control plane's default provider
    assert spec.resources.spot is True
    assert spec.resources.accelerator is None
    assert spec.checkpoint.interval == "auto"
    assert spec.checkpoint.interval_s is None
    assert spec.retention.keep_last == 3
    assert spec.budget.usd is None
    assert spec.budget.thresholds == [50, 80, 100]
    assert spec.budget.hard_cap is True
    assert spec.resubmit.max_attempts is None  # deprecated, ignored
    assert spec.resubmit.wait_for_capacity == 6 * 3600
    assert spec.resubmit.max_preemptions is None
    assert spec.resubmit.zone_failover is True
    assert spec.alerts.loss_spike_factor == 3.0
    assert spec.alerts.loss_spike_points == 3
    assert spec.alerts.low_util_percent == 40.0
    assert spec.alerts.low_util_window_s == 300.0
    assert spec.alerts.disk_percent == 90.0
    assert spec.alerts.disk_horizon_s == 1800.0
    assert spec.alerts.repeated_preemptions == 3
    assert spec.alerts.repeated_window_s == 3600.0
    assert spec.alerts.heartbeat_deadline_s == 120.0
    assert spec.dry_run.enabled is True


def test_accelerator_is_parsed_into_type_and_count(specs_dir: Path) -> None:
    spec = load_spec("gpt-small", specs_dir=specs_dir)
    assert spec.resources.accelerator is not None
    assert (spec.resources.accelerator.type, spec.resources.accelerator.count) == ("A100", 8)
    assert str(spec.resources.accelerator) == "A100:8"
    one = load_spec("gpt-small", specs_dir=specs_dir, overrides=["resources.accelerator=L4"])
    assert one.resources.accelerator is not None and one.resources.accelerator.count == 1


def test_spec_survives_a_json_round_trip(specs_dir: Path) -> None:
    spec = load_spec(
        "gpt-small",
        specs_dir=specs_dir,
        overrides=["checkpoint.interval=10m", "retention.keep_best.metric=val_loss"],
    )
    stored = json.loads(json.dumps(spec.model_dump(mode="json")))
    assert JobSpec.model_validate(stored) == spec


def test_env_values_become_text(specs_dir: Path) -> None:
    write_spec(specs_dir, "envy", "command: python t.py\nenv:\n  THREADS: 4\n  DEBUG: true\n")
    assert load_spec("envy", specs_dir=specs_dir).env == {"THREADS": "4", "DEBUG": "true"}


def test_a_path_loads_a_file_outside_the_specs_dir(tmp_path: Path, specs_dir: Path) -> None:
    path = tmp_path / "mine.yaml"
    path.write_text("command: python mine.py\n")
    assert load_spec(path, specs_dir=specs_dir).name == "mine"
    with pytest.raises(SpecError, match="no spec file at"):
        load_spec(tmp_path / "absent.yaml", specs_dir=specs_dir)


# --- overrides ------------------------------------------------------------------------


def test_overrides_are_parsed_as_yaml_and_applied_in_order(specs_dir: Path) -> None:
    spec = load_spec(
        "gpt-small",
        specs_dir=specs_dir,
        overrides=[
            "budget.usd=800",
            "resources.spot=false",
            "resources.zones=[us-east-1a, us-east-1b]",
            "retention.keep_best.metric=val_loss",
            "retention.keep_best.mode=max",
            "command=python other.py --name 'two words'",
            "checkpoint.interval=90s",
            "max_hours=12",
            "budget.usd=900",
        ],
    )
    assert spec.budget.usd == 900.0
    assert spec.resources.spot is False
    assert spec.resources.zones == ["us-east-1a", "us-east-1b"]
    assert spec.retention.keep_best == KeepBest(metric="val_loss", mode="max", count=1)
    assert spec.command == ["python", "other.py", "--name", "two words"]
    assert spec.checkpoint.interval_s == 90.0
    assert spec.max_hours == 12.0


def test_apply_overrides_leaves_the_input_alone() -> None:
    data = {"budget": {"usd": 1}}
    merged = apply_overrides(data, ["budget.usd=2", "notify.channel=C1"])
    assert merged == {"budget": {"usd": 2}, "notify": {"channel": "C1"}}
    assert data == {"budget": {"usd": 1}}


def test_parse_spec_validates_a_mapping() -> None:
    spec = parse_spec({"command": "python t.py"}, name="inline", overrides=["budget.usd=3"])
    assert (spec.name, spec.budget.usd) == ("inline", 3.0)


# --- durations (the parser itself: tests/runner/test_duration.py) ---------------------


def test_durations_in_a_spec_are_seconds() -> None:
    spec = JobSpec.model_validate(
        {
            "name": "x",
            "command": ["python", "train.py"],
            "checkpoint": {"interval": "1h30m"},
            "resubmit": {"backoff_s": 45},
            "alerts": {"heartbeat_deadline_s": " 10M "},
        }
    )
    assert spec.checkpoint.interval_s == 5400.0
    assert spec.resubmit.backoff_s == 45.0
    assert spec.alerts.heartbeat_deadline_s == 600.0


# --- several instances: a multi-node gang -------------------------------------------


def test_several_instances_validate_in_an_override_and_a_file(specs_dir: Path) -> None:
    spec = load_spec("gpt-small", specs_dir=specs_dir, overrides=["resources.instances=4"])
    assert spec.resources.instances == 4 and spec.resources.processes_per_node is None
    write_spec(specs_dir, "pair", "command: python t.py\nresources:\n  instances: 2\n"
               "  processes_per_node: 2\n")  # fmt: skip
    pair = load_spec("pair", specs_dir=specs_dir)
    assert pair.resources.instances == 2 and pair.resources.processes_per_node == 2
    stored = pair.model_dump(mode="json")
    assert JobSpec.model_validate(stored).resources.instances == 2


def test_an_impossible_gang_is_refused_with_its_key(specs_dir: Path) -> None:
    for override, key in (
        ("resources.instances=0", "resources.instances"),
        ("resources.instances=65", "resources.instances"),
        ("resources.processes_per_node=0", "resources.processes_per_node"),
    ):
        with pytest.raises(SpecError) as caught:
            load_spec("gpt-small", specs_dir=specs_dir, overrides=[override])
        assert caught.value.key_paths == [key], override
        assert f"(from override {override!r})" in str(caught.value)


def test_one_instance_is_the_default_and_still_allowed(specs_dir: Path) -> None:
    assert load_spec("gpt-small", specs_dir=specs_dir).resources.instances == 1
    spec = load_spec("gpt-small", specs_dir=specs_dir, overrides=["resources.instances=1"])
    assert spec.resources.instances == 1
    assert "must be at least 1 (got 0)" in spec_error(
        specs_dir, overrides=("resources.instances=0",)
    )


def test_the_shipped_multi_node_spec_is_a_two_node_gang_of_the_ddp_example() -> None:
    sizes = {
        name: load_spec(name, specs_dir=SHIPPED_SPECS_DIR).resources.instances
        for name in list_specs(SHIPPED_SPECS_DIR)
    }
    assert sizes.pop("tiny-ddp") == 2 and set(sizes.values()) == {1}
    ddp = load_spec("tiny-ddp", specs_dir=SHIPPED_SPECS_DIR)
    assert ddp.command[:3] == ["python", "-m", "runner.examples.tiny_ddp"]
    assert ddp.resources.under_torchrun and ddp.resources.nproc_per_node == 1


# --- errors ---------------------------------------------------------------------------


def test_bad_value_names_the_key_path(specs_dir: Path) -> None:
    message = spec_error(specs_dir, overrides=("budget.usd=-5",))
    assert "budget.usd: must be greater than 0 (got -5)" in message
    assert "(from override 'budget.usd=-5')" in message


def test_unknown_key_in_the_file_suggests_the_closest(specs_dir: Path) -> None:
    write_spec(specs_dir, "typo", "command: python t.py\nbudgte:\n  usd: 5\n")
    with pytest.raises(SpecError) as caught:
        load_spec("typo", specs_dir=specs_dir)
    assert "unknown key 'budgte' (did you mean 'budget'?)" in str(caught.value)
    assert caught.value.key_paths == ["budgte"]
    assert str(specs_dir / "typo.yaml") in str(caught.value)


def test_unknown_nested_key_from_an_override(specs_dir: Path) -> None:
    message = spec_error(specs_dir, overrides=("budget.usdd=5",))
    assert "unknown key 'budget.usdd' (did you mean 'budget.usd'?)" in message
    assert "(from override 'budget.usdd=5')" in message


def test_unknown_key_without_a_close_match_lists_the_known_ones(specs_dir: Path) -> None:
    message = spec_error(specs_dir, overrides=("budget.zzz=1",))
    assert "unknown key 'budget.zzz'; known keys here: usd, thresholds, hard_cap" in message


@pytest.mark.parametrize(
    "section",
    ["resources", "checkpoint", "retention", "budget", "resubmit", "alerts", "notify", "dry_run"],
)
def test_every_section_rejects_unknown_keys(specs_dir: Path, section: str) -> None:
    message = spec_error(specs_dir, overrides=(f"{section}.bogus_key=1",))
    assert f"unknown key '{section}.bogus_key'" in message


def test_every_problem_is_reported_at_once(specs_dir: Path) -> None:
    with pytest.raises(SpecError) as caught:
        load_spec(
            "gpt-small",
            specs_dir=specs_dir,
            overrides=[
                "budget.usd=-5",
                "resources.accelerator=A100:x",
                "checkpoint.interval=soon",
                "resources.cloud=azure",
                "retention.keep_last=0",
            ],
        )
    assert sorted(caught.value.key_paths) == [
        "budget.usd",
        "checkpoint.interval",
        "resources.accelerator",
        "resources.cloud",
        "retention.keep_last",
    ]
    text = str(caught.value)
    assert "has 5 problems" in text
    assert "resources.cloud: expected one of 'local', 'aws' or 'gcp' (got 'azure')" in text
    assert "checkpoint.interval: expected a duration such as 90s" in text
    assert "retention.keep_last: must be at least 1 (got 0)" in text


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("resources.accelerator=A100:0", "resources.accelerator: the accelerator count must be"),
        ("resources.accelerator=A100:x", "the count after ':' must be a whole number"),
        ("resources.accelerator=:8", "expected TYPE:COUNT such as A100:8"),
        ("resources.zones=[us-west-2a]", "zone 'us-west-2a' is not in region 'us-east-1'"),
        ("budget.thresholds=[50, 0]", "thresholds are percentages from 1 to 1000"),
        ("command=", "command: is required"),
        ("command='a \"b'", "cannot split the command line"),
        ("resubmit.backoff_s=-1m", "resubmit.backoff_s: expected a duration"),
        ("alerts.low_util_percent=140", "alerts.low_util_percent: must be at most 100 (got 140)"),
        ("retention.keep_best.mode=median", "expected one of 'min' or 'max'"),
        ("retention.keep_best.mode=max", "retention.keep_best.metric: is required"),
        ("env.A=[1]", "env.A: expected text"),
        ("budget.thresholds=[50, x]", "budget.thresholds[1]: expected a whole number"),
    ],
)
def test_bad_values(specs_dir: Path, override: str, expected: str) -> None:
    assert expected in spec_error(specs_dir, overrides=(override,))


def test_missing_command(specs_dir: Path) -> None:
    write_spec(specs_dir, "nocmd", "budget:\n  usd: 5\n")
    assert "command: is required" in spec_error(specs_dir, "nocmd")


def test_unknown_spec_suggests_the_closest_and_lists_the_rest(specs_dir: Path) -> None:
    write_spec(specs_dir, "tiny", "command: python t.py\n")
    message = spec_error(specs_dir, "gpt-smal")
    assert "no spec named 'gpt-smal'" in message
    assert "Did you mean 'gpt-small'?" in message
    assert "Available: gpt-small, tiny." in message
    assert "Did you mean" not in spec_error(specs_dir, "zzzzzz")


@pytest.mark.parametrize("name", ["../gpt-small", "/etc/passwd", "a/b", ""])
def test_names_are_never_paths(specs_dir: Path, name: str) -> None:
    assert "is not a spec name" in spec_error(specs_dir, name)


def test_missing_specs_dir_says_which_variable(tmp_path: Path) -> None:
    assert "TRAINBOT_SPECS_DIR" in spec_error(tmp_path / "nowhere", "tiny")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("command: [python\n", "is not valid YAML at line"),
        ("", "is empty"),
        ("- python\n- t.py\n", "must be a mapping of keys to values, not list"),
        ("command: a\nbudget:\n  usd: 1\nbudget:\n  usd: 2\n", "duplicate key 'budget' on line 4"),
    ],
)
def test_malformed_files(specs_dir: Path, text: str, expected: str) -> None:
    write_spec(specs_dir, "broken", text)
    message = spec_error(specs_dir, "broken")
    assert expected in message
    assert "broken.yaml" in message


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("budget.usd", "is not key.path=value: write it like budget.usd=800"),
        ("=5", "is not key.path=value"),
        ("budget..usd=5", "is not key.path=value"),
        ("budget.usd=[1", "the value is not valid YAML"),
        ("command.program=python", "command is a value, not a section"),
        ("budget.usd.cents=5", "budget.usd is a value, not a section"),
    ],
)
def test_malformed_overrides(specs_dir: Path, override: str, expected: str) -> None:
    message = spec_error(specs_dir, overrides=(override,))
    assert expected in message
    assert repr(override) in message


def test_spec_error_is_a_trainbot_error() -> None:
    assert issubclass(SpecError, TrainbotError)


# --- hostile input: aliases, size, quoted values --------------------------------------


def alias_bomb(levels: int = 9) -> str:
    """The reported override: each level lists the one before nine times (9**levels)."""
    lists = ["&l0 [x,x,x,x,x,x,x,x,x]"]
    lists += [f"&l{i} [{','.join([f'*l{i - 1}'] * 9)}]" for i in range(1, levels)]
    return f"notify.oncall_group=[{', '.join(lists)}]"


def test_an_alias_bomb_override_is_refused_before_it_expands(specs_dir: Path) -> None:
    bomb = alias_bomb()
    assert len(bomb) < 400
    message = spec_error(specs_dir, overrides=(bomb,))
    assert "aliases (*name) are not allowed in overrides: write the value out" in message
    assert len(message) < 1024


@pytest.mark.parametrize(
    "override",
    ["notify.channel=*x", "notify.channel=&x C1", "budget.thresholds=[&a 50, *a]"],
)
def test_anchors_and_aliases_are_refused_in_overrides(specs_dir: Path, override: str) -> None:
    assert "aliases (*name) are not allowed in overrides" in spec_error(
        specs_dir, overrides=(override,)
    )


def test_anchors_and_aliases_are_refused_in_spec_files(specs_dir: Path) -> None:
    write_spec(
        specs_dir,
        "aliased",
        "command: python t.py\nresources: &r\n  cloud: local\nnotify:\n  channel: *r\n",
    )
    message = spec_error(specs_dir, "aliased")
    assert "aliases (*name) are not allowed in a spec file" in message
    assert "aliased.yaml" in message


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("notify.channel=" + "x" * 1_000_000, "is too long"),
        ("budget.thresholds=[" + ",".join(["1"] * 100_000) + "]", "is too long"),
        ("budget.thresholds=[" + ",".join(["1"] * 20_000) + "]", "more than 10,000 items"),
        ("budget.usd=" + "[" * 5_000 + "]" * 5_000, "nested more than"),
    ],
    ids=["1MB-string", "100k-list", "20k-list", "deep"],
)
def test_a_huge_value_is_refused_with_a_short_message(
    specs_dir: Path, override: str, expected: str
) -> None:
    message = spec_error(specs_dir, overrides=(override,))
    assert expected in message
    assert len(message) < 1024


@pytest.mark.parametrize(
    "override",
    ["budget.thresholds=[" + "9" * 5_000 + "]", "budget.usd=2024-02-30"],
    ids=["int-past-digit-limit", "impossible-date"],
)
def test_a_scalar_python_cannot_hold_is_a_spec_error(specs_dir: Path, override: str) -> None:
    message = spec_error(specs_dir, overrides=(override,))
    assert "the value is not valid YAML" in message
    assert len(message) < 1024


def test_validation_errors_quote_clipped_values(specs_dir: Path) -> None:
    long_list = "[" + ",".join(["x"] * 5_000) + "]"
    message = spec_error(
        specs_dir,
        overrides=(
            "resources.cloud=" + "a" * 5_000,
            "checkpoint.interval=" + "soon" * 1_000,
            f"max_hours={long_list}",
            f"env.A={long_list}",
        ),
    )
    assert "resources.cloud: expected one of 'local', 'aws' or 'gcp' (got 'aaaa" in message
    assert "… (5000 characters)" in message
    assert "checkpoint.interval: expected a duration" in message
    assert "… (4000 characters)" in message
    assert "max_hours: expected a number (got ['x', 'x'" in message
    assert "… (5000 items)" in message
    # An env value may be a credential: it is never quoted back.
    assert "env.A: expected text (from override 'env.A=…')" in message
    assert len(message) < 2048


def test_many_problems_are_counted_not_all_listed(specs_dir: Path) -> None:
    override = "budget.thresholds=[" + ",".join(["x"] * 5_000) + "]"
    with pytest.raises(SpecError) as caught:
        load_spec("gpt-small", specs_dir=specs_dir, overrides=[override])
    assert len(caught.value.problems) == 5_000
    assert "has 5000 problems" in str(caught.value)
    assert "and 4990 more" in str(caught.value)
    assert len(str(caught.value)) < 4096


def test_a_long_unknown_key_is_clipped(specs_dir: Path) -> None:
    message = spec_error(specs_dir, overrides=("k" * 50_000 + "=1",))
    assert "unknown key 'kkkk" in message and "… (50000 characters)" in message
    assert len(message) < 1024


# --- env -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["TRAINBOT_CHECKPOINT_PREFIX", "TRAINBOT_TOKEN", "trainbot_run_id"]
)
def test_trainbot_env_is_reserved(specs_dir: Path, name: str) -> None:
    with pytest.raises(SpecError) as caught:
        load_spec("gpt-small", specs_dir=specs_dir, overrides=[f"env.{name}=x"])
    assert caught.value.key_paths == [f"env.{name}"]
    assert f"env.{name}: is reserved" in str(caught.value)
    assert f"(from override 'env.{name}=…')" in str(caught.value)


def test_trainbot_env_is_reserved_in_spec_files(specs_dir: Path) -> None:
    write_spec(specs_dir, "sneaky", "command: python t.py\nenv:\n  TRAINBOT_TOKEN: stolen\n")
    assert "env.TRAINBOT_TOKEN: is reserved" in spec_error(specs_dir, "sneaky")


def test_a_stored_spec_with_trainbot_env_still_loads() -> None:
    # A resubmit stores TRAINBOT_CHECKPOINT_PREFIX in the new run's spec itself.
    stored = parse_spec({"command": "python t.py"}, name="t").model_dump(mode="json")
    stored["env"] = {"TRAINBOT_CHECKPOINT_PREFIX": "r-old"}
    assert JobSpec.model_validate(stored).env == {"TRAINBOT_CHECKPOINT_PREFIX": "r-old"}


@pytest.mark.parametrize("name", ["bad-name", "1ABC", "A B", "é"])
def test_env_names_are_shell_identifiers(specs_dir: Path, name: str) -> None:
    message = spec_error(specs_dir, overrides=(f"env.{name}=x",))
    assert "is not an environment variable name" in message


def test_env_values_hold_no_nul(specs_dir: Path) -> None:
    message = spec_error(specs_dir, overrides=('env.A="a\\0b"',))
    assert "env.A: contains a NUL byte" in message


def test_a_plain_env_override_works(specs_dir: Path) -> None:
    spec = load_spec("gpt-small", specs_dir=specs_dir, overrides=["env.GOOD=x", "env._B2=7"])
    assert spec.env == {"GOOD": "x", "_B2": "7"}


def test_shipped_specs_set_only_tunable_trainbot_env() -> None:
    for name in list_specs(SHIPPED_SPECS_DIR):
        env = load_spec(name, specs_dir=SHIPPED_SPECS_DIR).env
        assert {key for key in env if key.startswith("TRAINBOT_")} <= TUNABLE_ENV
