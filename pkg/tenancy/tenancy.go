// Package tenancy names what ties management objects to the guest cluster they serve, and
// decides which of them a guest cluster may use. guest-csi applies these rules on every call;
// the management cluster's admission policy and orphan cleanup apply the same ones.
package tenancy

import (
	"strings"

	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// SnapshotCountResource is the ResourceQuota resource that counts a namespace's VolumeSnapshots:
// the tenants controller's quota sets it (a ResourceQuota cannot sum the bytes of
// VolumeSnapshots, and each one is a full copy of its source on the source's host), and mgmt-csi
// counts a group snapshot's members against it before any is cut.
const SnapshotCountResource = "count/volumesnapshots.snapshot.storage.k8s.io"

const (
	// ClusterNameLabel and ClusterUIDLabel mark a management object (PVC, VolumeSnapshot)
	// created for a guest cluster: the name and UID of its Cluster API Cluster.
	ClusterNameLabel = "pvbridge.io/cluster"
	// ClusterUIDLabel is the UID of the Cluster (see ClusterNameLabel). The UID tells a cluster
	// from an earlier one of the same name.
	ClusterUIDLabel = "pvbridge.io/cluster-uid"

	// VolumeGroupLabel marks the management PVCs of a group snapshot while it is taken: the
	// VolumeGroupSnapshot guest-csi creates selects its members by this label and
	// ClusterUIDLabel. Its value is the name of that VolumeGroupSnapshot without the
	// "<cluster UID>-" prefix (the UID of the guest's VolumeGroupSnapshot); the label is the
	// only one a guest may add to, change on or remove from its claims, and guest-csi removes it
	// once the group snapshot is ready.
	VolumeGroupLabel = "pvbridge.io/volume-group"

	// CAPIClusterNameLabel is Cluster API's label on the objects of a cluster, its
	// VirtualMachines among them.
	CAPIClusterNameLabel = "cluster.x-k8s.io/cluster-name"

	// SharedWithAnnotation is set by a platform admin on a management PVC or VolumeSnapshot: a
	// comma-separated list of the names of the guest clusters of the namespace that may use it
	// without owning it: attach it (a static guest PV), restore or clone from it. A guest never
	// deletes, expands or changes a volume it does not own.
	SharedWithAnnotation = "pvbridge.io/shared-with"

	// GuestPVCAnnotation names the guest PVC (namespace/name) a management PVC was created for;
	// GuestPVAnnotation the guest PV; GuestLabelsAnnotation holds the guest PVC's labels (JSON).
	GuestPVCAnnotation = "pvbridge.io/guest-pvc"
	// GuestPVAnnotation is the guest PV's name (see GuestPVCAnnotation).
	GuestPVAnnotation = "pvbridge.io/guest-pv"
	// GuestLabelsAnnotation holds the guest PVC's labels (see GuestPVCAnnotation).
	GuestLabelsAnnotation = "pvbridge.io/guest-labels"
	// GuestSnapshotAnnotation names the guest VolumeSnapshot (namespace/name) a management
	// VolumeSnapshot was created for, or the guest VolumeGroupSnapshot of a management
	// VolumeGroupSnapshot.
	GuestSnapshotAnnotation = "pvbridge.io/guest-snapshot"
	// EnabledLabel opts a Cluster API Cluster in to the tenants controller (guest-csi-tenants):
	// pvbridge.io/enabled=true.
	EnabledLabel = "pvbridge.io/enabled"
	// StorageClassesAnnotation lists the management StorageClasses a guest cluster may name
	// (comma-separated), on its Cluster or else on its Namespace. Absent on both: none.
	StorageClassesAnnotation = "pvbridge.io/storage-classes"
	// AttributesClassesAnnotation lists the management VolumeAttributesClasses a guest cluster
	// may name in a claim's spec.volumeAttributesClassName (comma-separated), on its Cluster or
	// else on its Namespace. Absent on both: none.
	AttributesClassesAnnotation = "pvbridge.io/attributes-classes"
	// SnapshotClassesAnnotation lists the management VolumeSnapshotClasses a guest cluster may
	// name in a VolumeSnapshot's spec.volumeSnapshotClassName (comma-separated), on its Cluster
	// or else on its Namespace. Absent on both: none. A class decides what becomes of a copy
	// (deletionPolicy: an admin's Retain class keeps it after its VolumeSnapshot, outside the
	// namespace's snapshot quota), so the guest names one an admin allowed, never none.
	SnapshotClassesAnnotation = "pvbridge.io/snapshot-classes"
	// GroupSnapshotClassesAnnotation lists, as SnapshotClassesAnnotation does, the management
	// VolumeGroupSnapshotClasses a guest cluster may name in a VolumeGroupSnapshot's
	// spec.volumeGroupSnapshotClassName.
	GroupSnapshotClassesAnnotation = "pvbridge.io/group-snapshot-classes"
	// GuestInstallAnnotation "false" on a Cluster keeps the tenants controller from installing
	// the guest side into the guest cluster.
	GuestInstallAnnotation = "pvbridge.io/guest-install"
	// TenancyNamespaceLabel set to TenancyEnforced turns the tenancy admission policy on for a
	// namespace.
	TenancyNamespaceLabel = "pvbridge.io/tenancy"
	// TenancyEnforced is the value of TenancyNamespaceLabel that turns the policy on.
	TenancyEnforced = "enforced"
	// ParamsConfigMap is the ConfigMap of each tenant namespace that the tenants controller
	// writes and the admission policy reads (see docs/tenants.md).
	ParamsConfigMap = "pvbridge-tenancy"
	// GuestIdentityConfigMap is the ConfigMap of the guest cluster (namespace pvbridge-system)
	// that names its Cluster in the management cluster: keys GuestIdentityNameKey and
	// GuestIdentityUIDKey. The tenants controller installs it; guest-csi's controller reads it
	// through its environment (--cluster-name, --cluster-uid).
	GuestIdentityConfigMap = "pvbridge-cluster"
	// GuestIdentityNameKey is the Cluster's name in GuestIdentityConfigMap.
	GuestIdentityNameKey = "cluster-name"
	// GuestIdentityUIDKey is the Cluster's UID in GuestIdentityConfigMap.
	GuestIdentityUIDKey = "cluster-uid"
	// GuestCredentialsSecret is the Secret of the guest cluster (namespace pvbridge-system)
	// that holds guest-csi's management kubeconfig under the key "kubeconfig".
	GuestCredentialsSecret = "pvbridge-mgmt-credentials" //nolint:gosec // a Secret's name, not a credential

	// CSINameAnnotation records the CSI name (the guest's request) an object was created for.
	CSINameAnnotation = "pvbridge.io/csi-name"

	// MaxGuestLabelsLength bounds the value of GuestLabelsAnnotation and MaxAnnotationLength
	// that of every other annotation a guest writes, in characters: the admission policy
	// refuses longer values (every watcher of the namespace's claims would receive them).
	MaxGuestLabelsLength = 4096
	// MaxAnnotationLength bounds every other annotation a guest writes (see
	// MaxGuestLabelsLength).
	MaxAnnotationLength = 512
)

// Keys of the ParamsConfigMap, after a Cluster's name (<cluster><suffix>): the contract between
// the tenants controller, which writes them, and the admission policy and mgmt-csi, which read
// them (docs/tenants.md).
const (
	// ParamUID is the Cluster's UID; the names of the objects it creates start with it.
	ParamUID = ".uid"
	// ParamAccount is the UID of the ServiceAccount of the cluster's guest identity.
	ParamAccount = ".account"
	// ParamStorageClasses lists the StorageClasses it may name.
	ParamStorageClasses = ".storageClasses"
	// ParamAttributesClasses lists the VolumeAttributesClasses it may name.
	ParamAttributesClasses = ".attributesClasses"
	// ParamSnapshotClasses lists the VolumeSnapshotClasses it may name.
	ParamSnapshotClasses = ".snapshotClasses"
	// ParamGroupSnapshotClasses lists the VolumeGroupSnapshotClasses it may name.
	ParamGroupSnapshotClasses = ".groupSnapshotClasses"
	// ParamHosts lists the hosts of its VirtualMachines: its volumes go only there.
	ParamHosts = ".hosts"
	// ParamSharedClaims and ParamSharedSnapshots list what is shared with it.
	ParamSharedClaims = ".sharedClaims"
	// ParamSharedSnapshots: see ParamSharedClaims.
	ParamSharedSnapshots = ".sharedSnapshots"
	// ParamGroupSnapshots lists the member VolumeSnapshots of its group snapshots (GroupMember):
	// snapshot-controller makes them, unlabelled and named snapshot-<hash>, so only this list
	// tells the policy that a claim may be restored from them.
	ParamGroupSnapshots = ".groupSnapshots"
)

// HostsOfOwner finds, in a namespace's parameters, the cluster that owns the object of that
// name (its name starts with the cluster's UID) and returns the cluster and its hosts. ok is
// false for an object no cluster of the parameters owns.
func HostsOfOwner(params map[string]string, name string) (cluster string, hosts []string, ok bool) {
	for key, uid := range params {
		c, isUID := strings.CutSuffix(key, ParamUID)
		if !isUID || uid == "" || !strings.HasPrefix(name, uid+"-") {
			continue
		}
		for _, h := range strings.Split(params[c+ParamHosts], ",") {
			if h = strings.TrimSpace(h); h != "" {
				hosts = append(hosts, h)
			}
		}
		return c, hosts, true
	}
	return "", nil, false
}

// Cluster is a guest cluster: its Cluster API Cluster's name and UID, and the management
// namespace that holds its VirtualMachines and volumes.
type Cluster struct {
	Namespace, Name, UID string
}

// Labels are the labels of every management object created for the cluster.
func (c Cluster) Labels() map[string]string {
	return map[string]string{ClusterNameLabel: c.Name, ClusterUIDLabel: c.UID}
}

// Access is what a cluster may do with a management object.
type Access int

const (
	// Foreign objects belong to someone else: the cluster may not use them at all.
	Foreign Access = iota
	// Shared objects may be attached and read (restored, cloned, snapshotted) but are only
	// released, never deleted or changed.
	Shared
	// Owned objects were created for this cluster: it may delete and change them.
	Owned
)

func (a Access) String() string {
	switch a {
	case Owned:
		return "owned"
	case Shared:
		return "shared"
	}
	return "foreign"
}

// AccessOf tells what cluster c may do with obj: Owned when obj is in c's namespace and labelled
// with c's UID, Shared when it is in c's namespace and its SharedWithAnnotation names c, Foreign
// otherwise (another namespace, another cluster, or an earlier cluster of the same name).
func AccessOf(obj metav1.Object, c Cluster) Access {
	switch {
	case obj.GetNamespace() != c.Namespace:
		return Foreign
	case c.UID != "" && obj.GetLabels()[ClusterUIDLabel] == c.UID:
		return Owned
	case SharedWith(obj.GetAnnotations()[SharedWithAnnotation], c.Name):
		return Shared
	}
	return Foreign
}

// GroupOf returns the ownerReference of obj, a management VolumeSnapshot, to the
// VolumeGroupSnapshot it is a member of: snapshot-controller creates the members of a
// VolumeGroupSnapshot without labels, with that ownerReference. ok is false for a snapshot of no
// group.
func GroupOf(obj metav1.Object) (ref metav1.OwnerReference, ok bool) {
	for _, ref := range obj.GetOwnerReferences() {
		group, _, _ := strings.Cut(ref.APIVersion, "/")
		if group == groupSnapshotGroup && ref.Kind == "VolumeGroupSnapshot" {
			return ref, true
		}
	}
	return metav1.OwnerReference{}, false
}

// GroupMember reports whether member, a management VolumeSnapshot, is a member of group, a
// VolumeGroupSnapshot of cluster c: both are in c's namespace, member is owned by group (its
// ownerReference names group's UID: GroupOf), and group carries c's UID label. The label, not
// the group's name, tells whose the group is: the admission policy lets a guest create only
// VolumeGroupSnapshots labelled with its own UID, and a name says nothing where it is not
// enforced. A guest can set no ownerReference, and a VolumeGroupSnapshot of c selects only c's
// claims. A member is the cluster's to restore, never to delete: it goes with its group.
func GroupMember(member, group metav1.Object, c Cluster) bool {
	ref, ok := GroupOf(member)
	return ok && c.UID != "" && member.GetNamespace() == c.Namespace && group.GetNamespace() == c.Namespace &&
		ref.UID != "" && ref.UID == group.GetUID() && group.GetLabels()[ClusterUIDLabel] == c.UID
}

// groupSnapshotGroup is the API group of VolumeGroupSnapshots.
const groupSnapshotGroup = "groupsnapshot.storage.k8s.io"

// SharedWith reports whether a SharedWithAnnotation value names cluster.
func SharedWith(value, cluster string) bool {
	if cluster == "" {
		return false
	}
	for name := range strings.SplitSeq(value, ",") {
		if strings.TrimSpace(name) == cluster {
			return true
		}
	}
	return false
}

// GuestRules are what a guest cluster's guest-csi controller needs in its management
// namespace, and no more: the Role its identity is bound to. The tenants controller grants them
// without escalate or bind, so its RBAC markers (guest-csi/internal/tenants/credentials.go) must
// hold them, as those of CapacityRules; e2e/manifests TestTenantsRBAC proves it.
var GuestRules = []rbacv1.PolicyRule{
	{APIGroups: []string{""}, Resources: []string{"persistentvolumeclaims"}, Verbs: []string{"get", "list", "watch", "create", "patch", "delete"}},
	{APIGroups: []string{"snapshot.storage.k8s.io"}, Resources: []string{"volumesnapshots"}, Verbs: []string{"get", "list", "watch", "create", "delete"}},
	{APIGroups: []string{groupSnapshotGroup}, Resources: []string{"volumegroupsnapshots"}, Verbs: []string{"get", "list", "watch", "create", "delete"}},
	{APIGroups: []string{"vm.pvbridge.io"}, Resources: []string{"virtualmachines"}, Verbs: []string{"get", "list", "watch", "patch"}},
	{APIGroups: []string{""}, Resources: []string{"events"}, Verbs: []string{"list"}},
}

// CapacityRules let a guest's identity read the management cluster's PMEM capacity, in the
// namespace where mgmt-csi publishes it.
var CapacityRules = []rbacv1.PolicyRule{
	{APIGroups: []string{"storage.k8s.io"}, Resources: []string{"csistoragecapacities"}, Verbs: []string{"list"}},
}
