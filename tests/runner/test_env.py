"""The runner's environment contract (runner.env): every variable renders and parses
back, a bad value names its variable and what it expects, and no ``TRAINBOT_*`` read in
runner/ or jobs/ escapes the contract."""

from __future__ import annotations

import io
import itertools
import re
import subprocess
import sys
import tokenize
from pathlib import Path
from typing import Any

import pytest

from runner import env as contract
from runner.env import VARS, EnvError, Var
from tests.paths import ROOT

#: A value of each kind that its rendering carries exactly.
_SAMPLES: dict[int, list[Any]] = {
    id(contract.TEXT): ["r-1", "a value with spaces, = and 'quotes'"],
    id(contract.URL): ["https://cp.example:8443/v1/events", "http://127.0.0.1:1"],
    id(contract.PATH): [Path("/var/lib/trainbot/scratch"), Path("rel dir/x.jsonl")],
    id(contract.SECONDS): [120.0, 0.25, 30],
    id(contract.RATE): [123456789.0],
    id(contract.COUNT): [1, 7],
    id(contract.INDEX): [0, 3],
    id(contract.PORT): [1, 29500, 65535],
    id(contract.FLAG): [True, False],
    id(contract.WORDS): [["pip install -r requirements.txt", "echo 'a b' > c"], []],
    id(contract.COMMIT): ["0123456789abcdef0123456789abcdef01234567"],
    id(contract.NAMES): [{"WANDB_API_KEY": "aws-sm://trainbot/wandb", "B": "local://b"}, {}],
}
#: The variables with a kind of their own (a choice of words).
_CHOICES = {
    "TRAINBOT_STORE_CREDENTIALS": ["broker", "default"],
    "TRAINBOT_DRY_RUN_PHASE": ["save", "verify"],
}


def _samples(var: Var[Any, Any]) -> list[Any]:
    return _CHOICES.get(var.name) or _SAMPLES[id(var.kind)]


def test_every_declared_variable_is_trainbots_and_documented() -> None:
    assert len(VARS) >= 39
    for name, var in VARS.items():
        assert re.fullmatch(r"TRAINBOT_[A-Z0-9_]+", name), name
        assert var.doc and "\n" not in var.doc, name
        assert var.name in _CHOICES or id(var.kind) in _SAMPLES, f"{name}: add its kind's samples"
    # A spec's env may set only what tunes the run itself (jobs.spec.env.TUNABLE_ENV).
    assert {n for n, v in VARS.items() if v.tunable} == {"TRAINBOT_SYSTEM_SAMPLE_S"}


@pytest.mark.parametrize("name", sorted(VARS))
def test_each_variable_renders_and_parses_back(name: str) -> None:
    var = VARS[name]
    for value in _samples(var):
        text = var.render(value)
        assert isinstance(text, str)
        assert var.get({name: text}) == value, (value, text)
        assert contract.render({var: value}) == {name: text}


def test_all_variables_at_once_round_trip_and_an_empty_environment_gives_the_defaults() -> None:
    values = {var: _samples(var)[-1] for var in VARS.values()}
    rendered = contract.render(values)
    assert set(rendered) == set(VARS)
    assert contract.parse(rendered) == {var.name: value for var, value in values.items()}
    assert contract.parse({}) == {name: var.default for name, var in VARS.items()}
    # A blank variable is an unset one.
    assert contract.parse({name: "  " for name in VARS}) == contract.parse({})


def test_none_is_not_sent_and_the_required_ones_are_named() -> None:
    assert contract.render({contract.RUN_ID: "r-1", contract.INGEST_URL: None}) == {
        "TRAINBOT_RUN_ID": "r-1"
    }
    assert contract.missing_required({"TRAINBOT_RUN_ID": "r-1", "TRAINBOT_TOKEN": " "}) == [
        "TRAINBOT_ATTEMPT_ID",
        "TRAINBOT_TOKEN",
        "TRAINBOT_CHECKPOINT_URI",
    ]


def test_rounded_numbers_keep_the_texts_the_runner_has_always_been_sent() -> None:
    assert contract.CHECKPOINT_INTERVAL_S.render(600.0) == "600.000"
    assert contract.MEASURED_WRITE_BPS.render(2.5e8) == "250000000"
    assert contract.MEASURED_STALL_S.render(0.0125) == "0.012500"
    assert contract.TERMINATION_WINDOW_S.render(120.0) == "120"
    assert contract.TRAIN_THROUGH_NOTICE.render(True) == "1"


