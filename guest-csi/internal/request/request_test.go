package request

import (
	"errors"
	"path/filepath"
	"strings"
	"testing"

	. "github.com/onsi/gomega"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/validation"
)

const testUID = "4b0f3a4e-6d0c-4a43-9a39-6f1f3c1c0a11"

// publishContext is a publish context with the disk serial s.
func publishContext(s string) map[string]string {
	return map[string]string{PublishContextSerial: s}
}

func TestMgmtName(t *testing.T) {
	const uid = "8a5e6f1c-0d9b-4f5e-9a1e-2b7c3d4e5f60"
	for _, tc := range []struct {
		name, prefix, csiName string
		want                  string // "" for a hashed name
	}{
		{"csi-provisioner's name", "pvc-", "pvc-" + uid, testUID + "-" + uid},
		{"csi-snapshotter's name", "snapshot-", "snapshot-" + uid, testUID + "-" + uid},
		{"another prefix", "pvc-", "vol-abc", ""},
		{"upper case", "pvc-", "pvc-ABC", ""},
		{"prefix only", "pvc-", "pvc-", ""},
		{"too long", "pvc-", "pvc-" + strings.Repeat("a", 250), ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			got := MgmtName(testUID, tc.prefix, tc.csiName)
			if tc.want != "" {
				g.Expect(got).To(Equal(tc.want))
			} else {
				g.Expect(got).To(MatchRegexp("^" + testUID + "-[0-9a-f]{40}$"))
			}
			g.Expect(MgmtName(testUID, tc.prefix, tc.csiName)).To(Equal(got), "the same name gives the same object")
			g.Expect(ValidHandle(got)).To(BeTrue())
		})
	}
}

// Every CSI name maps to a valid object name of this cluster, the same every time, and two
// names never to the same one (the hash is taken over the whole name).
func FuzzMgmtName(f *testing.F) {
	f.Add("pvc-8a5e6f1c-0d9b-4f5e-9a1e-2b7c3d4e5f60", "pvc-x")
	f.Add("snapshot-", "../../etc")
	f.Fuzz(func(t *testing.T, a, b string) {
		na, nb := MgmtName(testUID, "pvc-", a), MgmtName(testUID, "pvc-", b)
		if msgs := validation.IsDNS1123Subdomain(na); len(msgs) > 0 {
			t.Fatalf("%q → %q: %v", a, na, msgs)
		}
		if !strings.HasPrefix(na, testUID+"-") {
			t.Fatalf("%q → %q is not the cluster's", a, na)
		}
		if a != b && na == nb {
			t.Fatalf("%q and %q both map to %q", a, b, na)
		}
	})
}

func TestParseVolumeParameters(t *testing.T) {
	for _, tc := range []struct {
		name    string
		params  map[string]string
		want    VolumeParams
		wantErr string
	}{
		{"defaults", nil, VolumeParams{Class: "pmem"}, ""},
		{"class and metadata", map[string]string{
			ParamMgmtStorageClass: "pmem-xfs", ParamPVCName: "data", ParamPVCNamespace: "db", ParamPVName: "pvc-1",
			"csi.storage.k8s.io/fstype": "xfs",
		}, VolumeParams{Class: "pmem-xfs", GuestPVC: types.NamespacedName{Namespace: "db", Name: "data"}, GuestPV: "pvc-1"}, ""},
		{"replicated", map[string]string{ParamMgmtStorageClass: "pmem-replicated", ParamReplicated: "true"},
			VolumeParams{Class: "pmem-replicated", Replicated: true}, ""},
		{"not replicated", map[string]string{ParamReplicated: "false"}, VolumeParams{Class: "pmem"}, ""},
		{"replicated neither true nor false", map[string]string{ParamReplicated: "yes"}, VolumeParams{}, `parameter replicated "yes" is neither "true" nor "false"`},
		{"unknown parameter", map[string]string{"mgmtStorageClas": "x"}, VolumeParams{}, `parameter "mgmtStorageClas" is not supported`},
		{"class that is no name", map[string]string{ParamMgmtStorageClass: "../premium"}, VolumeParams{}, "is no StorageClass name"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := ParseVolumeParameters(tc.params, "pmem")
			expectParsed(t, got, err, tc.want, tc.wantErr)
		})
	}
}

