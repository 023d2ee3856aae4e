package driver

import (
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	. "github.com/onsi/gomega"
	"google.golang.org/grpc/codes"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"

	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
	"pvbridge.io/pkg/tenancy"
)

func TestControllerGetVolumeHealth(t *testing.T) {
	scheme, err := newScheme()
	if err != nil {
		t.Fatal(err)
	}
	const ns, id = "tenant", "uid-1-pv-1"
	cluster := tenancy.Cluster{Name: "alpha", UID: "uid-1"}
	claim := func(phase corev1.PersistentVolumeClaimPhase, labels map[string]string) *corev1.PersistentVolumeClaim {
		return &corev1.PersistentVolumeClaim{
			ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: id, Labels: labels},
			Spec:       corev1.PersistentVolumeClaimSpec{VolumeName: "pvc-9"},
			Status:     corev1.PersistentVolumeClaimStatus{Phase: phase},
		}
	}
	owned := map[string]string{tenancy.ClusterUIDLabel: cluster.UID}
	vm := func(name string, entries ...vmv1.VirtualMachineVolumeStatus) *vmv1.VirtualMachine {
		return &vmv1.VirtualMachine{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}, Status: vmv1.VirtualMachineStatus{Volumes: entries}}
	}
	entry := func(reason, message string) *csi.VolumeHealth_VolumeHealthEntry {
		return &csi.VolumeHealth_VolumeHealthEntry{Status: csi.VolumeHealthErrorType_INACCESSIBLE, Reason: reason, Message: message}
	}
	tests := []struct {
		name     string
		id       string
		objects  []client.Object
		want     []*csi.VolumeHealth_VolumeHealthEntry
		wantCode codes.Code
		wantMsg  string
	}{
		{
			name: "a bound volume attached without error is healthy", id: id,
			objects: []client.Object{claim(corev1.ClaimBound, owned), vm("vm-1", vmv1.VirtualMachineVolumeStatus{Name: id, Attached: true, DiskSerial: "pvb1"})},
		},
		{
			name: "a management PVC that lost its volume is inaccessible", id: id,
			objects: []client.Object{claim(corev1.ClaimLost, owned)},
			want:    []*csi.VolumeHealth_VolumeHealthEntry{entry(ReasonManagementVolumeLost, "management PVC tenant/uid-1-pv-1 lost its volume pvc-9")},
		},
		{
			name: "the VMs' errors with the volume, in one entry", id: id,
			objects: []client.Object{
				claim(corev1.ClaimBound, owned),
				vm("vm-2", vmv1.VirtualMachineVolumeStatus{Name: id, Attached: true, DiskSerial: "pvb1", Error: "waiting for the guest to release disk pvb1"}),
				vm("vm-1", vmv1.VirtualMachineVolumeStatus{Name: id, Error: "hot-plug: no free hot-plug slot"}),
				vm("vm-3", vmv1.VirtualMachineVolumeStatus{Name: "other", Error: "PVC missing"}),
			},
			want: []*csi.VolumeHealth_VolumeHealthEntry{entry(ReasonAttachFailed,
				"management PVC tenant/uid-1-pv-1: VirtualMachine vm-1: hot-plug: no free hot-plug slot; VirtualMachine vm-2: waiting for the guest to release disk pvb1")},
		},
		{
			name: "a volume shared with the cluster is reported too", id: id,
			objects: []client.Object{func() *corev1.PersistentVolumeClaim {
				c := claim(corev1.ClaimLost, nil)
				c.Annotations = map[string]string{tenancy.SharedWithAnnotation: cluster.Name}
				return c
			}()},
			want: []*csi.VolumeHealth_VolumeHealthEntry{entry(ReasonManagementVolumeLost, "management PVC tenant/uid-1-pv-1 lost its volume pvc-9")},
		},
		{name: "a volume whose management PVC is gone is NotFound", id: id, wantCode: codes.NotFound, wantMsg: "does not exist"},
		{
			name: "another cluster's volume is refused", id: id, objects: []client.Object{claim(corev1.ClaimBound, nil)},
			wantCode: codes.FailedPrecondition, wantMsg: "not shared with it",
		},
		{name: "no volume ID", wantCode: codes.InvalidArgument, wantMsg: "volume_id"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			c := fake.NewClientBuilder().WithScheme(scheme).WithObjects(tt.objects...).WithStatusSubresource(&vmv1.VirtualMachine{}).Build()
			s := newControllerServer(controllerConfig{cluster: cluster}, splitClient{Client: c, live: c}, nil, nil)
			resp, err := s.ControllerGetVolumeHealth(t.Context(), &csi.ControllerGetVolumeHealthRequest{VolumeId: tt.id})
			expectCode(g, err, tt.wantCode, tt.wantMsg)
			if tt.wantCode != codes.OK {
				return
			}
			g.Expect(resp.GetVolumeHealth().GetVolumeId()).To(Equal(tt.id))
			g.Expect(resp.GetVolumeHealth().GetHealthStatuses()).To(HaveLen(len(tt.want)))
			for i, want := range tt.want {
				got := resp.GetVolumeHealth().GetHealthStatuses()[i]
				g.Expect(got.GetStatus()).To(Equal(want.GetStatus()))
				g.Expect(got.GetReason()).To(Equal(want.GetReason()))
				g.Expect(got.GetMessage()).To(Equal(want.GetMessage()))
			}
		})
	}
}
