#!/usr/bin/env bash
# Debian packages the test suite uses: `prometheus` (gives /usr/bin/prometheus and /usr/bin/promtool).
# Idempotent and quick when they are present. Never fails the build: when it cannot install (not root,
# no apt-get, no network), it says so and exits 0, and the tests that need the binaries skip with a reason.
set -uo pipefail

PACKAGES=(prometheus)
NEEDED_COMMANDS=(promtool prometheus)

note() { printf 'system-deps: %s\n' "$*" >&2; }

missing=()
for cmd in "${NEEDED_COMMANDS[@]}"; do
  command -v "$cmd" >/dev/null 2>&1 || missing+=("$cmd")
done
if [ "${#missing[@]}" -eq 0 ]; then
  exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
  note "missing ${missing[*]} and apt-get is not available; install the Prometheus server and promtool" \
       "by hand (the tests that need them will be skipped)."
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  note "missing ${missing[*]}; run as root (or: sudo apt-get install --no-install-recommends" \
       "${PACKAGES[*]}) (the tests that need them will be skipped)."
  exit 0
fi

# The package's postinst starts a Prometheus daemon on 0.0.0.0:9090 through invoke-rc.d when there is no
# systemd (CI containers). Tests start their own server on a free loopback port and need no daemon, so
# forbid service starts during this install with a policy-rc.d (exit 101 = "action forbidden"), the
# standard Debian mechanism, unless the machine already has its own policy.
policy=/usr/sbin/policy-rc.d
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\n# temporary, written by deploy/system-deps.sh\nexit 101\n' >"$policy"
  chmod 0755 "$policy"
  trap 'rm -f "$policy"' EXIT
fi

export DEBIAN_FRONTEND=noninteractive
apt_opts=(-q -y -o Dpkg::Use-Pty=0 -o DPkg::Lock::Timeout=120)
note "installing ${PACKAGES[*]} (missing: ${missing[*]})"
if ! apt-get "${apt_opts[@]}" update >/dev/null \
   || ! apt-get "${apt_opts[@]}" install --no-install-recommends "${PACKAGES[@]}" >/dev/null; then
  note "apt-get failed to install ${PACKAGES[*]}; the tests that need them will be skipped."
  exit 0
fi

# Stop a daemon the postinst may still have started (an existing policy-rc.d that allows starts).
if [ -x /etc/init.d/prometheus ] && command -v invoke-rc.d >/dev/null 2>&1; then
  invoke-rc.d prometheus stop >/dev/null 2>&1 || true
fi
command -v promtool >/dev/null 2>&1 && note "installed: $(promtool --version 2>&1 | head -n 1)"
exit 0
