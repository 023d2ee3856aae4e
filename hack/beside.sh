#!/usr/bin/env bash
# Runs a command beside another: BACKGROUND (a shell command line) in the background with its
# output kept aside, COMMAND in the foreground; then prints BACKGROUND's output and fails if
# either failed. For work that fills the cores the other leaves idle (lint beside the tools'
# long lane in .ci/run, fuzz beside the end-to-end tests in make test).
#
# Usage: hack/beside.sh BACKGROUND COMMAND [ARG ...]
set -uo pipefail
log=$(mktemp)
trap 'rm -f "$log"' EXIT
bash -c "$1" >"$log" 2>&1 &
pid=$!
shift
"$@"
rc=$?
wait "$pid" || rc=$((rc ? rc : 1))
cat "$log"
exit "$rc"
