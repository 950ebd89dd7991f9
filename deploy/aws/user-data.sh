#!/bin/bash
# trainbot: boot script for one attempt on EC2 (user data, run once by cloud-init as root).
#
# jobs/providers/aws/launch.py renders this template: each placeholder between double at-signs
# is replaced with a value chosen by the control plane (how the runner is installed, the
# command from the job spec, and the attempt's environment, which holds its runner
# token), each quoted for where it goes, all in one pass, so no value is ever read again as template or as shell. Nothing here is taken from chat, and nothing secret is printed: cloud-init copies
# this script's output to the serial console, which ec2:GetConsoleOutput can read.
#
# It installs trainbot's runner pinned to the control plane's version (deploy/runner-install.py:
# the control plane's own wheel, downloaded from it with the attempt's token and checked
# against the sha256 written here, or trainbot==VERSION from an index, or nothing when the
# image has it), runs the attempt's command under it as an unprivileged
# user, writes the runner's exit code to the console (the control plane reads it there),
# and shuts the instance down, which terminates it (InstanceInitiatedShutdownBehavior),
# whatever happened: nothing is left running, or billing, once the runner is gone.
#
# The TRAINBOT_BOOT_* variables are unset on a real boot; tests point them elsewhere.
set -uo pipefail

RUNNER_MODE=@@RUNNER_MODE@@
SCRATCH_DIR=${TRAINBOT_BOOT_SCRATCH_DIR:-@@SCRATCH_DIR@@}
TRAINBOT_HOME=${TRAINBOT_BOOT_HOME:-/opt/trainbot}
ENV_FILE=${TRAINBOT_BOOT_ENV_FILE:-/etc/trainbot/runner.env}
CONSOLE=${TRAINBOT_BOOT_CONSOLE:-/dev/console}
RUNNER_USER=trainbot

say() {
  echo "trainbot: $*"
  echo "trainbot: $*" 2>/dev/null >>"$CONSOLE" || true
}

# debug.keep_failed_instance: after a failure (any code but 0 and the runner's preempted
# 75) the instance stays up TRAINBOT_KEEP_FAILED_S seconds (from the env file) for a person
# to look at. The control plane terminates it when its time is up or on /train release;
# this wait only bounds it should the control plane not, and it halts as always after.
keep_failed() {
  local rc=$1 keep
  if [ "$rc" -eq 0 ] || [ "$rc" -eq 75 ]; then return 0; fi
  keep=$(sed -n "s/^TRAINBOT_KEEP_FAILED_S='\{0,1\}\([0-9][0-9]*\)'\{0,1\}\$/\1/p" \
    "$ENV_FILE" 2>/dev/null | head -n 1)
  if [ -z "$keep" ]; then return 0; fi
  say "keeping this instance up to $keep s to look at the failure (debug.keep_failed_instance)"
  sleep "$keep"
}

finish() {
  local rc=$?
  if [ -n "${RUNNER_RC:-}" ]; then rc=$RUNNER_RC; fi
  say "trainbot-runner exited with code $rc"
  keep_failed "$rc"
  sync
  shutdown -h now
}
trap finish EXIT

if ! id "$RUNNER_USER" >/dev/null 2>&1; then
  useradd --system --create-home --home-dir /var/lib/trainbot --shell /usr/sbin/nologin \
    "$RUNNER_USER" || { say "cannot create the $RUNNER_USER user"; exit 1; }
fi

# The environment file: root's, readable by the runner's group and nobody else.
umask 077
ENV_DIR=$(dirname "$ENV_FILE")
mkdir -p "$ENV_DIR" && chgrp "$RUNNER_USER" "$ENV_DIR" && chmod 0750 "$ENV_DIR" || exit 1
cat >"$ENV_FILE" <<'TRAINBOT_ENV_END'
@@ENV@@
TRAINBOT_ENV_END
chgrp "$RUNNER_USER" "$ENV_FILE" && chmod 0640 "$ENV_FILE" || exit 1
mkdir -p "$SCRATCH_DIR" && chown "$RUNNER_USER" "$SCRATCH_DIR" || exit 1
umask 022

# The image's python: the Deep Learning AMI's PyTorch environment where there is one, so
# the runner's venv sees its torch and nothing is downloaded for it.
image_python() {
  local p
  for p in "${TRAINBOT_BOOT_PYTHON:-}" /opt/pytorch/bin/python3 /opt/conda/bin/python3 python3; do
    if [ -n "$p" ] && command -v "$p" >/dev/null 2>&1; then echo "$p"; return 0; fi
  done
  return 1
}

if [ "$RUNNER_MODE" = image ]; then
  say "the image has the runner: installing nothing"
elif [ ! -x "$TRAINBOT_HOME/bin/trainbot-runner" ]; then
  PY=$(image_python) || { say "this image has no python3"; exit 1; }
  if ! "$PY" -c "import venv, ensurepip" >/dev/null 2>&1; then
    { apt-get update -q && apt-get install -y -q python3-venv; } >/dev/null 2>&1 || true
  fi
  INSTALL_DIR=$(mktemp -d) || exit 1
  cat >"$INSTALL_DIR/runner.json" <<'TRAINBOT_RUNNER_END'
@@RUNNER_CONFIG@@
TRAINBOT_RUNNER_END
  base64 -d >"$INSTALL_DIR/install.py.gz" <<'TRAINBOT_INSTALLER_END' || exit 1
@@RUNNER_INSTALLER@@
TRAINBOT_INSTALLER_END
  gunzip "$INSTALL_DIR/install.py.gz" || exit 1
  # The installer reads the attempt's token (for the wheel) from the environment file.
  TRAINBOT_RUNNER_ENV_FILE="$ENV_FILE" \
    "$PY" "$INSTALL_DIR/install.py" "$INSTALL_DIR/runner.json" "$TRAINBOT_HOME" \
    || { say "cannot install the runner"; exit 1; }
  [ -x "$TRAINBOT_HOME/bin/trainbot-runner" ] || { say "the install left no trainbot-runner"; exit 1; }
fi

# The spec's container image (TRAINBOT_IMAGE): the runner starts the command in it with
# docker (runner/container.py), as its own user, who joins the docker group for that. The
# runner checks docker and the image itself and reports what is missing (image_unavailable).
if grep -qx 'TRAINBOT_CONTAINER_RUNTIME=docker' "$ENV_FILE"; then
  if command -v docker >/dev/null 2>&1; then
    systemctl start docker >/dev/null 2>&1 || true
    usermod -aG docker "$RUNNER_USER" || say "cannot add $RUNNER_USER to the docker group"
    say "the command runs in a container (docker)"
  else
    say "the spec's image needs docker, which this machine image lacks"
  fi
fi

say "starting the runner"
cd "$SCRATCH_DIR" || exit 1
# A clean environment: the file's variables, a PATH with the runner, nothing inherited.
# The command is the attempt's own (normally trainbot-runner exec -- <spec command>).
# Its scratch directory (where the run's code is checked out) is the one made above.
runuser -u "$RUNNER_USER" -- env -i \
  PATH="$TRAINBOT_HOME/bin:/usr/local/bin:/usr/bin:/bin" \
  HOME=/var/lib/trainbot LANG=C.UTF-8 TRAINBOT_ENV_FILE="$ENV_FILE" \
  bash -c 'set -a; . "$TRAINBOT_ENV_FILE"; TRAINBOT_SCRATCH_DIR=$PWD; set +a; unset TRAINBOT_ENV_FILE; exec "$@"' \
  trainbot-boot @@COMMAND@@
RUNNER_RC=$?
exit "$RUNNER_RC"
