#!/usr/bin/env bash
# Runs a command as one named phase of a run and records how long it took, so that .ci/run can
# print where its time went. Without $PVBRIDGE_TIMINGS it only runs the command.
#
# Usage: hack/phase.sh NAME COMMAND [ARG ...]   (appends "NAME SECONDS ok|failed" to $PVBRIDGE_TIMINGS)
set -uo pipefail
name=$1
shift
start=$(date +%s)
"$@"
rc=$?
if [ -n "${PVBRIDGE_TIMINGS:-}" ]; then
	status=ok
	[ "$rc" -eq 0 ] || status="failed"
	printf '%s %d %s\n' "$name" "$(($(date +%s) - start))" "$status" >>"$PVBRIDGE_TIMINGS"
fi
exit "$rc"
