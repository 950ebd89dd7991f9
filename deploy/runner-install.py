"""Install trainbot's runner on an instance, pinned to the control plane's own version.

Run as root by the boot scripts (deploy/aws/user-data.sh, deploy/gcp/startup-script.sh)
with the image's python, so the standard library only:

    python3 runner-install.py CONFIG VENV

CONFIG is the JSON the control plane rendered (jobs/providers/runner_install.py):
``{"mode": "wheel" | "index", "package": "trainbot", "version": "0.1.0",
"index_url": "", "wheel": {"uri": "s3://…" or "gs://…", "sha256": "…", "file": "…",
"region": "…"}}``. VENV is made from this python and sees its packages (a ``.pth``), so a
torch the image already has is used as it is; torch is installed only when it lacks one.
In ``wheel`` mode the wheel comes from the run's bucket with the instance's own
credentials (IMDSv2 role credentials and SigV4 on AWS, the metadata server's token on
GCP) and pip needs no index for trainbot; ``index`` installs ``trainbot==VERSION`` from
``index_url`` (pip's own index when empty). Nothing here is read from a spec.

The TRAINBOT_BOOT_* variables and TRAINBOT_GCE_METADATA_URL are unset on a real
instance; tests point them at local fakes.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import json
import os
import site
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

IMDS = os.environ.get("TRAINBOT_BOOT_IMDS_URL") or "http://169.254.169.254"
GCE_METADATA = os.environ.get("TRAINBOT_GCE_METADATA_URL") or "http://metadata.google.internal"
S3_ENDPOINT = os.environ.get("TRAINBOT_BOOT_S3_ENDPOINT", "")
GCS_ENDPOINT = os.environ.get("TRAINBOT_BOOT_GCS_ENDPOINT") or "https://storage.googleapis.com"
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def say(text: str) -> None:
    print(f"trainbot: {text}", flush=True)


def _open(request: urllib.request.Request, *, direct: bool = False, tries: int = 4) -> bytes:
    """The body of ``request``, tried again on a network error or a 5xx (an instance's
    network and metadata service can lag its boot by a few seconds)."""
    for attempt in range(tries):
        try:
            opener = _DIRECT if direct else urllib.request.build_opener()
            with opener.open(request, timeout=60) as answer:
                return bytes(answer.read())
        except urllib.error.HTTPError as exc:
            if exc.code < 500 or attempt == tries - 1:
                raise
        except OSError:
            if attempt == tries - 1:
                raise
        time.sleep(2**attempt)
    raise AssertionError("unreachable")


# -- AWS: the instance profile's credentials, and SigV4 for one S3 GET ---------------------


def aws_credentials() -> dict[str, str]:
    """The instance role's credentials from IMDSv2."""
    token = _open(
        urllib.request.Request(
            f"{IMDS}/latest/api/token",
            method="PUT",
            headers={"X-aws-ec2-metadata-token-ttl-seconds": "300"},
        ),
        direct=True,
    ).decode()
    headers = {"X-aws-ec2-metadata-token": token}
    base = f"{IMDS}/latest/meta-data/iam/security-credentials/"
    role = _open(urllib.request.Request(base, headers=headers), direct=True).decode().split()[0]
    found = json.loads(_open(urllib.request.Request(base + role, headers=headers), direct=True))
    return {
        "key": found["AccessKeyId"],
        "secret": found["SecretAccessKey"],
        "token": found.get("Token", ""),
    }


def _hmac(key: bytes, text: str) -> bytes:
    return hmac.new(key, text.encode(), hashlib.sha256).digest()


