package v1alpha1

import (
	"crypto/sha256"
	"encoding/hex"

	"k8s.io/apimachinery/pkg/util/validation"
)

// AttachmentName is the name of the management VolumeAttachment of volume in VirtualMachine
// namespace/vm, which vm-operator's controller makes and its host agents read: "vm-" and the
// first 40 hex digits of SHA-256("<namespace>/<vm>/<volume>"). The same volume always gives the
// same name, so a restarted controller finds the attachment it made instead of making another,
// and the host agent finds it without a lookup.
func AttachmentName(namespace, vm, volume string) string {
	sum := sha256.Sum256([]byte(namespace + "/" + vm + "/" + volume))
	return "vm-" + hex.EncodeToString(sum[:])[:40]
}

// AttachmentLabels are the labels of every VolumeAttachment of vm.
func AttachmentLabels(vm *VirtualMachine) map[string]string {
	return map[string]string{
		VMNamespaceLabel: LabelValue(vm.Namespace),
		VMNameLabel:      LabelValue(vm.Name),
	}
}

// LabelValue returns s when it fits in a label value, otherwise its first 22 characters, "-" and
// 40 hex digits of its SHA-256 (63 characters). Object names are DNS subdomains of up to 253
// characters, label values at most 63.
func LabelValue(s string) string {
	if len(s) <= validation.LabelValueMaxLength {
		return s
	}
	sum := sha256.Sum256([]byte(s))
	return s[:22] + "-" + hex.EncodeToString(sum[:])[:40]
}
