"""Secret settings read from files, as Kubernetes and compose hand them to a process.

A platform mounts secrets as files (a Kubernetes Secret volume, compose's ``secrets:`` under
``/run/secrets``) rather than putting them in the environment, where ``env``, ``ps e``,
crash reports and child processes all see them. For each secret setting ``TRAINBOT_X``:

- ``TRAINBOT_X_FILE=/path``: the value is the file's content, without its trailing newline
  (what ``echo`` and ``kubectl create secret --from-file`` leave).
- ``TRAINBOT_SECRETS_DIR=/dir``: a file in it named after the setting (``slack_bot_token``,
  ``slack-bot-token`` or ``TRAINBOT_SLACK_BOT_TOKEN``) gives the value, unless the
  variable or its ``_FILE`` is set: explicit beats the directory.

Setting both ``TRAINBOT_X`` and ``TRAINBOT_X_FILE`` is refused (which one wins would be a
guess), and so is a named file that is missing, unreadable or empty: each problem is one
line that names the variable, the path and what to do.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

__all__ = ["FILE_SUFFIX", "SECRETS_DIR_VARIABLE", "read_secret_files"]

#: ``TRAINBOT_X`` + this names the file that holds ``TRAINBOT_X``'s value.
FILE_SUFFIX = "_FILE"
#: The directory of secret files, one per setting.
SECRETS_DIR_VARIABLE = "TRAINBOT_SECRETS_DIR"


def read_secret_files(
    environ: Mapping[str, str], variables: Iterable[str]
) -> tuple[dict[str, str], list[str]]:
    """The values of ``variables`` (upper-case names) that files give, and the problems.

    ``environ`` has upper-case keys. A variable already set in ``environ`` (non-empty)
    keeps its value and is not in the answer.
    """
    values: dict[str, str] = {}
    problems: list[str] = []
    directory = _secrets_dir(environ, problems)
    for variable in variables:
        direct = environ.get(variable) or ""
        named = environ.get(variable + FILE_SUFFIX) or ""
        if named and direct:
            problems.append(
                f"{variable} and {variable}{FILE_SUFFIX} are both set: keep one (the file, "
                f"so that the value stays out of the environment)"
            )
            continue
        if named:
            value = _read(Path(named), f"{variable}{FILE_SUFFIX}={named}", problems)
            if value is not None:
                values[variable] = value
            continue
        if direct or directory is None:
            continue
        found = _in_directory(directory, variable)
        if found is not None:
            shown = f"{variable} (from {SECRETS_DIR_VARIABLE}: {found})"
            value = _read(found, shown, problems)
            if value is not None:
                values[variable] = value
    return values, problems


def _secrets_dir(environ: Mapping[str, str], problems: list[str]) -> Path | None:
    raw = environ.get(SECRETS_DIR_VARIABLE) or ""
    if not raw:
        return None
    directory = Path(raw)
    if not directory.is_dir():
        problems.append(
            f"{SECRETS_DIR_VARIABLE}={raw}: no such directory; mount the secrets there "
            f"or unset the variable"
        )
        return None
    return directory


def _in_directory(directory: Path, variable: str) -> Path | None:
    field = variable.removeprefix("TRAINBOT_").lower()
    for name in (field, field.replace("_", "-"), variable):
        candidate = directory / name
        if candidate.exists():
            return candidate
    return None


def _read(path: Path, shown: str, problems: list[str]) -> str | None:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        problems.append(f"{shown}: no such file; mount the secret there or unset the variable")
        return None
    except IsADirectoryError:
        problems.append(f"{shown}: is a directory; name the file that holds the value")
        return None
    except PermissionError:
        problems.append(
            f"{shown}: cannot be read by this process (permission denied); make it "
            f"readable by the user trainbot runs as (uid 10001 in the image)"
        )
        return None
    except (OSError, UnicodeDecodeError) as exc:
        problems.append(f"{shown}: cannot be read ({type(exc).__name__}); check the mount")
        return None
    value = text.rstrip("\r\n")
    if not value:
        problems.append(f"{shown}: the file is empty; put the value in it")
        return None
    return value
