#!/bin/bash
# trainbot's startup script for Compute Engine instances (metadata key "startup-script").
#
# It installs the runner pinned to the control plane's version (deploy/runner-install.py,
# sent as metadata: the control plane's own wheel, downloaded from it with the attempt's
# token read from the metadata server and checked against the sha256 in trainbot-runner,
# or trainbot==VERSION from an index, or nothing when the image has it), starts the attempt's command under it as an unprivileged user,
# reports the exit code as the guest attribute trainbot/exit-code, and halts the guest, so
# nothing keeps billing after the runner ends. Everything it needs comes from the
# instance's own metadata, set by jobs/providers/gcp.py at launch:
#
#   trainbot-command        JSON list: the command (trainbot-runner exec -- ...)
#   trainbot-env            JSON object: the runner's environment, with the attempt's token
#   trainbot-runner         JSON: how the runner is installed (runner-install.py's CONFIG)
#   trainbot-runner-installer  deploy/runner-install.py
#   trainbot-scratch-bytes  declared size of the scratch volume
#
# Nothing secret is written to disk, put on a command line or printed: the environment
# goes from the metadata server straight into the runner's exec. Nothing here comes from
# chat. Startup scripts run as root on every boot; a second boot after the runner ended
# only halts again.
#
# The variables below are for tests only; on an instance they keep their defaults.
set -uo pipefail
set +x

MD_URL="${TRAINBOT_GCE_METADATA_URL:-http://metadata.google.internal}/computeMetadata/v1/instance"
STATE_DIR="${TRAINBOT_STATE_DIR:-/var/lib/trainbot}"
VENV="${TRAINBOT_VENV:-/opt/trainbot}"
RUN_AS="${TRAINBOT_RUN_AS-trainbot}"
HALT="${TRAINBOT_HALT:-shutdown -h now}"

md() {
  curl -sSf --retry 5 --retry-connrefused -H "Metadata-Flavor: Google" "${MD_URL}/$1"
}

finish() {
  # Report how the runner ended, then halt. Both are best effort: the control plane also
  # learns the end from the runner's own events and from the instance's status.
  local code="$1"
  curl -sS -X PUT -H "Metadata-Flavor: Google" --data "${code}" \
    "${MD_URL}/guest-attributes/trainbot/exit-code" >/dev/null 2>&1 || true
  touch "${STATE_DIR}/done"
  keep_failed "${code}"
  echo "trainbot: runner exited ${code}; halting"
  ${HALT}
  exit 0
}

# debug.keep_failed_instance: after a failure (any code but 0 and the runner's preempted
# 75) the instance stays up TRAINBOT_KEEP_FAILED_S seconds (from trainbot-env) for a person
# to look at. The control plane deletes it when its time is up or on /train release; this
# wait only bounds it should the control plane not, and it halts as always after.
keep_failed() {
  local code="$1" keep
  if [ "${code}" = 0 ] || [ "${code}" = 75 ]; then return 0; fi
  keep="$(md attributes/trainbot-env 2>/dev/null \
    | grep -o '"TRAINBOT_KEEP_FAILED_S": *"[0-9][0-9]*"' | grep -o '[0-9][0-9]*' | head -n 1)"
  if [ -z "${keep}" ]; then return 0; fi
  echo "trainbot: keeping this instance up to ${keep} s to look at the failure (debug.keep_failed_instance)"
  sleep "${keep}"
}

mkdir -p "${STATE_DIR}"
chmod 755 "${STATE_DIR}"
if [ -e "${STATE_DIR}/done" ]; then
  echo "trainbot: this instance already ran its attempt; halting"
  ${HALT}
  exit 0
fi

# The image's python: the Deep Learning VM's conda environment where there is one, so the
# runner's venv sees its torch and nothing is downloaded for it.
image_python() {
  local p
  for p in "${TRAINBOT_IMAGE_PYTHON:-}" /opt/conda/bin/python3 python3; do
    if [ -n "${p}" ] && command -v "${p}" >/dev/null 2>&1; then echo "${p}"; return 0; fi
  done
  return 1
}

INSTALL_DIR="${STATE_DIR}/install"
mkdir -p "${INSTALL_DIR}" && chmod 700 "${INSTALL_DIR}" || finish 126
md attributes/trainbot-runner >"${INSTALL_DIR}/runner.json" || finish 126
if grep -q '"mode": "image"' "${INSTALL_DIR}/runner.json"; then
  echo "trainbot: the image has the runner: installing nothing"
