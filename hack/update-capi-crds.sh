#!/usr/bin/env bash
# Copies the Cluster API Cluster and Machine CRDs of the pinned Cluster API release into
# manifests/crd/capi: the lab's management cluster holds each guest's Cluster object (its UID is
# the guest's identity) without running Cluster API itself, and the infrastructure provider's
# tests (vm-operator/internal/capi) play Cluster API's controllers over real Machines.
set -euo pipefail
version=v1.14.2
root=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
dir=$(cd "$tmp" && go mod init probe >/dev/null 2>&1 &&
	GOWORK=off GOFLAGS=-mod=mod go mod download -json "sigs.k8s.io/cluster-api@$version" | jq -r .Dir)
out="$root/manifests/crd/capi"
mkdir -p "$out"
rm -f "$out"/*.yaml
cp "$dir"/core/config/crd/bases/cluster.x-k8s.io_{clusters,machines}.yaml "$out"/
chmod 644 "$out"/*.yaml
