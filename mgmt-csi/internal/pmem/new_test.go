package pmem

import (
	"testing"

	. "github.com/onsi/gomega"

	pmemv1 "pvbridge.io/pkg/apis/pmem/v1alpha1"
)

func TestNewByMode(t *testing.T) {
	for _, tc := range []struct {
		mode    pmemv1.Mode
		opts    func(t *testing.T) Options
		wantErr bool
	}{
		{mode: pmemv1.ModeFile, opts: func(t *testing.T) Options { return Options{File: FileOptions{Dir: t.TempDir()}} }},
		{mode: pmemv1.ModeLVM, opts: func(t *testing.T) Options {
			return Options{LVM: LVMOptions{
				VolumeGroups: []string{"pmem-region0", "pmem-region1"},
				Runner:       replay(t, "lvm", vgs, call{cmd: lvsCmd, stdout: "@lvs-empty.json"}),
			}}
		}},
		{mode: pmemv1.ModeNdctl, opts: func(*testing.T) Options { return Options{} }},
		{mode: "direct", opts: func(*testing.T) Options { return Options{} }, wantErr: true},
	} {
		t.Run(string(tc.mode), func(t *testing.T) {
			g := NewWithT(t)
			b, err := New(t.Context(), tc.mode, tc.opts(t))
			if tc.wantErr {
				g.Expect(err).To(HaveOccurred())
				return
			}
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(b.Mode()).To(Equal(tc.mode))
		})
	}
}
