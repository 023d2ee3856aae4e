#!/usr/bin/env bash
# Builds the pinned third-party binaries (Kubernetes, etcd, CSI sidecars, csi-sanity, code
# generators, linters, Cluster API, the registry and CoreDNS of the lab's guests, Prometheus and
# promtool, helm) from the Go module proxy, once, into a cache outside the repository:
#
#   $PVBRIDGE_CACHE/<component>-<version>/<binary>    the build
#   $PVBRIDGE_CACHE/bin/<binary>                      a symlink to the pinned build
#
# A tool module under hack/tools/<module> pins each component's version (and its replace
# directives, which is why `go install` cannot build most of them). The Kubernetes binaries, etcd,
# containerd, the CSI sidecars, csi-sanity, Cluster API, CoreDNS, Prometheus and helm share one module
# (hack/tools/kubernetes) and one set of build flags (hack/goflags), and pvbridge's modules require the same
# versions of the libraries they have in common with it:
# with one version of each library they share, the Go build cache compiles client-go, apiserver,
# grpc and the rest once instead of once per sidecar. A component whose binaries exist is not
# rebuilt, so a rerun with everything cached does no work.
#
# Usage: [LANES=others|kubernetes] hack/build-tools.sh [component ...]
#        (default: all, both lanes)
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cache=${PVBRIDGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pvbridge}
# Every tool, and pvbridge's own builds (the Makefile exports them), builds with the flags of
# hack/goflags: the Go build cache keys every package's compile by its build tags and compiler
# flags, so builds with other flags share no package, not even those whose files no tag selects.
# The tags leave out what no binary here uses (grpc's x/net/trace, containerd's btrfs, every
# Prometheus service discovery but Kubernetes': the lab's Prometheus discovers the metrics
# Services of both clusters as the ServiceMonitor does); -dwarf=false spares the compiler the
# debug information that every link here strips (-w) or no test reads: 14 % of a compile's CPU.
export GOWORK=off CGO_ENABLED=0 GOFLAGS="-buildvcs=false $(cat "$root/hack/goflags")"
# The compiler and linker collect their garbage at 5 times their live heap instead of twice
# (GOGC=400; the Makefile's COMPILE_ENV for pvbridge's own builds): 12 to 15 % less CPU per
# compile, measured on client-go's dependencies, for at most 3 GiB per process (GOMEMLIMIT);
# the machine that builds is short of CPU, not memory.
export GOGC=${GOGC:-400} GOMEMLIMIT=${GOMEMLIMIT:-3GiB}

k8s_version=v1.37.2
k8s_ldflags() {
	local v=$1 minor
	minor=$(echo "$v" | cut -d. -f2)
	local x=""
	for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
		x+=" -X $p.gitVersion=$v -X $p.gitMajor=1 -X $p.gitMinor=$minor -X $p.gitTreeState=clean"
	done
	echo "$x"
}

capi_version=v1.14.2
capi_ldflags() {
	local v=$1 p=sigs.k8s.io/cluster-api/version
	echo " -X $p.gitVersion=$v -X $p.gitMajor=$(echo "$v" | cut -d. -f1 | tr -d v) -X $p.gitMinor=$(echo "$v" | cut -d. -f2) -X $p.gitTreeState=clean"
}

# component | module | version | extra ldflags | binary=package ...
# etcd and Kubernetes first: the unit tests' apiservers need them (.ci/run starts those tests
# beside the rest of the build).
components() {
	cat <<EOF
etcd|kubernetes|v3.7.2||etcd=go.etcd.io/etcd/server/v3
kubernetes|kubernetes|$k8s_version|$(k8s_ldflags $k8s_version)|kube-apiserver=k8s.io/kubernetes/cmd/kube-apiserver kube-controller-manager=k8s.io/kubernetes/cmd/kube-controller-manager kube-scheduler=k8s.io/kubernetes/cmd/kube-scheduler kubelet=k8s.io/kubernetes/cmd/kubelet kubectl=k8s.io/kubernetes/cmd/kubectl kubeadm=k8s.io/kubernetes/cmd/kubeadm kube-proxy=k8s.io/kubernetes/cmd/kube-proxy
containerd|kubernetes|v2.4.2| -X github.com/containerd/containerd/v2/version.Version=v2.4.2|containerd=github.com/containerd/containerd/v2/cmd/containerd containerd-shim-runc-v2=github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2 ctr=github.com/containerd/containerd/v2/cmd/ctr
csi-provisioner|kubernetes|v6.4.0| -X main.version=v6.4.0|csi-provisioner=github.com/kubernetes-csi/external-provisioner/v6/cmd/csi-provisioner
csi-attacher|kubernetes|v4.13.0| -X main.version=v4.13.0|csi-attacher=github.com/kubernetes-csi/external-attacher/v4/cmd/csi-attacher
csi-resizer|kubernetes|v2.3.0| -X main.version=v2.3.0|csi-resizer=github.com/kubernetes-csi/external-resizer/v2/cmd/csi-resizer
csi-snapshotter|kubernetes|v8.7.0| -X main.version=v8.7.0|csi-snapshotter=github.com/kubernetes-csi/external-snapshotter/v8/cmd/csi-snapshotter snapshot-controller=github.com/kubernetes-csi/external-snapshotter/v8/cmd/snapshot-controller
storage-e2e|kubernetes|$k8s_version|$(k8s_ldflags $k8s_version)|e2e.test=./storage-e2e agnhost=k8s.io/kubernetes/test/images/agnhost
csi-sanity|kubernetes|v5.6.0||csi-sanity=github.com/kubernetes-csi/csi-test/v5/cmd/csi-sanity
ginkgo|kubernetes|v2.33.0||ginkgo=github.com/onsi/ginkgo/v2/ginkgo
registry|registry|v3.1.2| -X github.com/distribution/distribution/v3/version.version=v3.1.2|registry=./registry
prometheus|kubernetes|v0.316.0| -X github.com/prometheus/common/version.Version=3.16.0 -X github.com/prometheus/common/version.Branch=HEAD|prometheus=github.com/prometheus/prometheus/cmd/prometheus promtool=github.com/prometheus/prometheus/cmd/promtool
helm|kubernetes|v4.3.1| -X helm.sh/helm/v4/internal/version.version=v4.3.1|helm=helm.sh/helm/v4/cmd/helm
coredns|kubernetes|v1.14.6| -X github.com/coredns/coredns/coremain.GitCommit=v1.14.6|coredns=./coredns
cluster-api|kubernetes|$capi_version|$(capi_ldflags $capi_version)|capi-manager=sigs.k8s.io/cluster-api/core capi-kubeadm-bootstrap-manager=sigs.k8s.io/cluster-api/bootstrap/kubeadm capi-kubeadm-control-plane-manager=sigs.k8s.io/cluster-api/controlplane/kubeadm clusterctl=sigs.k8s.io/cluster-api/cmd/clusterctl
controller-gen|controller-gen|v0.23.0||controller-gen=sigs.k8s.io/controller-tools/cmd/controller-gen
golangci-lint|golangci-lint|v2.15.0||golangci-lint=github.com/golangci/golangci-lint/v2/cmd/golangci-lint
EOF
}

