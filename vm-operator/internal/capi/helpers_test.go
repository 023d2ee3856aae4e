package capi

import (
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/utils/ptr"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"
	"sigs.k8s.io/controller-runtime/pkg/client"
	clientfake "sigs.k8s.io/controller-runtime/pkg/client/fake"

	infrav1 "pvbridge.io/pkg/apis/infrastructure/v1alpha1"
	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
	"pvbridge.io/pkg/tenancy"
)

const (
	ns          = "tenant-a"
	clusterName = "guest-1"
	machineName = "guest-1-md-0-abcde"
	secretName  = "guest-1-md-0-abcde-bootstrap"
)

func newScheme(t *testing.T) *runtime.Scheme {
	t.Helper()
	s := runtime.NewScheme()
	for _, add := range []func(*runtime.Scheme) error{clientgoscheme.AddToScheme, vmv1.AddToScheme, clusterv1.AddToScheme, infrav1.AddToScheme} {
		if err := add(s); err != nil {
			t.Fatal(err)
		}
	}
	return s
}

// fixtures is a provisioned Cluster over hosts host-a and host-b, its PVBridgeCluster, and a
// Machine with bootstrap data, placed on host-b, whose PVBridgeMachine carries the finalizer.
type fixtures struct {
	cluster *clusterv1.Cluster
	ic      *infrav1.PVBridgeCluster
	machine *clusterv1.Machine
	pm      *infrav1.PVBridgeMachine
}

func newFixtures() *fixtures {
	cluster := &clusterv1.Cluster{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: clusterName, UID: "cluster-uid", Labels: map[string]string{tenancy.EnabledLabel: "true"}},
		Spec: clusterv1.ClusterSpec{InfrastructureRef: clusterv1.ContractVersionedObjectReference{
			APIGroup: infrav1.GroupVersion.Group, Kind: "PVBridgeCluster", Name: clusterName,
		}},
		Status: clusterv1.ClusterStatus{
			Initialization: clusterv1.ClusterInitializationStatus{InfrastructureProvisioned: ptr.To(true)},
			FailureDomains: []clusterv1.FailureDomain{{Name: "host-a", ControlPlane: ptr.To(true)}, {Name: "host-b", ControlPlane: ptr.To(true)}},
		},
	}
	clusterOwner := metav1.OwnerReference{APIVersion: clusterv1.GroupVersion.String(), Kind: "Cluster", Name: clusterName, UID: cluster.UID}
	ic := &infrav1.PVBridgeCluster{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: clusterName, UID: "ic-uid", Generation: 1,
			Labels: map[string]string{clusterv1.ClusterNameLabel: clusterName}, OwnerReferences: []metav1.OwnerReference{clusterOwner}},
		Spec: infrav1.PVBridgeClusterSpec{ControlPlaneEndpoint: infrav1.APIEndpoint{Host: "10.0.0.10", Port: 6443}},
	}
	machine := &clusterv1.Machine{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: machineName, UID: "machine-uid",
			Labels: map[string]string{clusterv1.ClusterNameLabel: clusterName}},
		Spec: clusterv1.MachineSpec{
			ClusterName:   clusterName,
			Bootstrap:     clusterv1.Bootstrap{DataSecretName: ptr.To(secretName)},
			FailureDomain: "host-b",
			InfrastructureRef: clusterv1.ContractVersionedObjectReference{
				APIGroup: infrav1.GroupVersion.Group, Kind: "PVBridgeMachine", Name: machineName,
			},
		},
	}
	pm := &infrav1.PVBridgeMachine{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: machineName, UID: "pm-uid", Generation: 1,
			Labels:     map[string]string{clusterv1.ClusterNameLabel: clusterName},
			Finalizers: []string{infrav1.MachineFinalizer},
			OwnerReferences: []metav1.OwnerReference{{
				APIVersion: clusterv1.GroupVersion.String(), Kind: "Machine", Name: machineName, UID: machine.UID,
				Controller: ptr.To(true),
			}},
		},
		Spec: infrav1.PVBridgeMachineSpec{ClassName: "small", Image: "node-v1.37.2"},
	}
	return &fixtures{cluster: cluster, ic: ic, machine: machine, pm: pm}
}

func (f *fixtures) objects() []client.Object {
	return []client.Object{f.cluster, f.ic, f.machine, f.pm}
}

// vmOf is the VirtualMachine the provider makes of f.pm, with the given status.
func (f *fixtures) vmOf(status vmv1.VirtualMachineStatus) *vmv1.VirtualMachine {
	vm := newVirtualMachine(f.pm, clusterName, "host-b", secretName)
	vm.UID = "vm-uid"
	vm.Status = status
	return vm
}

func newClient(t *testing.T, objs ...client.Object) client.WithWatch {
	return clientfake.NewClientBuilder().WithScheme(newScheme(t)).WithObjects(objs...).
		WithStatusSubresource(&infrav1.PVBridgeCluster{}, &infrav1.PVBridgeMachine{}, &infrav1.PVBridgeMachineTemplate{}, &vmv1.VirtualMachine{}, &clusterv1.Cluster{}, &clusterv1.Machine{}).
		Build()
}

// host is a Ready Node, a management host when labelled.
func host(name string, labelled bool, mutate ...func(*corev1.Node)) *corev1.Node {
	n := &corev1.Node{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Status:     corev1.NodeStatus{Conditions: []corev1.NodeCondition{{Type: corev1.NodeReady, Status: corev1.ConditionTrue}}},
	}
	if labelled {
		n.Labels = map[string]string{vmv1.HostLabel: "true"}
	}
	for _, m := range mutate {
		m(n)
	}
	return n
}

// get reads obj again.
func get[T client.Object](t *testing.T, c client.Client, obj T) T {
	t.Helper()
	if err := c.Get(t.Context(), client.ObjectKeyFromObject(obj), obj); err != nil {
		t.Fatal(err)
	}
	return obj
}
