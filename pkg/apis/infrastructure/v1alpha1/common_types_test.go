package v1alpha1

import (
	"testing"

	. "github.com/onsi/gomega"
)

func TestProviderID(t *testing.T) {
	g := NewWithT(t)
	g.Expect(ProviderID("tenant-a", "guest-1-md-0-x1")).To(Equal("pvbridge://tenant-a/guest-1-md-0-x1"))
	ns, name, err := ParseProviderID("pvbridge://tenant-a/guest-1-md-0-x1")
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect([]string{ns, name}).To(Equal([]string{"tenant-a", "guest-1-md-0-x1"}))
	for _, bad := range []string{"", "pvbridge://", "pvbridge://tenant-a", "pvbridge:///vm", "pvbridge://ns/", "kubevirt://ns/vm", "pvbridge://ns/a/b"} {
		_, _, err := ParseProviderID(bad)
		g.Expect(err).To(HaveOccurred(), bad)
	}
}
