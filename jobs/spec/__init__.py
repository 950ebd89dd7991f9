"""Job specs: one YAML file per kind of run, overridable inline (``budget.usd=800``).

A spec is one pydantic model (:class:`JobSpec`) with defaults for everything but the
command; unknown keys are errors. Why it is read and checked as it is: docs/architecture.md,
"Job specs".
"""

from jobs.spec.env import RESERVED_ENV_PREFIX, TUNABLE_ENV
from jobs.spec.load import list_specs, load_spec, parse_spec, spec_from_text, stored_section
from jobs.spec.model import JobSpec
from jobs.spec.overrides import apply_overrides
from jobs.spec.sections import (
    Accelerator,
    AlertThresholds,
    BudgetPolicy,
    CheckpointPolicy,
    Code,
    Debug,
    DryRun,
    KeepBest,
    Notify,
    Profile,
    Resources,
    ResubmitPolicy,
    Retention,
    SetupCache,
)
from jobs.spec.strict_yaml import (
    MAX_OVERRIDE_CHARS,
    MAX_OVERRIDE_NODES,
    MAX_SPEC_FILE_CHARS,
    MAX_SPEC_FILE_NODES,
    MAX_YAML_DEPTH,
)

__all__ = [
    "MAX_OVERRIDE_CHARS",
    "MAX_OVERRIDE_NODES",
    "MAX_SPEC_FILE_CHARS",
    "MAX_SPEC_FILE_NODES",
    "MAX_YAML_DEPTH",
    "RESERVED_ENV_PREFIX",
    "TUNABLE_ENV",
    "Accelerator",
    "AlertThresholds",
    "BudgetPolicy",
    "CheckpointPolicy",
    "Code",
    "Debug",
    "DryRun",
    "JobSpec",
    "KeepBest",
    "Notify",
    "Profile",
    "Resources",
    "ResubmitPolicy",
    "Retention",
    "SetupCache",
    "apply_overrides",
    "list_specs",
    "load_spec",
    "parse_spec",
    "spec_from_text",
    "stored_section",
]