@pytest.mark.parametrize(
    ("var", "raw", "message"),
    [
        (
            contract.CHECKPOINT_INTERVAL_S,
            "abc",
            "TRAINBOT_CHECKPOINT_INTERVAL_S='abc': expected a positive number of seconds",
        ),
        (
            contract.TERMINATION_WINDOW_S,
            "-5",
            "TRAINBOT_TERMINATION_WINDOW_S='-5': expected a positive number of seconds",
        ),
        (
            contract.MEASURED_STALL_S,
            "nan",
            "TRAINBOT_MEASURED_STALL_S='nan': expected a positive number of seconds",
        ),
        (contract.MEASURED_WRITE_BPS, "0", "TRAINBOT_MEASURED_WRITE_BPS='0': expected a positive"),
        (contract.NNODES, "two", "TRAINBOT_NNODES='two': expected a whole number"),
        (contract.METRICS_EVERY, "2.5", "TRAINBOT_METRICS_EVERY='2.5': expected a whole number"),
        (contract.NPROC_PER_NODE, "0", "TRAINBOT_NPROC_PER_NODE='0': expected 1 or more"),
        (contract.NODE_RANK, "-1", "TRAINBOT_NODE_RANK='-1': expected 0 or more"),
        (contract.MASTER_PORT, "70000", "TRAINBOT_MASTER_PORT='70000': expected 65535 or less"),
        (contract.TORCHRUN, "maybe", "TRAINBOT_TORCHRUN='maybe': expected 1 or 0 (true or false)"),
        (
            contract.INGEST_URL,
            "cp.example/v1/events",
            "TRAINBOT_INGEST_URL='cp.example/v1/events': expected an http:// or https:// URL",
        ),
        (
            contract.AWS_METADATA_URL,
            "ftp://example",
            "TRAINBOT_AWS_METADATA_URL='ftp://example': expected an http:// or https:// URL",
        ),
        (
            contract.DRY_RUN_PHASE,
            "later",
            "TRAINBOT_DRY_RUN_PHASE='later': expected 'save' or 'verify'",
        ),
    ],
)
def test_a_bad_value_names_the_variable_and_what_it_expects(
    var: Var[Any, Any], raw: str, message: str
) -> None:
    with pytest.raises(EnvError) as refused:
        var.get({var.name: raw})
    assert str(refused.value).startswith(message)


@pytest.mark.parametrize(
    "name", sorted(n for n, v in VARS.items() if v.kind.parse not in (str, Path))
)
def test_every_checked_variable_refuses_nonsense(name: str) -> None:
    with pytest.raises(EnvError, match=rf"^{name}='\?!': expected "):
        VARS[name].get({name: "?!"})


@pytest.mark.parametrize(
    ("var", "value", "words"),
    [
        (contract.TERMINATION_WINDOW_S, "120", "cannot send '120' (str)"),
        (contract.METRICS_EVERY, True, "cannot send True (bool)"),
        (contract.RESUME_MAX_STEP, 0, "TRAINBOT_RESUME_MAX_STEP='0': expected 1 or more"),
        (contract.CHECKPOINT_INTERVAL_S, 0.0001, "'0.000': expected a positive number"),
        (contract.INGEST_URL, "localhost:8080", "expected an http:// or https:// URL"),
    ],
)
def test_the_control_plane_cannot_send_what_the_runner_would_refuse(
    var: Var[Any, Any], value: Any, words: str
) -> None:
    with pytest.raises(EnvError, match=re.escape(words)):
        contract.render({var: value})


