package driver

import (
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	. "github.com/onsi/gomega"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/validation"
)

const testUID = "4b0f3a4e-6d0c-4a43-9a39-6f1f3c1c0a11"

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
			got := mgmtName(testUID, tc.prefix, tc.csiName)
			if tc.want != "" {
				g.Expect(got).To(Equal(tc.want))
			} else {
				g.Expect(got).To(MatchRegexp("^" + testUID + "-[0-9a-f]{40}$"))
			}
			g.Expect(mgmtName(testUID, tc.prefix, tc.csiName)).To(Equal(got), "the same name gives the same object")
			g.Expect(validHandle(got)).To(BeTrue())
		})
	}
}

// Every CSI name maps to a valid object name of this cluster, the same every time, and two
// names never to the same one (the hash is taken over the whole name).
func FuzzMgmtName(f *testing.F) {
	f.Add("pvc-8a5e6f1c-0d9b-4f5e-9a1e-2b7c3d4e5f60", "pvc-x")
	f.Add("snapshot-", "../../etc")
	f.Fuzz(func(t *testing.T, a, b string) {
		na, nb := mgmtName(testUID, "pvc-", a), mgmtName(testUID, "pvc-", b)
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

func TestValidateCSIName(t *testing.T) {
	for _, tc := range []struct {
		name, csiName string
		want          codes.Code
	}{
		{"csi-provisioner's name", "pvc-" + testUID, codes.OK},
		{"at the bound", strings.Repeat("a", 512), codes.OK},
		{"at the bound in characters, not bytes", strings.Repeat("é", 512), codes.OK},
		{"empty", "", codes.InvalidArgument},
		{"over the bound the admission policy sets on pvbridge.io/csi-name", strings.Repeat("a", 513), codes.InvalidArgument},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			g.Expect(status.Code(validateCSIName(tc.csiName))).To(Equal(tc.want))
		})
	}
}

func TestParseVolumeParameters(t *testing.T) {
	for _, tc := range []struct {
		name    string
		params  map[string]string
		want    volumeParams
		wantErr string
	}{
		{"defaults", nil, volumeParams{class: "pmem"}, ""},
		{"class and metadata", map[string]string{
			ParamMgmtStorageClass: "pmem-xfs", paramPVCName: "data", paramPVCNamespace: "db", paramPVName: "pvc-1",
			"csi.storage.k8s.io/fstype": "xfs",
		}, volumeParams{class: "pmem-xfs", guestPVC: types.NamespacedName{Namespace: "db", Name: "data"}, guestPV: "pvc-1"}, ""},
		{"unknown parameter", map[string]string{"mgmtStorageClas": "x"}, volumeParams{}, `parameter "mgmtStorageClas" is not supported`},
		{"class that is no name", map[string]string{ParamMgmtStorageClass: "../premium"}, volumeParams{}, "is no StorageClass name"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := parseVolumeParameters(tc.params, "pmem")
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
		keys    snapshotKeys
		want    snapshotParams
		wantErr string
	}{
		{"snapshot defaults", nil, volumeSnapshotKeys, snapshotParams{class: "pmem"}, ""},
		{"snapshot class and metadata", map[string]string{
			ParamMgmtSnapshotClass: "pmem-snap", paramSnapName: "snap", paramSnapNamespace: "db",
			"csi.storage.k8s.io/volumesnapshotcontent/name": "snapcontent-1",
		}, volumeSnapshotKeys, snapshotParams{class: "pmem-snap", guestSnapshot: types.NamespacedName{Namespace: "db", Name: "snap"}}, ""},
		{"group class and metadata", map[string]string{
			ParamMgmtGroupSnapshotClass: "pmem-group", paramGroupName: "nightly", paramGroupNamespace: "db",
			"csi.storage.k8s.io/volumegroupsnapshotcontent/name": "groupsnapcontent-1",
		}, groupSnapshotKeys, snapshotParams{class: "pmem-group", guestSnapshot: types.NamespacedName{Namespace: "db", Name: "nightly"}}, ""},
		{"a snapshot's class in a group's parameters", map[string]string{ParamMgmtSnapshotClass: "pmem"}, groupSnapshotKeys, snapshotParams{},
			`parameter "mgmtSnapshotClass" is not supported (only mgmtVolumeGroupSnapshotClass)`},
		{"a group class that is no name", map[string]string{ParamMgmtGroupSnapshotClass: "Group"}, groupSnapshotKeys, snapshotParams{},
			`parameter mgmtVolumeGroupSnapshotClass "Group" is no VolumeGroupSnapshotClass name`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := parseSnapshotParameters(tc.params, "pmem", tc.keys)
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

// A group snapshot's management name is mgmtName's when its rest is a label value (the label of
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
			got := groupSnapshotName(testUID, tc.csiName)
			if tc.want != "" {
				g.Expect(got).To(Equal(tc.want))
			} else {
				g.Expect(got).To(MatchRegexp("^" + testUID + "-[0-9a-f]{40}$"))
			}
			g.Expect(validHandle(got)).To(BeTrue())
			g.Expect(validation.IsValidLabelValue(groupLabel(testUID, got))).To(BeEmpty())
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
		if p, err := parseVolumeParameters(map[string]string{key: value}, ""); err == nil && p.class != "" {
			if msgs := validation.IsDNS1123Subdomain(p.class); len(msgs) > 0 {
				t.Fatalf("accepted class %q: %v", p.class, msgs)
			}
		}
		for _, keys := range []snapshotKeys{volumeSnapshotKeys, groupSnapshotKeys} {
			if p, err := parseSnapshotParameters(map[string]string{key: value}, "", keys); err == nil && p.class != "" {
				if msgs := validation.IsDNS1123Subdomain(p.class); len(msgs) > 0 {
					t.Fatalf("accepted %s %q: %v", keys.classKind, p.class, msgs)
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
		if validHandle(id) && (strings.ContainsAny(id, "/\\ \x00") || strings.Contains(id, "..") || len(id) > 253) {
			t.Fatalf("accepted handle %q", id)
		}
	})
}

func TestTopologyHost(t *testing.T) {
	topo := func(host string) *csi.Topology { return &csi.Topology{Segments: map[string]string{TopologyKey: host}} }
	g := NewWithT(t)
	g.Expect(topologyHost(nil)).To(BeEmpty())
	g.Expect(topologyHost(&csi.TopologyRequirement{Requisite: []*csi.Topology{topo("a"), topo("b")}, Preferred: []*csi.Topology{topo("b")}})).To(Equal("b"))
	g.Expect(topologyHost(&csi.TopologyRequirement{Requisite: []*csi.Topology{{Segments: map[string]string{"zone": "z"}}, topo("a")}})).To(Equal("a"))
}
