#!/usr/bin/env bash
# A Ferry cluster on one machine, for trying gateways and workers (docs/scaling-out.md):
#   PostgreSQL and NATS with JetStream (the local ones on 127.0.0.1:5432 and :4222 started by
#   scripts/start-services.sh when they do not answer; servers given below are only checked),
#   2 gateways (127.0.0.1:8000 and :8001) and 2 workers (internal listeners on 127.0.0.1:9001 and :9002),
#   each with its own data directory under the cluster folder, one shared keys folder, logs to files.
#
#   scripts/local-cluster.sh [start]   start it (and bootstrap a project the first time)
#   scripts/local-cluster.sh status    what runs, and the cluster as the gateways see it
#   scripts/local-cluster.sh stop      stop every process it started
#
# Options (before or after the command):
#   --dir DIR          the cluster folder (default ./.ferry-cluster)
#   --base-port N      gateways on N and N+1, workers on N+1001 and N+1002 (default 8000)
#   --name NAME        cluster name and database ferry_NAME (default local)
# Environment: FERRY_LOCAL_ADMIN_URL, the PostgreSQL server to create the database on
#   (default postgres://postgres@127.0.0.1:5432/postgres); FERRY_NATS_URL (default nats://127.0.0.1:4222).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
FERRY=(node "$ROOT/bin/ferry.js")
DIR=./.ferry-cluster
BASE_PORT=8000
NAME=local
COMMAND=start
DEFAULT_ADMIN_URL=postgres://postgres@127.0.0.1:5432/postgres
DEFAULT_NATS_URL=nats://127.0.0.1:4222
ADMIN_URL="${FERRY_LOCAL_ADMIN_URL:-$DEFAULT_ADMIN_URL}"
NATS_URL="${FERRY_NATS_URL:-$DEFAULT_NATS_URL}"

while [ $# -gt 0 ]; do
  case "$1" in
    start | stop | status) COMMAND="$1" ;;
    --dir) DIR="${2:?--dir needs a folder}"; shift ;;
    --base-port) BASE_PORT="${2:?--base-port needs a number}"; shift ;;
    --name) NAME="${2:?--name needs a name}"; shift ;;
    -h | --help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "local-cluster: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
[[ "$BASE_PORT" =~ ^[0-9]+$ ]] && [ "$BASE_PORT" -ge 1024 ] && [ "$BASE_PORT" -le 63000 ] ||
  { echo "local-cluster: --base-port must be a number from 1024 to 63000" >&2; exit 2; }
[[ "$NAME" =~ ^[a-z0-9_]{1,24}$ ]] || { echo "local-cluster: --name must be 1-24 of a-z, 0-9, _" >&2; exit 2; }

mkdir -p "$DIR"
DIR="$(cd "$DIR" && pwd)"
DB_NAME="ferry_$NAME"
DATABASE_URL="${ADMIN_URL%/*}/$DB_NAME"
GATEWAYS=("gateway-1:$BASE_PORT" "gateway-2:$((BASE_PORT + 1))")
WORKERS=("worker-1:$((BASE_PORT + 1001))" "worker-2:$((BASE_PORT + 1002))")

port_open() { timeout 2 bash -c "exec 3<>/dev/tcp/127.0.0.1/$1" 2>/dev/null; }
host_port_open() { timeout 2 bash -c "exec 3<>/dev/tcp/$1/$2" 2>/dev/null; }
pid_of() { [ -f "$DIR/$1/serve.pid" ] && cat "$DIR/$1/serve.pid"; }
alive() { local pid; pid="$(pid_of "$1")" && kill -0 "$pid" 2>/dev/null; }

start_node() {
  local label="$1" role="$2" port="$3"
  if alive "$label"; then
    echo "  $label already runs (pid $(pid_of "$label"))"
    return
  fi
  if port_open "$port"; then
    echo "local-cluster: port $port is taken by something else; pass --base-port" >&2
    exit 1
  fi
  mkdir -p "$DIR/$label"
  # setsid: its own session, so it outlives this script and a stop reaches its replicas too.
  FERRY_ROLE="$role" FERRY_DATABASE_URL="$DATABASE_URL" FERRY_NATS_URL="$NATS_URL" FERRY_CLUSTER_NAME="$NAME" \
    FERRY_KEYS_DIR="$DIR/keys" FERRY_LOG_FORMAT=json \
    setsid "${FERRY[@]}" serve --host 127.0.0.1 --port "$port" --data-dir "$DIR/$label" \
    >"$DIR/$label/serve.log" 2>&1 </dev/null &
  echo $! >"$DIR/$label/serve.pid"
}

wait_port() {
  local label="$1" port="$2" end=$((SECONDS + 60))
  until port_open "$port"; do
    if ! alive "$label" || [ "$SECONDS" -ge "$end" ]; then
      echo "local-cluster: $label did not start; the end of $DIR/$label/serve.log:" >&2
      tail -n 20 "$DIR/$label/serve.log" >&2 || true
      exit 1
    fi
    sleep 0.3
  done
}

# Whether one of the NATS servers of NATS_URL (comma-separated, nats://[user@]host[:port]) accepts connections.
nats_answers() {
  local server hostport host port
  local -a servers
  IFS=',' read -r -a servers <<<"$NATS_URL"
  for server in "${servers[@]}"; do
    hostport="${server#*://}"
    hostport="${hostport##*@}"
    hostport="${hostport%%/*}"
    host="${hostport%:*}"
    port="${hostport##*:}"
    [ "$host" != "$hostport" ] || port=4222
    [ -n "$host" ] || continue
    if host_port_open "$host" "$port"; then return 0; fi
  done
  return 1
}