def test_the_contract_imports_the_standard_library_only() -> None:
    """The runner reads it before torch, and the control plane imports it too."""
    probe = (
        "import sys; before = set(sys.modules); import runner.env; "
        "print(sorted({m.split('.')[0] for m in set(sys.modules) - before} "
        "- set(sys.stdlib_module_names)))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "['runner']"


def test_the_termination_window_is_the_variable_else_the_sources_else_the_shortest() -> None:
    assert contract.TERMINATION_WINDOWS_S == {"aws": 120.0, "gcp": 30.0}
    assert contract.DEFAULT_TERMINATION_WINDOW_S == 30.0
    assert contract.termination_window_s({}) == 30.0
    assert contract.termination_window_s({}, source="aws") == 120.0
    window = {"TRAINBOT_TERMINATION_WINDOW_S": "7.5"}
    assert contract.termination_window_s(window, source="aws") == 7.5


# --- no read outside the contract -------------------------------------------------------

#: ``X.get("TRAINBOT_…")``, ``X.pop(…)``, ``X["TRAINBOT_…"]`` and ``getenv("TRAINBOT_…")``
#: where X is an environment (``os.environ``, ``env``, ``self.env``, ``req.env``, ``e``…).
_READ = re.compile(
    r"""(?P<receiver>[A-Za-z_][\w.]*?)\s*(?:\.(?:get|pop|setdefault)\(|\[|\()\s*"""
    r"""["'](?P<name>TRAINBOT_[A-Z0-9_]+)["']"""
)
_ENVIRONMENTS = re.compile(r"(?:^|\.)(?:environ|\w*env|e|getenv)$")

_MAYBE_KEYWORD = re.compile(r"[(,]\s*TRAINBOT_[A-Z0-9_]+\s*=[^=]")


def _keywords(text: str) -> list[tuple[int, str]]:
    """(line, name) of each keyword that sets one: ``dict(TRAINBOT_RUN_ID=…)``,
    ``env.update(TRAINBOT_…=…)`` (tokens, so a message's ``NAME=value`` is no keyword)."""
    if not _MAYBE_KEYWORD.search(text):
        return []  # tokenizing every file is slow
    tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    return [
        (token.start[0], token.string)
        for token, after in itertools.pairwise(tokens)
        if token.type == tokenize.NAME
        and token.string.startswith("TRAINBOT_")
        and after.exact_type == tokenize.EQUAL
    ]


def undeclared_reads(root: Path, packages: tuple[str, ...]) -> list[str]:
    """``path:line: NAME`` for each runner variable read (or set) in ``packages`` that
    the contract does not declare. In jobs/ the control plane's own settings (read from
    ``os.environ`` by jobs.process.settings) are not the runner's and are left out."""
    found = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            if path == root / "runner" / "env.py":
                continue
            text = path.read_text(encoding="utf-8")
            uses = _keywords(text)
            for match in _READ.finditer(text):
                receiver = match["receiver"]
                if not _ENVIRONMENTS.search(receiver):
                    continue
                if package != "runner" and receiver in ("os.environ", "os.getenv"):
                    continue
                uses.append((text.count("\n", 0, match.start()) + 1, match["name"]))
            where = path.relative_to(root)
            found += [f"{where}:{line}: {name}" for line, name in sorted(uses) if name not in VARS]
    return found


def test_every_trainbot_variable_read_by_the_runner_is_declared() -> None:
    assert undeclared_reads(ROOT, ("runner", "jobs")) == []


def test_the_scan_finds_an_undeclared_read(tmp_path: Path) -> None:
    """The check above can fail: each shape of read of an undeclared name is found."""
    (tmp_path / "runner").mkdir()
    (tmp_path / "jobs").mkdir()
    (tmp_path / "runner" / "new.py").write_text(
        "import os\n"
        'a = os.environ.get("TRAINBOT_NOT_DECLARED")\n'
        'b = env["TRAINBOT_ALSO_NOT"]\n'
        'c = os.getenv("TRAINBOT_NOR_THIS", "")\n'
        'd = os.environ.get("TRAINBOT_RUN_ID")\n'  # declared
        'e = f"TRAINBOT_NODE_RANK={1}: in a message"\n'  # not a read
    )
    (tmp_path / "jobs" / "launch.py").write_text(
        'env = dict(spec_env, TRAINBOT_UNKNOWN_TO_RUNNER="1")\n'
        'req.env.get("TRAINBOT_NOT_EITHER")\n'
        'os.environ.get("TRAINBOT_AWS_REGION")\n'  # the control plane's own setting
    )
    assert undeclared_reads(tmp_path, ("runner", "jobs")) == [
        "runner/new.py:2: TRAINBOT_NOT_DECLARED",
        "runner/new.py:3: TRAINBOT_ALSO_NOT",
        "runner/new.py:4: TRAINBOT_NOR_THIS",
        "jobs/launch.py:1: TRAINBOT_UNKNOWN_TO_RUNNER",
        "jobs/launch.py:2: TRAINBOT_NOT_EITHER",
    ]
