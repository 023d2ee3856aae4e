#!/usr/bin/env bash
# Runs fuzz targets, each for $FUZZ_TIME (a count such as 10000x: a duration races Go's fuzzing
# coordinator at its deadline and can fail a target with "context deadline exceeded" and no
# crasher under load). One instrumented test binary per package (linking it is most of the
# time), run once per target in the package's directory (its testdata/fuzz corpus), with go
# test's own fuzz cache.
#
# Usage: FUZZ_TIME=10000x hack/fuzz.sh MODULE:PACKAGE:TARGET[,TARGET...] ...
set -euo pipefail
bin=$(mktemp -d)
trap 'rm -rf "$bin"' EXIT
for t in "$@"; do
	IFS=: read -r m p fs <<<"$t"
	(cd "$m" && go test -c -fuzz "${fs%%,*}" -o "$bin/$m.test" "$p")
	cache=$(go env GOCACHE)/fuzz/$(cd "$m" && go list "$p")
	for f in ${fs//,/ }; do
		echo "== fuzz $m $p $f (${FUZZ_TIME:-10000x})"
		(cd "$m/$p" && "$bin/$m.test" -test.run '^$' -test.fuzz "^$f\$" \
			-test.fuzztime "${FUZZ_TIME:-10000x}" -test.parallel 1 -test.fuzzcachedir "$cache")
	done
done
