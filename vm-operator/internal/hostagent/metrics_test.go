package hostagent

import (
	"strings"
	"testing"

	. "github.com/onsi/gomega"
	"github.com/prometheus/client_golang/prometheus/testutil"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
)

// TestVolumesCollectorCountsAttachedVolumesPerNamespace: the attached volumes of this host's
// VMs, per namespace; a volume still attaching and another host's VM do not count.
func TestVolumesCollectorCountsAttachedVolumesPerNamespace(t *testing.T) {
	g := NewWithT(t)
	attached := func(names ...string) []vmv1.VirtualMachineVolumeStatus {
		var s []vmv1.VirtualMachineVolumeStatus
		for _, n := range names {
			s = append(s, vmv1.VirtualMachineVolumeStatus{Name: n, Attached: true})
		}
		return s
	}
	vm := virtualMachine(nil, append(attached("a", "b"), vmv1.VirtualMachineVolumeStatus{Name: "c"}))
	c := newClient(g, vm, false)
	for _, other := range []*vmv1.VirtualMachine{
		{ObjectMeta: metav1.ObjectMeta{Namespace: "tenant", Name: "vm-2"}, Status: vmv1.VirtualMachineStatus{Host: "host-a", Volumes: attached("d")}},
		{ObjectMeta: metav1.ObjectMeta{Namespace: "tenant-b", Name: "vm-3"}, Status: vmv1.VirtualMachineStatus{Host: "host-a", Volumes: attached("e")}},
		{ObjectMeta: metav1.ObjectMeta{Namespace: "tenant-b", Name: "vm-4"}, Status: vmv1.VirtualMachineStatus{Host: "host-b", Volumes: attached("f", "g")}},
	} {
		g.Expect(c.Create(t.Context(), other)).To(Succeed())
		g.Expect(c.Status().Update(t.Context(), other)).To(Succeed())
	}

	g.Expect(testutil.CollectAndCompare(&volumesCollector{reader: c, node: "host-a"}, strings.NewReader(`
# HELP pvbridge_vm_volumes Volumes attached to the VirtualMachines of the host, per namespace (a tenant's guest clusters).
# TYPE pvbridge_vm_volumes gauge
pvbridge_vm_volumes{namespace="tenant",node="host-a"} 3
pvbridge_vm_volumes{namespace="tenant-b",node="host-a"} 1
`))).To(Succeed())
}
