#!/usr/bin/env bash
# Copies the VolumeSnapshot CRDs (three snapshot.storage.k8s.io and three
# groupsnapshot.storage.k8s.io: snapshot-controller waits for all six) of the pinned
# external-snapshotter into manifests/crd/snapshot.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dir=$(cd "$root/hack/tools/kubernetes" &&
	GOWORK=off go mod download -json github.com/kubernetes-csi/external-snapshotter/client/v8 | jq -r .Dir)
out="$root/manifests/crd/snapshot"
mkdir -p "$out"
rm -f "$out"/*storage.k8s.io_*.yaml
cp "$dir"/config/crd/*storage.k8s.io_*.yaml "$out"/
chmod 644 "$out"/*storage.k8s.io_*.yaml
