#!/usr/bin/env bash
# Runs the test suite while a busy loop occupies one core, as on a shared CI machine, to catch tests that
# depend on timing. Builds once (`npm run build`; the runner bundles the test files), then runs `node scripts/test.mjs`
# N times in a row (default 1), stopping at the first failure; type check and lint, which `npm test` adds,
# do not depend on timing and are left to `npm test`. Prints how long each run took and exits with the
# suite's exit code.
#
#   scripts/ci-under-load.sh            # the whole suite once
#   scripts/ci-under-load.sh 3          # three times in a row
#   scripts/ci-under-load.sh 2 webhook  # only the test files whose name contains "webhook", twice
set -u
cd "$(dirname "$0")/.."

runs=1
if [[ $# -gt 0 && $1 =~ ^[0-9]+$ ]]; then
  runs=$1
  shift
fi
if ((runs < 1)); then
  echo "usage: $0 [N] [test file fragment ...]  (N >= 1)" >&2
  exit 2
fi

npm run build || exit $?

busy_pid=''
stop_busy() {
  if [[ -n $busy_pid ]]; then
    kill "$busy_pid" 2>/dev/null
    wait "$busy_pid" 2>/dev/null
    busy_pid=''
  fi
}
trap stop_busy EXIT
# A signal ends the script through `exit`, so the EXIT trap stops the busy loop.
trap 'exit 130' INT
trap 'exit 143' TERM

sh -c 'while :; do :; done' &
busy_pid=$!
echo "ci-under-load: busy loop on one core (pid $busy_pid); $runs run(s) of node scripts/test.mjs $*"

times=()
status=0
for ((i = 1; i <= runs; i++)); do
  started=$(date +%s%N)
  node scripts/test.mjs "$@"
  status=$?
  took=$(( ($(date +%s%N) - started) / 1000000 ))
  seconds=$(printf '%d.%01d' $((took / 1000)) $(((took % 1000) / 100)))
  times+=("${seconds}s")
  echo "ci-under-load: run $i of $runs exited $status after ${seconds} s"
  if ((status != 0)); then
    break
  fi
done

echo "ci-under-load: ${#times[@]} run(s), took ${times[*]}; exit status $status"
exit "$status"
