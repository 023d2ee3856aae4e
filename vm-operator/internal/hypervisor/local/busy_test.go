package local

import (
	"strings"
	"testing"

	. "github.com/onsi/gomega"
	"golang.org/x/sys/unix"
)

func TestParseMountInfo(t *testing.T) {
	tests := []struct {
		name    string
		data    string
		want    []mount
		wantErr bool
	}{
		{
			name: "filesystem and bind mounts",
			data: "22 1 253:0 / / rw,relatime shared:1 - ext4 /dev/vda rw\n" +
				"90 22 7:3 / /var/lib/staging rw,relatime shared:50 - ext4 /vms/t/n/dev/disk/by-id/virtio-d rw\n" +
				"91 22 0:5 /loop3 /var/lib/block\\040target rw - devtmpfs udev rw\n",
			want: []mount{
				{dev: unix.Mkdev(253, 0), mountPoint: "/"},
				{dev: unix.Mkdev(7, 3), mountPoint: "/var/lib/staging"},
				{dev: unix.Mkdev(0, 5), mountPoint: "/var/lib/block target"},
			},
		},
		{name: "empty", data: ""},
		{name: "short line", data: "22 1 253:0 /\n", wantErr: true},
		{name: "no device number", data: "22 1 2530 / / rw - ext4 /dev/vda rw\n", wantErr: true},
		{name: "device number out of range", data: "22 1 4294967296:0 / / rw - ext4 /dev/vda rw\n", wantErr: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			mounts, err := parseMountInfo([]byte(tt.data))
			if tt.wantErr {
				g.Expect(err).To(HaveOccurred())
				return
			}
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(mounts).To(Equal(tt.want))
		})
	}
}

// escapeOctal escapes a path as the kernel does in mountinfo.
func escapeOctal(s string) string {
	return strings.NewReplacer(`\`, `\134`, " ", `\040`, "\t", `\011`, "\n", `\012`).Replace(s)
}

func FuzzParseMountInfo(f *testing.F) {
	f.Add("/var/lib/kubelet/pods/x/volumes", uint32(7), uint32(3))
	f.Add(`/a b\c`+"\t\n", uint32(0), uint32(0))
	f.Add(`\040`, uint32(1<<12-1), uint32(1<<20-1))
	f.Fuzz(func(t *testing.T, mountPoint string, major, minor uint32) {
		line := "36 35 " + formatNumber(major, minor) + " / " + escapeOctal(mountPoint) + " rw shared:1 - ext4 /dev/x rw\n"
		mounts, err := parseMountInfo([]byte(line))
		if err != nil {
			t.Fatalf("parse %q: %v", line, err)
		}
		if len(mounts) != 1 || mounts[0].mountPoint != mountPoint || mounts[0].dev != unix.Mkdev(major, minor) {
			t.Fatalf("parse %q = %+v, want %q at %d:%d", line, mounts, mountPoint, major, minor)
		}
	})
}

func formatNumber(major, minor uint32) string { return itoa(major) + ":" + itoa(minor) }
