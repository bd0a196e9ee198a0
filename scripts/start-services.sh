#!/usr/bin/env bash
# Starts the servers the tests talk to when they do not answer, and waits until they accept connections:
#   PostgreSQL on 127.0.0.1:5432 (the tests connect as postgres without a password, to
#              FERRY_TEST_PG_ADMIN_URL, default postgres://postgres@127.0.0.1:5432/postgres, and create a
#              fresh database per test server; test/helpers/store.ts)
#   NATS with JetStream on 127.0.0.1:4222
# Installs the Debian packages (postgresql, nats-server) when they are missing and we are root with
# apt-get; a PostgreSQL it installs itself is set to listen on 127.0.0.1 only and to trust loopback
# connections. Each wait is bounded (SERVICES_WAIT_SECONDS, default 60). Exits non-zero with a message
# saying what is missing when a service cannot be had: the PostgreSQL tests then fail, they never skip.
# Run by .ci/run before `npm test`, and by scripts/test.mjs when PostgreSQL's port is closed. Safe to run
# again: does nothing when both answer. `start-services.sh postgres` or `start-services.sh nats` handles
# only that one (scripts/local-cluster.sh, when the other is a server of the user's).
set -euo pipefail

PG_ADMIN_URL="${FERRY_TEST_PG_ADMIN_URL:-postgres://postgres@127.0.0.1:5432/postgres}"
WAIT_SECONDS="${SERVICES_WAIT_SECONDS:-60}"
NATS_PORT=4222

fail() {
  echo "start-services: $*" >&2
  exit 1
}

is_root_with_apt() { [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; }

apt_install() {
  is_root_with_apt || fail "$1 is not installed, and we cannot install it (not root with apt-get). Install it: sudo apt-get install -y $*"
  echo "start-services: installing $*"
  export DEBIAN_FRONTEND=noninteractive
  if ! apt-get -o DPkg::Lock::Timeout=600 install -y -qq "$@" >/dev/null 2>&1; then
    apt-get -o DPkg::Lock::Timeout=600 update -qq >/dev/null 2>&1 || true
    apt-get -o DPkg::Lock::Timeout=600 install -y -qq "$@" >/dev/null || fail "could not install $*"
  fi
}

# Whether a TCP port on 127.0.0.1 accepts connections (bash's /dev/tcp; no nc needed).
port_open() { timeout 2 bash -c "exec 3<>/dev/tcp/127.0.0.1/$1" 2>/dev/null; }

# Polls `$@` every half second until it succeeds or WAIT_SECONDS pass.
wait_until() {
  local what="$1"
  shift
  local end=$((SECONDS + WAIT_SECONDS))
  until "$@"; do
    [ "$SECONDS" -lt "$end" ] || return 1
    sleep 0.5
  done
  echo "start-services: $what is up"
}

pg_answers() { psql "$PG_ADMIN_URL" -XAtqc 'select 1' >/dev/null 2>&1; }

# The newest installed PostgreSQL version with a cluster named main (Debian's postgresql-common layout).
pg_version() { { ls /etc/postgresql 2>/dev/null || true; } | sort -V | tail -n 1; }

start_postgres() {
  if pg_answers; then
    echo "start-services: PostgreSQL answers at ${PG_ADMIN_URL%%\?*}"
    return
  fi
  local installed_now=0
  if [ -z "$(pg_version)" ] || ! command -v pg_ctlcluster >/dev/null 2>&1; then
    apt_install postgresql
    installed_now=1
  fi
  local version
  version="$(pg_version)"
  [ -n "$version" ] || fail "PostgreSQL is installed but has no cluster under /etc/postgresql (create one: pg_createcluster <version> main)"
  if [ "$installed_now" = 1 ]; then
    # A cluster made just now: loopback only, and the passwordless postgres user the tests connect as.
    printf "listen_addresses = '127.0.0.1'\nport = 5432\n" >"/etc/postgresql/$version/main/conf.d/90-ferry-tests.conf"
    sed -i '1i host all all 127.0.0.1/32 trust' "/etc/postgresql/$version/main/pg_hba.conf"
    pg_ctlcluster --skip-systemctl-redirect "$version" main stop >/dev/null 2>&1 || true
  fi
  echo "start-services: starting PostgreSQL $version (cluster main)"
  if ! pg_ctlcluster --skip-systemctl-redirect "$version" main start; then
    # Already running (it may just refuse our connection), or it failed: the wait below tells which.
    echo "start-services: pg_ctlcluster start did not succeed; waiting for PostgreSQL anyway" >&2
  fi
  if ! wait_until "PostgreSQL" pg_answers; then
    local why
    why="$(psql "$PG_ADMIN_URL" -XAtqc 'select 1' 2>&1 | head -n 3 || true)"
    fail "PostgreSQL does not accept connections at ${PG_ADMIN_URL%%\?*} after ${WAIT_SECONDS} s: ${why:-no answer}
(the tests connect without a password: trust 127.0.0.1 in pg_hba.conf, or set FERRY_TEST_PG_ADMIN_URL)"
  fi
}

start_nats() {
  if port_open "$NATS_PORT"; then
    echo "start-services: NATS answers on 127.0.0.1:$NATS_PORT"
    return
  fi
  [ -x /usr/sbin/nats-server ] || apt_install nats-server
  [ -x /usr/sbin/nats-server ] || fail "nats-server is not at /usr/sbin/nats-server"
  mkdir -p /var/lib/nats-server
  echo "start-services: starting NATS (JetStream) on 127.0.0.1:$NATS_PORT"
  start-stop-daemon --start --oknodo --background --exec /usr/sbin/nats-server -- \
    -a 127.0.0.1 -p "$NATS_PORT" -js -sd /var/lib/nats-server -l /var/log/nats-server.log ||
    fail "could not start nats-server (see /var/log/nats-server.log)"
  wait_until "NATS" port_open "$NATS_PORT" ||
    fail "NATS does not accept connections on 127.0.0.1:$NATS_PORT after ${WAIT_SECONDS} s (see /var/log/nats-server.log)"
}

WANT_PG=1
WANT_NATS=1
if [ $# -gt 0 ]; then
  WANT_PG=0
  WANT_NATS=0
  for service in "$@"; do
    case "$service" in
      postgres) WANT_PG=1 ;;
      nats) WANT_NATS=1 ;;
      *) fail "unknown service $service (postgres, nats)" ;;
    esac
  done
fi
command -v psql >/dev/null 2>&1 || apt_install postgresql-client
[ "$WANT_PG" = 0 ] || start_postgres
[ "$WANT_NATS" = 0 ] || start_nats
