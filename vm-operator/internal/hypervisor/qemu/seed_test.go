package qemu

import (
	"os"
	"path/filepath"
	"testing"

	. "github.com/onsi/gomega"

	"pvbridge.io/vm-operator/internal/hypervisor"
)

// A VM started with bootstrap data gets its NoCloud seed as a read-only FAT disk labelled
// CIDATA (QEMU's vvfat over the seed directory), which is not one of its hot-plugged disks.
func TestPowerOnGivesTheBootstrapDataAsANoCloudSeed(t *testing.T) {
	g := NewWithT(t)
	d := newDriver(t, Options{})
	vm := testVM
	vm.Bootstrap = &hypervisor.Bootstrap{UserData: []byte("#cloud-config\n"), MetaData: []byte("instance-id: i-1\n")}

	startVM(t, d, vm)

	seed := filepath.Join(d.Dir(vm), seedDir)
	for name, want := range map[string]string{"user-data": "#cloud-config\n", "meta-data": "instance-id: i-1\n"} {
		data, err := os.ReadFile(filepath.Join(seed, name))
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(string(data)).To(Equal(want))
		st, err := os.Stat(filepath.Join(seed, name))
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(st.Mode().Perm()).To(Equal(os.FileMode(0o600)))
	}
	var blocks []struct {
		QDev     string `json:"qdev"`
		Inserted *struct {
			NodeName string `json:"node-name"`
			Drv      string `json:"drv"`
			RO       bool   `json:"ro"`
		} `json:"inserted"`
	}
	g.Expect(execute(t, d, vm, "query-block", nil, &blocks)).To(Succeed())
	found := false
	for _, b := range blocks {
		if b.Inserted != nil && b.Inserted.NodeName == seedID {
			found = true
			g.Expect(b.Inserted.Drv).To(Equal("vvfat"))
			g.Expect(b.Inserted.RO).To(BeTrue())
			g.Expect(b.QDev).To(ContainSubstring(seedID))
		}
	}
	g.Expect(found).To(BeTrue(), "the seed disk is attached: %+v", blocks)
	g.Expect(d.Disks(t.Context(), vm)).To(BeEmpty(), "the seed is not a hot-plugged disk")
}