// A snapshot's and a group snapshot's parameters: the class of their kind, the guest object's
// name that csi-snapshotter adds, nothing else.
func TestParseSnapshotParameters(t *testing.T) {
	for _, tc := range []struct {
		name    string
		params  map[string]string
		keys    SnapshotKeys
		want    SnapshotParams
		wantErr string
	}{
		{"snapshot defaults", nil, VolumeSnapshotKeys, SnapshotParams{Class: "pmem"}, ""},
		{"snapshot class and metadata", map[string]string{
			ParamMgmtSnapshotClass: "pmem-snap", ParamSnapName: "snap", ParamSnapNamespace: "db",
			"csi.storage.k8s.io/volumesnapshotcontent/name": "snapcontent-1",
		}, VolumeSnapshotKeys, SnapshotParams{Class: "pmem-snap", GuestSnapshot: types.NamespacedName{Namespace: "db", Name: "snap"}}, ""},
		{"group class and metadata", map[string]string{
			ParamMgmtGroupSnapshotClass: "pmem-group", ParamGroupName: "nightly", ParamGroupNamespace: "db",
			"csi.storage.k8s.io/volumegroupsnapshotcontent/name": "groupsnapcontent-1",
		}, GroupSnapshotKeys, SnapshotParams{Class: "pmem-group", GuestSnapshot: types.NamespacedName{Namespace: "db", Name: "nightly"}}, ""},
		{"a snapshot's class in a group's parameters", map[string]string{ParamMgmtSnapshotClass: "pmem"}, GroupSnapshotKeys, SnapshotParams{},
			`parameter "mgmtSnapshotClass" is not supported (only mgmtVolumeGroupSnapshotClass)`},
		{"a group class that is no name", map[string]string{ParamMgmtGroupSnapshotClass: "Group"}, GroupSnapshotKeys, SnapshotParams{},
			`parameter mgmtVolumeGroupSnapshotClass "Group" is no VolumeGroupSnapshotClass name`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := ParseSnapshotParameters(tc.params, "pmem", tc.keys)
			expectParsed(t, got, err, tc.want, tc.wantErr)
		})
	}
}

// expectParsed checks what parsing parameters gave: an InvalidArgument that says wantErr, or,
// when wantErr is "", want.
func expectParsed[T any](t *testing.T, got T, err error, want T, wantErr string) {
	t.Helper()
	g := NewWithT(t)
	if wantErr != "" {
		g.Expect(status.Code(err)).To(Equal(codes.InvalidArgument))
		g.Expect(err.Error()).To(ContainSubstring(wantErr))
		return
	}
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(got).To(Equal(want))
}

// A group snapshot's management name is MgmtName's when its rest is a label value (the label of
// its member claims), a hash otherwise.
func TestGroupSnapshotName(t *testing.T) {
	const uid = "8a5e6f1c-0d9b-4f5e-9a1e-2b7c3d4e5f60"
	for _, tc := range []struct {
		name, csiName string
		want          string // "" for a hashed name
	}{
		{"csi-snapshotter's name", "groupsnapshot-" + uid, testUID + "-" + uid},
		{"a rest of 63 characters", "groupsnapshot-" + strings.Repeat("a", 63), testUID + "-" + strings.Repeat("a", 63)},
		{"a rest too long for a label value", "groupsnapshot-" + strings.Repeat("a", 64), ""},
		{"a rest that starts with a dash", "groupsnapshot--a", ""},
		{"another prefix", "group-" + uid, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			got := GroupSnapshotName(testUID, tc.csiName)
			if tc.want != "" {
				g.Expect(got).To(Equal(tc.want))
			} else {
				g.Expect(got).To(MatchRegexp("^" + testUID + "-[0-9a-f]{40}$"))
			}
			g.Expect(ValidHandle(got)).To(BeTrue())
			g.Expect(validation.IsValidLabelValue(GroupLabel(testUID, got))).To(BeEmpty())
		})
	}
}

