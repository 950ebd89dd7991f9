"""Install trainbot's runner on an instance, pinned to the control plane's own version.

Run as root by the boot scripts (deploy/aws/user-data.sh, deploy/gcp/startup-script.sh)
with the image's python, so the standard library only:

    python3 runner-install.py CONFIG VENV

CONFIG is the JSON the control plane rendered (jobs/providers/runner_install.py):
``{"mode": "wheel" | "index", "package": "trainbot", "version": "0.1.0",
"index_url": "", "wheel": {"url": "https://CONTROL-PLANE/v1/runner-wheel?sha256=…",
"sha256": "…", "size": N, "file": "trainbot-0.1.0-py3-none-any.whl", "token_from":
"env-file" | "gce-metadata"}}``. VENV is made from this python and sees its packages (a
``.pth``), so a torch the image already has is used as it is; torch is installed only
when it lacks one.

In ``wheel`` mode the wheel comes from the control plane itself, the one the runner
reports to, with the attempt's runner token as its bearer: read from the boot script's
root-only environment file (``env-file``: the file TRAINBOT_RUNNER_ENV_FILE names) or
from the instance's ``trainbot-env`` metadata (``gce-metadata``), never printed. Its
sha256 must be the one in CONFIG; pip needs no index for trainbot, and the instance no
access to any bucket. ``index`` installs ``trainbot==VERSION`` from ``index_url`` (pip's
own index when empty). Nothing here is read from a spec.

TRAINBOT_GCE_METADATA_URL is unset on a real instance; tests point it at a local fake.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import site
import subprocess
import sys
import time
import urllib.error
import urllib.request

GCE_METADATA = os.environ.get("TRAINBOT_GCE_METADATA_URL") or "http://metadata.google.internal"
TOKEN_NAME = "TRAINBOT_TOKEN"
#: Tries of the wheel's download, and the longest wait between two (seconds).
TRIES = 8
MAX_WAIT_S = 30
CHUNK = 64 * 1024


def say(text: str) -> None:
    print(f"trainbot: {text}", flush=True)


class Refused(Exception):
    """An answer no retry changes (a refused token, a wheel of another digest)."""


def runner_token(source: str) -> str:
    """The attempt's token, from where the boot script keeps the runner's environment."""
    if source == "env-file":
        path = os.environ.get("TRAINBOT_RUNNER_ENV_FILE", "")
        with open(path, encoding="utf-8") as f:
            for line in f:
                name, _, value = line.rstrip("\n").partition("=")
                if name == TOKEN_NAME:
                    return "".join(shlex.split(value))
    elif source == "gce-metadata":
        request = urllib.request.Request(
            f"{GCE_METADATA}/computeMetadata/v1/instance/attributes/trainbot-env",
            headers={"Metadata-Flavor": "Google"},
        )
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(request, timeout=30) as answer:
            token = json.loads(answer.read()).get(TOKEN_NAME)
        if token:
            return str(token)
    raise Refused(f"the runner's environment ({source}) holds no {TOKEN_NAME}")


def download(wheel: dict, token: str, path: str) -> None:
    """One try: the wheel into ``path``, whole and of the expected sha256."""
    request = urllib.request.Request(wheel["url"], headers={"Authorization": f"Bearer {token}"})
    digest = hashlib.sha256()
    got = 0
    try:
        with urllib.request.urlopen(request, timeout=60) as answer, open(path, "wb") as f:
            while True:
                chunk = answer.read(CHUNK)
                if not chunk:
                    break
                digest.update(chunk)
                f.write(chunk)
                got += len(chunk)
    except urllib.error.HTTPError as exc:
        if exc.code in (401, 403):
            try:
                why = json.loads(exc.read()).get("error", "")
            except (OSError, ValueError):
                why = ""
            raise Refused(
                f"the control plane refused this instance's token (HTTP {exc.code}: {why}): "
                "its attempt has ended, or the token is not the one the control plane gave it"
            ) from None
        raise
    if got != wheel["size"]:
        raise OSError(f"the download ended after {got} of {wheel['size']} bytes")
    if digest.hexdigest() != wheel["sha256"]:
        raise Refused(
            f"the wheel received has sha256 {digest.hexdigest()}, not {wheel['sha256']} "
            "that the control plane wrote into this boot script: refusing it"
        )


def fetch_wheel(wheel: dict, into: str) -> str:
    """Download the control plane's wheel, check its sha256, and keep it under its
    wheel name (pip reads the version from the file name); its path."""
    url = wheel["url"].split("?", 1)[0]
    path = os.path.join(into, os.path.basename(wheel["file"]))
    say(f"fetching the runner wheel from {url}")
    try:
        token = runner_token(wheel["token_from"])
        for attempt in range(TRIES):
            try:
                download(wheel, token, path)
                return path
            except OSError as exc:  # HTTPError (5xx, 404 from a replica of another build)
                if attempt == TRIES - 1:
                    raise
                wait = min(2**attempt, MAX_WAIT_S)
                say(f"the runner wheel: {exc}; trying again in {wait} s")
                time.sleep(wait)
    except Refused as exc:
        why = str(exc)
    except (OSError, KeyError, ValueError) as exc:
        why = (
            f"{exc} (after {TRIES} tries): the instance must reach the control plane at "
            "that URL (TRAINBOT_PUBLIC_URL), which serves the wheel while its attempt lives"
        )
    raise SystemExit(
        f"trainbot: could not get the runner wheel from {url}: {why}; or set the "
        "provider's runner install to index or image"
    )


def make_venv(venv: str) -> str:
    """A venv of this python that also sees this python's own packages (the image's
    torch, CUDA libraries …) behind its own; its python."""
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    own = os.path.join(venv, "lib", version, "site-packages")
    image = [p for p in site.getsitepackages() if os.path.isdir(p)]
    with open(os.path.join(own, "trainbot-image-packages.pth"), "w") as f:
        f.write("".join(f"{p}\n" for p in image))
    return os.path.join(venv, "bin", "python")


def has_torch(python: str) -> bool:
    """Whether ``python`` finds torch (found, not imported: importing costs seconds)."""
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)"
    return subprocess.run([python, "-c", probe], check=False).returncode == 0


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: python3 runner-install.py CONFIG VENV", file=sys.stderr)
        return 2
    with open(argv[1], encoding="utf-8") as f:
        config = json.load(f)
    venv = argv[2]
    mode = config["mode"]
    if mode not in ("wheel", "index"):
        raise SystemExit(f"trainbot: unknown runner install mode {mode!r}")
    # The wheel first: a refused token or a wrong wheel fails before the venv is made.
    if mode == "wheel":
        wheel = fetch_wheel(config["wheel"], os.path.dirname(os.path.abspath(argv[1])))
    python = make_venv(venv)
    extra = "" if has_torch(python) else "[torch]"
    say("the image has torch" if not extra else "the image has no torch: installing it too")
    if mode == "wheel":
        alone, target = wheel, wheel + extra
    else:
        alone = f"{config['package']}=={config['version']}"
        target = f"{config['package']}{extra}=={config['version']}"
    pip = [python, "-m", "pip", "install", "--disable-pip-version-check", "--no-input", "--quiet"]
    if config.get("index_url"):
        pip += ["--index-url", config["index_url"]]
    # First trainbot itself, into the venv even where the image's packages hold a copy;
    # then what it needs that the image lacks (torch among them when it has none).
    say(f"installing {os.path.basename(target)}")
    first = subprocess.run([*pip, "--no-deps", "--ignore-installed", alone], check=False)
    if first.returncode != 0:
        return first.returncode
    return subprocess.run([*pip, target], check=False).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv))
