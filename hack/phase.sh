#!/usr/bin/env bash
# Runs a command as one named phase of a run and records how long it took, so that .ci/run can
# print where its time went. Without $PVBRIDGE_TIMINGS it only runs the command. With it, the
# command's output (stdout and stderr) is also kept in $PVBRIDGE_TIMINGS.<NAME>.log, whose `go
# test` package lines (ok/FAIL, package, seconds) .ci/run prints as each package's time.
#
# Usage: hack/phase.sh NAME COMMAND [ARG ...]   (appends "NAME SECONDS ok|failed" to $PVBRIDGE_TIMINGS)
set -uo pipefail
name=$1
shift
start=$(date +%s)
if [ -z "${PVBRIDGE_TIMINGS:-}" ]; then
	exec "$@"
fi
"$@" 2>&1 | tee -a "$PVBRIDGE_TIMINGS.$name.log"
rc=${PIPESTATUS[0]}
status=ok
[ "$rc" -eq 0 ] || status="failed"
printf '%s %d %s\n' "$name" "$(($(date +%s) - start))" "$status" >>"$PVBRIDGE_TIMINGS"
exit "$rc"
