#!/usr/bin/env bash
# Installs the Debian packages Ferry's sandbox and tests use, when they are missing and we are root.
# Safe to run again; does nothing when everything is there. Ferry still runs without them
# (`ferry doctor` says what is missing).
set -uo pipefail
need=()
command -v bwrap >/dev/null 2>&1 || need+=(bubblewrap)
if [ ${#need[@]} -eq 0 ]; then
  echo "system packages: all present"
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "system packages missing (${need[*]}); run as root: apt-get install -y ${need[*]}" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null 2>&1 || true
if ! apt-get install -y -qq "${need[@]}" >/dev/null 2>&1; then
  echo "could not install ${need[*]}; the tests that need them will say so" >&2
fi
echo "system packages: installed ${need[*]}"