def sigv4_headers(
    *, host: str, path: str, region: str, creds: dict[str, str], now: datetime.datetime
) -> dict[str, str]:
    """The headers that sign ``GET https://host/path`` (no query, no body) for S3.

    ``path`` is already URI-encoded, as it goes on the wire; S3 signs it as it is."""
    stamp = now.strftime("%Y%m%dT%H%M%SZ")
    day = stamp[:8]
    headers = {"host": host, "x-amz-content-sha256": EMPTY_SHA256, "x-amz-date": stamp}
    if creds.get("token"):
        headers["x-amz-security-token"] = creds["token"]
    names = sorted(headers)
    canonical = "\n".join(
        [
            "GET",
            path,
            "",
            "".join(f"{n}:{headers[n].strip()}\n" for n in names),
            ";".join(names),
            EMPTY_SHA256,
        ]
    )
    scope = f"{day}/{region}/s3/aws4_request"
    to_sign = "\n".join(
        ["AWS4-HMAC-SHA256", stamp, scope, hashlib.sha256(canonical.encode()).hexdigest()]
    )
    key = _hmac(
        _hmac(_hmac(_hmac(f"AWS4{creds['secret']}".encode(), day), region), "s3"), "aws4_request"
    )
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    out = {n: headers[n] for n in names if n != "host"}
    out["Authorization"] = (
        f"AWS4-HMAC-SHA256 Credential={creds['key']}/{scope}, "
        f"SignedHeaders={';'.join(names)}, Signature={signature}"
    )
    return out


def s3_get(bucket: str, key: str, region: str) -> bytes:
    quoted = urllib.parse.quote(key, safe="/-_.~")
    if S3_ENDPOINT:
        parts = urllib.parse.urlsplit(S3_ENDPOINT)
        scheme, host, path = parts.scheme, parts.netloc, f"/{bucket}/{quoted}"
    elif "." in bucket:  # a dotted name breaks the virtual host's certificate
        scheme, host, path = "https", f"s3.{region}.amazonaws.com", f"/{bucket}/{quoted}"
    else:
        scheme, host, path = "https", f"{bucket}.s3.{region}.amazonaws.com", f"/{quoted}"
    now = datetime.datetime.now(datetime.timezone.utc)
    headers = sigv4_headers(host=host, path=path, region=region, creds=aws_credentials(), now=now)
    return _open(urllib.request.Request(f"{scheme}://{host}{path}", headers=headers))


# -- GCP: the service account's token from the metadata server -----------------------------


def gcs_get(bucket: str, name: str) -> bytes:
    token_url = f"{GCE_METADATA}/computeMetadata/v1/instance/service-accounts/default/token"
    answer = _open(
        urllib.request.Request(token_url, headers={"Metadata-Flavor": "Google"}), direct=True
    )
    token = json.loads(answer)["access_token"]
    url = (
        f"{GCS_ENDPOINT}/storage/v1/b/{urllib.parse.quote(bucket, safe='')}/o/"
        f"{urllib.parse.quote(name, safe='')}?alt=media"
    )
    return _open(urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"}))


# -- the install ---------------------------------------------------------------------------


def fetch_wheel(wheel: dict[str, str], into: str) -> str:
    """Download the control plane's wheel, check its sha256, and keep it under its
    wheel name (pip reads the version from the file name); its path."""
    parsed = urllib.parse.urlsplit(wheel["uri"])
    bucket, key = parsed.netloc, parsed.path.lstrip("/")
    say(f"fetching the runner wheel {wheel['uri']}")
    try:
        if parsed.scheme == "s3":
            data = s3_get(bucket, key, wheel["region"])
        elif parsed.scheme == "gs":
            data = gcs_get(bucket, key)
        else:
            raise SystemExit(f"trainbot: cannot fetch {wheel['uri']}: not s3:// or gs://")
    except (OSError, KeyError, ValueError) as exc:  # HTTPError and URLError are OSErrors
        need = "s3:GetObject" if parsed.scheme == "s3" else "storage.objects.get"
        raise SystemExit(
            f"trainbot: could not fetch the runner wheel {wheel['uri']} ({exc}): the "
            f"instance's role needs {need} on it; or set the provider's runner install "
            "to index or image"
        ) from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != wheel["sha256"]:
        raise SystemExit(
            f"trainbot: {wheel['uri']} has sha256 {digest}, not {wheel['sha256']}: refusing it"
        )
    path = os.path.join(into, os.path.basename(wheel["file"]))
    with open(path, "wb") as f:
        f.write(data)
    return path


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
    python = make_venv(venv)
    extra = "" if has_torch(python) else "[torch]"
    say("the image has torch" if not extra else "the image has no torch: installing it too")
    if mode == "wheel":
        wheel = fetch_wheel(config["wheel"], os.path.dirname(os.path.abspath(argv[1])))
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
