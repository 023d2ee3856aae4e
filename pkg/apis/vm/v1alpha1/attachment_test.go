package v1alpha1

import (
	"strings"
	"testing"

	. "github.com/onsi/gomega"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/validation"
)

func TestAttachmentNameNeverChanges(t *testing.T) {
	g := NewWithT(t)
	// Golden: a changed scheme would orphan every existing attachment.
	g.Expect(AttachmentName("tenant-a", "node-1", "3f2a-vol")).To(Equal("vm-21e115ff454b053796a011da54aa25a02bc9799c"))
	g.Expect(AttachmentName("tenant-a", "node-1", "vol-b")).NotTo(Equal(AttachmentName("tenant-a", "node-1b", "vol")))
	g.Expect(validation.IsDNS1123Subdomain(AttachmentName("a", "b", "c"))).To(BeEmpty())
}

func TestAttachmentLabelsFitLongNames(t *testing.T) {
	long := strings.Repeat("n", 60) + ".example-machine-1"
	tests := []struct {
		name, vmName, want string
	}{
		{name: "a short name is the label", vmName: "node-1", want: "node-1"},
		{name: "a 63-character name is the label", vmName: strings.Repeat("a", 63), want: strings.Repeat("a", 63)},
		{name: "a longer name is shortened with its hash", vmName: long, want: strings.Repeat("n", 22) + "-"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			labels := AttachmentLabels(&VirtualMachine{ObjectMeta: metav1.ObjectMeta{Namespace: "tenant-a", Name: tt.vmName}})
			got := labels[VMNameLabel]
			g.Expect(validation.IsValidLabelValue(got)).To(BeEmpty())
			g.Expect(got).To(HavePrefix(tt.want))
			g.Expect(labels).To(HaveKeyWithValue(VMNamespaceLabel, "tenant-a"))
		})
	}
	g := NewWithT(t)
	g.Expect(LabelValue(long)).To(HaveLen(validation.LabelValueMaxLength))
	g.Expect(LabelValue(long)).NotTo(Equal(LabelValue(long + "x")))
}
