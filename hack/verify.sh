#!/usr/bin/env bash
# Fails when a generated file, the formatting or a go.mod/go.sum differs from what the
# generators make of the current tree. The generators run on a copy, so uncommitted work in
# progress is compared as it is, not against HEAD.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
fail=0

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
git ls-files -co --exclude-standard -z | xargs -0 cp --parents -t "$tmp"
make -s -C "$tmp" generate >/dev/null
for d in manifests/crd manifests/base/tenants/rbac manifests/base/capi-provider/rbac manifests/clusterctl manifests/components/monitoring charts pkg/apis guest-csi/internal/tenants/guest docs/api-reference.md; do
	if ! diff -r "$d" "$tmp/$d" >/dev/null; then
		echo "verify: $d is out of date; run 'make generate':"
		diff -ru "$d" "$tmp/$d" | head -40 || true
		fail=1
	fi
done

# Each Helm chart renders (helm template, default values) the objects of its overlay.
if ! go run ./e2e/cmd/charts -check; then
	fail=1
fi

# The tree is releasable as its version (a CHANGELOG.md section, a clusterctl release series).
if ! hack/release.sh check >/dev/null; then
	fail=1
fi

unformatted=$(git ls-files -co --exclude-standard '*.go' | xargs gofmt -l)
if [ -n "$unformatted" ]; then
	echo "verify: not gofmt'ed:"; echo "$unformatted"; fail=1
fi

for m in pkg guest-csi mgmt-csi vm-operator e2e e2e/capispecs hack/tools/*; do
	if ! (cd "$m" && GOWORK=off go mod tidy -diff >/dev/null 2>&1); then
		echo "verify: $m/go.mod or go.sum is not tidy; run 'cd $m && GOWORK=off go mod tidy'"
		fail=1
	fi
done
# pvbridge's modules build with the versions the tool module (hack/tools/kubernetes) has of every
# library both compile: one library at another version would compile client-go and all above it
# twice on a fresh machine (docs/design.md).
deps() { GOWORK=off go list -deps -f '{{with .Module}}{{.Path}} {{with .Replace}}{{.Version}}{{else}}{{.Version}}{{end}}{{end}}' "$@" | sort -u; }
tools=$(cd hack/tools/kubernetes && deps $(sed -n 's/^\t_ "\(.*\)"$/\1/p' tools.go) ./coredns)
for m in pkg guest-csi mgmt-csi vm-operator e2e e2e/capispecs; do
	skew=$(join <(cd "$m" && deps -test ./...) <(echo "$tools") | awk '$2 != $3 { print "  " $1, $2, "(tools: " $3 ")" }')
	if [ -n "$skew" ]; then
		echo "verify: $m requires other versions than hack/tools/kubernetes of:"; echo "$skew"
		echo "  (cd $m && GOWORK=off go get <module>@<tools' version>)"
		fail=1
	fi
done
exit $fail
