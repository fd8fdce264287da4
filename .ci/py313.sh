#!/usr/bin/env bash
# The suite on Python 3.13: `make test` run on this checkout inside a Debian trixie root.
#
# CI's machine is Debian 12 (Python 3.11). This builds a trixie root with Python 3.13 once
# (debootstrap from Debian's mirror, about 3 minutes; kept at $PY313_ROOT for the next run),
# mounts this checkout into it and runs the same `make test` there, as root: torch 2.13.0 for
# cp313 comes from the package index first and pinned (a CUDA build, about 5 GB, that runs on
# the CPU), then the project with its test and framework extras (each has cp313 wheels), and
# Debian's chromium through apt. The venv lives in the root, not in the checkout. Every mount
# is undone on exit, whatever happens. Needs root and the network.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=${PY313_ROOT:-/tmp/backlens-py313-root}
VENV=/opt/backlens-venv

[ "$(id -u)" -eq 0 ] || { echo "py313.sh needs root (debootstrap, mount, chroot)" >&2; exit 1; }
if grep -q " $ROOT/" /proc/mounts; then  # never build over (or remove through) a live mount
  echo "mounts are left under $ROOT from an earlier run: umount them first" >&2
  exit 1
fi
command -v debootstrap >/dev/null || { apt-get update -qq && apt-get install -y -qq debootstrap >/dev/null; }
if [ ! -x "$ROOT/usr/bin/python3" ]; then
  rm -rf --one-file-system "$ROOT"
  debootstrap --variant=minbase \
    --include=python3,python3-venv,python3-pip,python3-dev,ca-certificates,gcc,g++,make,git \
    trixie "$ROOT" >/dev/null
fi
# The machine's certificates and resolver: pip and apt trust and reach what they do outside.
cp /etc/ssl/certs/ca-certificates.crt "$ROOT/etc/ssl/certs/ca-certificates.crt"
cp -L /etc/resolv.conf "$ROOT/etc/resolv.conf" 2>/dev/null || true
mkdir -p "$ROOT/src"

MOUNTED=()
unmount_all() {
  local i
  for ((i = ${#MOUNTED[@]} - 1; i >= 0; i--)); do
    umount "${MOUNTED[i]}" 2>/dev/null || umount -l "${MOUNTED[i]}"
  done
}
trap unmount_all EXIT
mount_at() {  # mount_at TARGET MOUNT-ARGS...
  local target=$1
  shift
  mount "$@" "$target"
  MOUNTED+=("$target")
}
mount_at "$ROOT/src" --bind "$PWD"
mount_at "$ROOT/proc" -t proc proc
mount_at "$ROOT/sys" --bind /sys
mount_at "$ROOT/dev" --bind /dev
mount_at "$ROOT/dev/pts" --bind /dev/pts
mount_at "$ROOT/dev/shm" -t tmpfs tmpfs  # headless Chromium's shared memory

# A clean environment: the machine's pip settings point at its own wheel folders.
env -i HOME=/root LANG=C.UTF-8 PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  PIP_CERT=/etc/ssl/certs/ca-certificates.crt PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_DEFAULT_TIMEOUT=180 \
  ${http_proxy:+http_proxy=$http_proxy} ${https_proxy:+https_proxy=$https_proxy} \
  ${PIP_INDEX_URL:+PIP_INDEX_URL=$PIP_INDEX_URL} \
  chroot "$ROOT" bash -c "python3 --version && cd /src && make test PYTHON=python3 VENV=$VENV"
