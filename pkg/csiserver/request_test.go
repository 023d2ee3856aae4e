package csiserver

import (
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	. "github.com/onsi/gomega"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

func TestRequestedSize(t *testing.T) {
	for _, tc := range []struct {
		name   string
		r      *csi.CapacityRange
		want   int64
		reject bool
	}{
		{"no range", nil, DefaultVolumeSize, false},
		{"required", &csi.CapacityRange{RequiredBytes: 5 << 20}, 5 << 20, false},
		{"limit below the default", &csi.CapacityRange{LimitBytes: 8 << 20}, 8 << 20, false},
		{"limit above the default", &csi.CapacityRange{LimitBytes: 8 << 30}, DefaultVolumeSize, false},
		{"negative", &csi.CapacityRange{RequiredBytes: -1}, 0, true},
		{"inverted", &csi.CapacityRange{RequiredBytes: 2, LimitBytes: 1}, 0, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			got, err := RequestedSize(tc.r)
			if tc.reject {
				g.Expect(status.Code(err)).To(Equal(codes.InvalidArgument))
				return
			}
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(got).To(Equal(tc.want))
		})
	}
}

func TestPage(t *testing.T) {
	entries := []int{0, 1, 2, 3, 4}
	for _, tc := range []struct {
		name     string
		token    string
		max      int32
		want     []int
		wantNext string
		aborted  bool
	}{
		{"all", "", 0, entries, "", false},
		{"first page", "", 2, []int{0, 1}, "2", false},
		{"middle page", "2", 2, []int{2, 3}, "4", false},
		{"last page", "4", 2, []int{4}, "", false},
		{"past the end", "5", 0, []int{}, "", false},
		{"not a number", "x", 0, nil, "", true},
		{"beyond the list", "6", 0, nil, "", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			page, next, err := Page(entries, tc.token, tc.max)
			if tc.aborted {
				g.Expect(status.Code(err)).To(Equal(codes.Aborted))
				return
			}
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(page).To(Equal(tc.want))
			g.Expect(next).To(Equal(tc.wantNext))
		})
	}
}
