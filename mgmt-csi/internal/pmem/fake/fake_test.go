package fake

import (
	"errors"
	"testing"

	. "github.com/onsi/gomega"

	"pvbridge.io/mgmt-csi/internal/pmem"
	pmemv1 "pvbridge.io/pkg/apis/pmem/v1alpha1"
)

func TestFakeFollowsTheBackendContract(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	f := New(Options{Capacity: 64 << 20})
	g.Expect(f.Mode()).To(Equal(pmemv1.ModeFile))

	v, err := f.CreateVolume(ctx, "a", 3<<20+1, nil)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(v.Size).To(Equal(int64(4 << 20)))
	again, err := f.CreateVolume(ctx, "a", 8<<20, nil)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(again).To(Equal(v))

	_, err = f.CreateVolume(ctx, "big", 61<<20, nil)
	g.Expect(err).To(MatchError(pmem.ErrNoSpace))
	_, err = f.CreateVolume(ctx, "Bad_ID", 1, nil)
	g.Expect(err).To(MatchError(pmem.ErrInvalid))
	_, err = f.CreateVolume(ctx, "b", 0, &pmem.Source{SnapshotID: "missing"})
	g.Expect(err).To(MatchError(pmem.ErrNotFound))

	s, err := f.CreateSnapshot(ctx, "s", "a")
	g.Expect(err).NotTo(HaveOccurred())
	_, err = f.CreateSnapshot(ctx, "s", "other")
	g.Expect(err).To(MatchError(pmem.ErrInvalid))
	restored, err := f.CreateVolume(ctx, "r", 0, &pmem.Source{SnapshotID: "s"})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(restored.Size).To(Equal(s.Size))

	c, err := f.Capacity(ctx)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(c).To(Equal(pmem.Capacity{Total: 64 << 20, Free: 52 << 20, LargestAllocatable: 52 << 20, Alignment: 1 << 20}))

	_, err = f.ExpandVolume(ctx, "a", 100<<20)
	g.Expect(err).To(MatchError(pmem.ErrNoSpace))
	v, err = f.ExpandVolume(ctx, "a", 10<<20)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(v.Size).To(Equal(int64(10 << 20)))

	f.SetInUse("a", true)
	g.Expect(f.DeleteVolume(ctx, "a")).To(MatchError(pmem.ErrInUse))
	f.SetInUse("a", false)
	g.Expect(f.DeleteVolume(ctx, "a")).To(Succeed())
	g.Expect(f.DeleteVolume(ctx, "a")).To(Succeed())
	_, err = f.GetVolume(ctx, "a")
	g.Expect(err).To(MatchError(pmem.ErrNotFound))
	vols, err := f.ListVolumes(ctx)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(vols).To(Equal([]pmem.Volume{restored}))
	g.Expect(f.DeleteSnapshot(ctx, "s")).To(Succeed())
	snaps, err := f.ListSnapshots(ctx)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(snaps).To(BeEmpty())
}

func TestFakeInjectsErrorsPerMethod(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	f := New(Options{Mode: pmemv1.ModeLVM})
	boom := errors.New("boom")
	f.InjectError(CreateVolume, boom)
	_, err := f.CreateVolume(ctx, "a", 1, nil)
	g.Expect(err).To(MatchError(boom))
	_, err = f.Capacity(ctx)
	g.Expect(err).NotTo(HaveOccurred(), "other methods are unaffected")
	f.InjectError(CreateVolume, nil)
	_, err = f.CreateVolume(ctx, "a", 1, nil)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(f.Calls(CreateVolume)).To(Equal(2))
	g.Expect(f.Mode()).To(Equal(pmemv1.ModeLVM))
}