// Whatever a tenant writes into its StorageClass or VolumeSnapshotClass, a class that is
// accepted is an object name.
func FuzzParseParameters(f *testing.F) {
	f.Add("mgmtStorageClass", "pmem")
	f.Add("mgmtSnapshotClass", "a/b")
	f.Add("mgmtVolumeGroupSnapshotClass", "Group")
	f.Fuzz(func(t *testing.T, key, value string) {
		if p, err := ParseVolumeParameters(map[string]string{key: value}, ""); err == nil && p.Class != "" {
			if msgs := validation.IsDNS1123Subdomain(p.Class); len(msgs) > 0 {
				t.Fatalf("accepted class %q: %v", p.Class, msgs)
			}
		}
		for _, keys := range []SnapshotKeys{VolumeSnapshotKeys, GroupSnapshotKeys} {
			if p, err := ParseSnapshotParameters(map[string]string{key: value}, "", keys); err == nil && p.Class != "" {
				if msgs := validation.IsDNS1123Subdomain(p.Class); len(msgs) > 0 {
					t.Fatalf("accepted %s %q: %v", keys.classKind, p.Class, msgs)
				}
			}
		}
	})
}

// A volume handle is a tenant's word (a static PV's volumeHandle): an accepted one is an object
// name, never a path or a name in another namespace.
func FuzzValidHandle(f *testing.F) {
	f.Add("imported-volume")
	f.Add("other-ns/pvc")
	f.Fuzz(func(t *testing.T, id string) {
		if ValidHandle(id) && (strings.ContainsAny(id, "/\\ \x00") || strings.Contains(id, "..") || len(id) > 253) {
			t.Fatalf("accepted handle %q", id)
		}
	})
}

func TestSerialFrom(t *testing.T) {
	tests := []struct {
		name    string
		ctx     map[string]string
		want    string
		wantErr string
	}{
		{name: "a pvbridge serial", ctx: publishContext("pvb-0123456789abcdef"), want: "pvb-0123456789abcdef"},
		{name: "other keys are ignored", ctx: map[string]string{PublishContextSerial: "s_1", "other": "x"}, want: "s_1"},
		{name: "no publish context", ctx: nil, wantErr: "publish_context has no diskSerial"},
		{name: "an empty serial", ctx: publishContext(""), wantErr: "publish_context has no diskSerial"},
		{name: "longer than virtio-blk passes", ctx: publishContext("pvb-0123456789abcdef0"), wantErr: "longer than 20"},
		{name: "a path", ctx: publishContext("../../vda"), wantErr: "may only contain"},
		{name: "a slash", ctx: publishContext("a/b"), wantErr: "may only contain"},
		{name: "whitespace", ctx: publishContext("pvb-1\n"), wantErr: "may only contain"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			got, err := SerialFrom(tt.ctx)
			if tt.wantErr != "" {
				g.Expect(err).To(MatchError(ErrInvalidSerial))
				g.Expect(err.Error()).To(ContainSubstring(tt.wantErr))
				return
			}
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(got).To(Equal(tt.want))
		})
	}
}

// FuzzSerialFrom proves that a serial accepted from the publish context, which the management
// side controls, can never leave the device root: it names one file, in the directory it is
// joined to.
func FuzzSerialFrom(f *testing.F) {
	for _, s := range []string{"pvb-0123456789abcdef", "", "..", "../x", "a/b", "a\x00b", "ü", "01234567890123456789x"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		serial, err := SerialFrom(publishContext(s))
		if err != nil {
			if !errors.Is(err, ErrInvalidSerial) {
				t.Fatalf("SerialFrom(%q) = %v, not an invalid serial", s, err)
			}
			return
		}
		if serial != s || len(serial) == 0 || len(serial) > MaxSerialLength {
			t.Fatalf("SerialFrom(%q) = %q", s, serial)
		}
		dir := "/root/dev/disk/by-id"
		if p := filepath.Join(dir, "virtio-"+serial); filepath.Dir(p) != dir || filepath.Base(p) != "virtio-"+serial {
			t.Fatalf("serial %q names %s, outside %s", serial, p, dir)
		}
		if p := filepath.Join("/root/sys/block", serial); serial == "." || serial == ".." || filepath.Dir(p) != "/root/sys/block" {
			t.Fatalf("serial %q is a path", serial)
		}
	})
}
