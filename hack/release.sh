#!/usr/bin/env bash
# Makes pvbridge's release from the repository as it is: the version is the tag the manifests
# give pvbridge's images (manifests/components/images, the one place for versions), and the
# release refuses a VERSION that is not the tree's, so that what it publishes is what the
# tagged commit's manifests name.
#
#   hack/release.sh check             fail unless the tree is releasable as its version: a
#                                     CHANGELOG.md section for it, a clusterctl release series
#                                     for its minor version, charts of that version
#   hack/release.sh clusterctl OUT    write only the clusterctl repository (below) into OUT, for
#                                     the tree's version: what the lab's clusterctl init installs
#                                     the provider from
#   hack/release.sh VERSION [OUT]     check, then write into OUT (default _output/release/VERSION):
#     images/                  the images as OCI archives (e2e/cmd/images; images.txt lists
#                              each reference and digest), to push with crane, skopeo or oras
#     charts/                  the Helm charts, packaged (helm package)
#     clusterctl/              a clusterctl repository of the infrastructure provider:
#                              infrastructure-pvbridge/VERSION/{infrastructure-components.yaml,
#                              metadata.yaml, cluster-template{,-topology,-ha}.yaml,
#                              clusterclass-pvbridge.yaml}, and clusterctl.yaml, a
#                              clusterctl configuration that names it (docs/deployment.md)
#     kubectl-pvbridge_VERSION_<os>_<arch>.tar.gz   the kubectl plugin (with LICENSE) for
#                              linux and darwin, amd64 and arm64
#     krew/pvbridge.yaml       its krew manifest, the archives' URLs under RELEASE_URL
#                              (default https://github.com/pvbridge/pvbridge/releases/download/VERSION)
#     SHA256SUMS
# Every archive is reproducible: the same tree makes the same bytes.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
export CGO_ENABLED=0 SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct)}
# As the Makefile builds (its GOFLAGS, the tool cache), so that a release reuses those builds.
export GOFLAGS=${GOFLAGS:-$(cat hack/goflags)}
export PVBRIDGE_BIN=${PVBRIDGE_BIN:-${XDG_CACHE_HOME:-$HOME/.cache}/pvbridge/bin}
bin=$PVBRIDGE_BIN
fail() { echo "release: $*" >&2; exit 1; }

version=$(go run ./e2e/cmd/images -version)

check() {
	grep -q "^## $version\b" CHANGELOG.md ||
		fail "CHANGELOG.md has no section '## $version': say what it changes"
	local minor=${version#v}
	minor=${minor%.*}
	awk -v major="${minor%.*}" -v minor="${minor#*.}" '
		/- major:/ { m = $3 } /minor:/ && m == major && $2 == minor { found = 1 }
		END { exit !found }' manifests/clusterctl/metadata.yaml ||
		fail "manifests/clusterctl/metadata.yaml has no releaseSeries for $minor: add it with its Cluster API contract"
	local c
	for c in charts/*/Chart.yaml; do
		grep -qx "appVersion: $version" "$c" || fail "$c is not of $version: run make generate"
	done
}

# clusterctl_repository OUT writes the clusterctl repository of the provider into OUT.
clusterctl_repository() {
	local repo=$1/infrastructure-pvbridge/$version
	mkdir -p "$repo"
	cp manifests/clusterctl/infrastructure-components.yaml manifests/clusterctl/metadata.yaml \
		manifests/clusterctl/cluster-template.yaml manifests/clusterctl/cluster-template-topology.yaml manifests/clusterctl/cluster-template-ha.yaml \
		manifests/clusterctl/clusterclass-pvbridge.yaml "$repo/"
	cat >"$1/clusterctl.yaml" <<EOF
# clusterctl's configuration for this release's provider: clusterctl --config clusterctl.yaml
# init --infrastructure pvbridge:$version (docs/deployment.md).
providers:
  - name: pvbridge
    type: InfrastructureProvider
    url: file://$repo/infrastructure-components.yaml
EOF
}

if [ "${1:-}" = clusterctl ]; then
	out=${2:?usage: hack/release.sh clusterctl OUT}
	mkdir -p "$out"
	clusterctl_repository "$(cd "$out" && pwd)"
	exit 0
fi
if [ "${1:-}" = check ]; then
	check
	echo "release: the tree is releasable as $version"
	exit 0
fi
want=${1:?usage: hack/release.sh check | VERSION [OUT]}
[ "$want" = "$version" ] ||
	fail "the tree is $version, not $want: set the tags of pvbridge's images in manifests/components/images/kustomization.yaml, then make generate"
check
out=${2:-_output/release/$version}
rm -rf "$out"
mkdir -p "$out"
out=$(cd "$out" && pwd)

echo "== images"
go run ./e2e/cmd/images --out "$out/images"

echo "== charts"
mkdir -p "$out/charts"
for c in charts/*/; do
	"$bin/helm" package "$c" -d "$out/charts" >/dev/null
done

echo "== clusterctl repository"
clusterctl_repository "$out/clusterctl"

echo "== kubectl-pvbridge"
url=${RELEASE_URL:-https://github.com/pvbridge/pvbridge/releases/download/$version}
platforms=""
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for p in linux/amd64 linux/arm64 darwin/amd64 darwin/arm64; do
	os=${p%/*} arch=${p#*/}
	mkdir -p "$work/$os-$arch"
	GOOS=$os GOARCH=$arch go build -trimpath -buildvcs=false \
		-ldflags "-s -w -buildid= -X main.version=$version" -o "$work/$os-$arch/kubectl-pvbridge" ./pkg/cmd/kubectl-pvbridge
	cp LICENSE "$work/$os-$arch/"
	archive=kubectl-pvbridge_${version}_${os}_${arch}.tar.gz
	tar -C "$work/$os-$arch" --sort=name --mtime="@$SOURCE_DATE_EPOCH" --owner=0 --group=0 --numeric-owner \
		-cf - kubectl-pvbridge LICENSE | gzip -n >"$out/$archive"
	platforms+="  - selector:
      matchLabels: {os: $os, arch: $arch}
    uri: $url/$archive
    sha256: $(sha256sum "$out/$archive" | cut -d' ' -f1)
    bin: kubectl-pvbridge
    files:
      - {from: kubectl-pvbridge, to: .}
      - {from: LICENSE, to: .}
"
done
mkdir -p "$out/krew"
cat >"$out/krew/pvbridge.yaml" <<EOF
apiVersion: krew.googlecontainertools.github.com/v1alpha2
kind: Plugin
metadata:
  name: pvbridge
spec:
  version: $version
  homepage: https://github.com/pvbridge/pvbridge
  shortDescription: Trace, inspect and drain pvbridge's volumes, hosts and VMs
  description: |
    Operates pvbridge, the paravirtual CSI bridge of Cluster API guest clusters: trace a
    guest PVC or PV through both clusters to what holds it, list the management hosts (PMEM,
    volumes, replicas, VMs), show a VirtualMachine's volumes, drain a host before maintenance.
  platforms:
$platforms
EOF

(cd "$out" && find . -type f ! -name SHA256SUMS -printf '%P\n' | LC_ALL=C sort | xargs sha256sum >SHA256SUMS)
echo "release $version in $out"