elif [ ! -x "${VENV}/bin/trainbot-runner" ]; then
  echo "trainbot: installing the runner"
  PY="$(image_python)" || PY=""
  if [ -z "${PY}" ] || ! "${PY}" -c "import venv, ensurepip" >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get -qq update && apt-get -qq install -y python3-venv curl || finish 126
    PY="$(image_python)" || finish 126
  fi
  md attributes/trainbot-runner-installer >"${INSTALL_DIR}/install.py" || finish 126
  "${PY}" "${INSTALL_DIR}/install.py" "${INSTALL_DIR}/runner.json" "${VENV}" || finish 126
  [ -x "${VENV}/bin/trainbot-runner" ] || finish 126
fi
if ! command -v nvidia-smi >/dev/null 2>&1; then
  echo "trainbot: no nvidia-smi on this image; GPU runs need a Deep Learning VM image"
fi

SCRATCH="${STATE_DIR}/scratch"
mkdir -p "${SCRATCH}"
if [ -n "${RUN_AS}" ]; then
  id -u "${RUN_AS}" >/dev/null 2>&1 || useradd --system --create-home \
    --home-dir "${STATE_DIR}/home" --shell /usr/sbin/nologin "${RUN_AS}"
  chown "${RUN_AS}" "${SCRATCH}"
  AS_USER=(runuser -u "${RUN_AS}" --)
else
  AS_USER=()
fi

# The spec's container image (TRAINBOT_IMAGE): the runner starts the command in it with
# docker (runner/container.py), as its own user, who joins the docker group for that. The
# runner checks docker and the image itself and reports what is missing (image_unavailable).
if md attributes/trainbot-env | grep -q '"TRAINBOT_CONTAINER_RUNTIME": "docker"'; then
  if command -v docker >/dev/null 2>&1; then
    systemctl start docker >/dev/null 2>&1 || true
    if [ -n "${RUN_AS}" ]; then
      usermod -aG docker "${RUN_AS}" || echo "trainbot: cannot add ${RUN_AS} to the docker group"
    fi
    echo "trainbot: the command runs in a container (docker)"
  else
    echo "trainbot: the spec's image needs docker, which this machine image lacks"
  fi
fi

# The launcher reads the command and the environment from the metadata server itself and
# execs the command: the token never passes through a shell variable, file or argv.
LAUNCH_PY="${VENV}/bin/python"
[ -x "${LAUNCH_PY}" ] || LAUNCH_PY="$(image_python)" || finish 127
"${AS_USER[@]}" env -i PATH="${VENV}/bin:/usr/local/bin:/usr/bin:/bin" \
  MD_URL="${MD_URL}" SCRATCH="${SCRATCH}" "${LAUNCH_PY}" - <<'PY'
import json
import os
import sys
import urllib.request

base = os.environ["MD_URL"]


def md(path):
    request = urllib.request.Request(f"{base}/{path}", headers={"Metadata-Flavor": "Google"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(request, timeout=30) as response:
        return response.read().decode()


command = json.loads(md("attributes/trainbot-command"))
env = {k: os.environ[k] for k in ("PATH",) if k in os.environ}
env.update(LANG="C.UTF-8", HOME=os.path.expanduser("~"))
env.update(json.loads(md("attributes/trainbot-env")))
zone = md("zone").rsplit("/", 1)[-1]
env.setdefault("TRAINBOT_INSTANCE_ID", f"{zone}/{md('name')}")
env.setdefault("TRAINBOT_SCRATCH_DIR", os.environ["SCRATCH"])
env.setdefault("TRAINBOT_SCRATCH_BYTES", md("attributes/trainbot-scratch-bytes"))
env.setdefault("TRAINBOT_PREEMPTION_SOURCES", "gcp")
env.setdefault("TRAINBOT_TERMINATION_WINDOW_S", "30")
if not command:
    print("trainbot: the instance has no command to run", file=sys.stderr)
    sys.exit(2)
os.chdir(os.environ["SCRATCH"])
try:
    os.execvpe(command[0], command, env)
except OSError as e:
    print(f"trainbot: cannot start {command[0]!r}: {e}", file=sys.stderr)
    sys.exit(127)
PY
finish "$?"