want=("$@")
selected() {
	[ ${#want[@]} -eq 0 ] && return 0
	local w
	for w in "${want[@]}"; do [ "$w" = "$1" ] && return 0; done
	return 1
}

# build_lane builds the selected components whose module is (lane "kubernetes") or is not (lane
# "others") hack/tools/kubernetes, one component after the other. The missing binaries of a
# component that are named as their package build in one go build (one action graph: its links
# overlap the compiles of the others, instead of leaving a core idle); the others one by one.
build_lane() {
	local lane=$1 n=0 total comp module version ldflags bins dir spec bin pkg start build lock
	local -a batch single
	total=$(components | wc -l)
	while IFS='|' read -r comp module version ldflags bins; do
		n=$((n + 1))
		selected "$comp" || continue
		{ [ "$lane" = kubernetes ] && [ "$module" = kubernetes ]; } ||
			{ [ "$lane" = others ] && [ "$module" != kubernetes ]; } || continue
		dir="$cache/$comp-$version"
		mkdir -p "$dir"
		# One build of a component at a time: another build-tools.sh (.ci/run's unit tests wait
		# here for the kube-apiserver and etcd the tools' long lane is building) waits for it,
		# then finds its binaries built.
		exec {lock}>"$dir/.lock"
		flock "$lock"
		batch=() single=()
		for spec in $bins; do
			bin=${spec%%=*} pkg=${spec#*=}
			if [ -x "$dir/$bin" ]; then
				echo "[$n/$total] $bin $version: cached"
			elif [[ $bin != *.test && $bin == "$(basename "$pkg")" ]]; then
				batch+=("$pkg")
			else
				single+=("$spec")
			fi
		done
		# One binary alone is built as the others are, by name.
		if [ ${#batch[@]} -eq 1 ]; then
			single+=("$(basename "${batch[0]}")=${batch[0]}")
			batch=()
		fi
		if [ ${#batch[@]} -gt 0 ]; then
			echo "[$n/$total] ${batch[*]##*/} $version: building ..."
			start=$(date +%s)
			rm -rf "$dir/.batch" && mkdir "$dir/.batch"
			(cd "$root/hack/tools/$module" &&
				go build -trimpath -ldflags "all=$ldflags -s -w" -o "$dir/.batch/" "${batch[@]}")
			for pkg in "${batch[@]}"; do mv "$dir/.batch/$(basename "$pkg")" "$dir/"; done
			rmdir "$dir/.batch"
			echo "[$n/$total] ${batch[*]##*/} $version: built in $(($(date +%s) - start))s"
		fi
		for spec in "${single[@]}"; do
			bin=${spec%%=*} pkg=${spec#*=}
			echo "[$n/$total] $bin $version: building ..."
			start=$(date +%s)
			# A binary named *.test is a package's test binary (Kubernetes' e2e.test), built
			# without go vet, which go test -c otherwise runs over every package it imports
			# (the analyzers' facts): on a fresh machine, 2 585 vet processes and 114 CPU-s,
			# most of them e2e.test's (mgmt-csi's NVDIMM test builds its guest's tests so too).
			build=(build)
			[[ $bin == *.test ]] && build=(test -c -vet=off)
			(cd "$root/hack/tools/$module" &&
				go "${build[@]}" -trimpath -ldflags "all=$ldflags -s -w" -o "$dir/$bin.tmp" "$pkg")
			mv "$dir/$bin.tmp" "$dir/$bin"
			echo "[$n/$total] $bin $version: built in $(($(date +%s) - start))s"
		done
		for spec in $bins; do
			ln -sfn "$dir/${spec%%=*}" "$cache/bin/${spec%%=*}"
		done
		exec {lock}>&-
	done < <(components)
}

# Two lanes at once: a go build leaves a core idle while it links or compiles one large package
# whose dependants wait for it, and the other lane's build fills it. $LANES picks lanes (both by
# default): .ci/run lints once the short lane is built, beside the long one.
mkdir -p "$cache/bin"
pids=()
for lane in ${LANES:-others kubernetes}; do
	build_lane "$lane" &
	pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done