# The local servers are started when missing; servers the user named are only checked, never the defaults.
ensure_services() {
  local local_ones=()
  if [ "$ADMIN_URL" = "$DEFAULT_ADMIN_URL" ]; then
    local_ones+=(postgres)
  elif ! psql "$ADMIN_URL" -XAtqc 'select 1' >/dev/null 2>&1; then
    echo "local-cluster: PostgreSQL does not answer at ${ADMIN_URL%%\?*} (FERRY_LOCAL_ADMIN_URL)" >&2
    exit 1
  fi
  if [ "$NATS_URL" = "$DEFAULT_NATS_URL" ]; then
    local_ones+=(nats)
  elif ! nats_answers; then
    echo "local-cluster: NATS does not answer at $NATS_URL (FERRY_NATS_URL)" >&2
    exit 1
  fi
  if [ "${#local_ones[@]}" -gt 0 ]; then
    FERRY_TEST_PG_ADMIN_URL="$DEFAULT_ADMIN_URL" bash "$ROOT/scripts/start-services.sh" "${local_ones[@]}"
  fi
}

cmd_start() {
  ensure_services
  if [ ! -f "$ROOT/dist/src/cli/index.js" ]; then
    echo "local-cluster: building Ferry first (npm run build)"
    (cd "$ROOT" && npm run build >/dev/null)
  fi
  if [ "$(psql "$ADMIN_URL" -XAtqc "select 1 from pg_database where datname = '$DB_NAME'")" != 1 ]; then
    psql "$ADMIN_URL" -Xqc "create database \"$DB_NAME\"" >/dev/null
    echo "local-cluster: created database $DB_NAME"
  fi
  mkdir -p "$DIR/keys"
  if [ ! -f "$DIR/bootstrap.json" ]; then
    # The first project and its owner token, straight on the database (this also makes the shared keys).
    "${FERRY[@]}" admin bootstrap --data-dir "$DIR/bootstrap" --database-url "$DATABASE_URL" \
      --keys-dir "$DIR/keys" --url "http://127.0.0.1:$BASE_PORT" --json >"$DIR/bootstrap.json"
  fi
  echo "local-cluster: starting 2 gateways and 2 workers (cluster \"$NAME\", data in $DIR)"
  for entry in "${WORKERS[@]}"; do start_node "${entry%%:*}" worker "${entry##*:}"; done
  for entry in "${GATEWAYS[@]}"; do start_node "${entry%%:*}" gateway "${entry##*:}"; done
  for entry in "${WORKERS[@]}" "${GATEWAYS[@]}"; do wait_port "${entry%%:*}" "${entry##*:}"; done
  local project token
  project="$(node -e 'console.log(JSON.parse(require("fs").readFileSync(process.argv[1], "utf8")).project_id)' "$DIR/bootstrap.json")"
  token="$(node -e 'console.log(JSON.parse(require("fs").readFileSync(process.argv[1], "utf8")).token)' "$DIR/bootstrap.json")"
  cat <<EOF

Ferry cluster "$NAME" is up:
  gateways  http://127.0.0.1:$BASE_PORT  http://127.0.0.1:$((BASE_PORT + 1))   (put a load balancer in front of them)
  workers   http://127.0.0.1:$((BASE_PORT + 1001))  http://127.0.0.1:$((BASE_PORT + 1002))   (internal: gateways only)
  logs      $DIR/<node>/serve.log
  project   $project (owner token in $DIR/bootstrap.json)

Next:
  npx ferry login --url http://127.0.0.1:$BASE_PORT --token $token
  npx ferry deploy examples/hello
  curl -s -X POST http://127.0.0.1:$((BASE_PORT + 1))/v4/$project/hello/run \\
    -H "Authorization: Bearer $token" -H 'Content-Type: application/json' -d '{"name":"cluster"}'
  npx ferry cluster          # every node, its role and load
  scripts/local-cluster.sh stop
EOF
}

cmd_stop() {
  local stopped=0
  for entry in "${GATEWAYS[@]}" "${WORKERS[@]}"; do
    local label="${entry%%:*}" pid
    if alive "$label"; then
      pid="$(pid_of "$label")"
      kill -TERM "$pid" 2>/dev/null || true
      local end=$((SECONDS + 20))
      while kill -0 "$pid" 2>/dev/null && [ "$SECONDS" -lt "$end" ]; do sleep 0.2; done
      # Whatever is left of its session (a replica that did not stop) goes too.
      kill -KILL -- "-$pid" 2>/dev/null || true
      stopped=$((stopped + 1))
    fi
    rm -f "$DIR/$label/serve.pid"
  done
  echo "local-cluster: stopped $stopped process(es); data stays in $DIR (remove it, and drop database $DB_NAME, to start afresh)"
}

cmd_status() {
  for entry in "${GATEWAYS[@]}" "${WORKERS[@]}"; do
    local label="${entry%%:*}" port="${entry##*:}"
    if alive "$label"; then echo "  $label  pid $(pid_of "$label")  port $port  up"; else echo "  $label  down"; fi
  done
  if alive gateway-1 && [ -f "$DIR/bootstrap.json" ]; then
    FERRY_URL="http://127.0.0.1:$BASE_PORT" \
      FERRY_TOKEN="$(node -e 'console.log(JSON.parse(require("fs").readFileSync(process.argv[1], "utf8")).token)' "$DIR/bootstrap.json")" \
      "${FERRY[@]}" cluster || true
  fi
}

case "$COMMAND" in
  start) cmd_start ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
esac
