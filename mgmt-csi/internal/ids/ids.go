// Package ids derives mgmt-csi's volume and snapshot IDs from CSI names. It imports nothing
// heavier than apimachinery's validation: its fuzz test instruments every package it holds.
package ids

import (
	"crypto/sha256"
	"encoding/hex"

	"k8s.io/apimachinery/pkg/util/validation"
)

// For derives a volume or snapshot ID from a CSI name. The ID is written on the device (file
// name, LV tag, ndctl namespace name: at most 63 characters) and names the PmemVolume or
// PmemSnapshot object, so it must be a DNS label. csi-provisioner's names (pvc-<uid>,
// snapshot-<uid>) are used as they are, which keeps them recognisable in `kubectl get pmv`;
// any other name becomes "<prefix>-" and 40 hex digits of its SHA-256, so that two names never
// share an ID. The same name always yields the same ID: that is what makes CreateVolume and
// CreateSnapshot idempotent across restarts.
func For(prefix, name string) string {
	if len(validation.IsDNS1123Label(name)) == 0 {
		return name
	}
	sum := sha256.Sum256([]byte(name))
	return prefix + "-" + hex.EncodeToString(sum[:20])
}
