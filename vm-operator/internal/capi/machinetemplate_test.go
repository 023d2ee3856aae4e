package capi

import (
	"testing"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	infrav1 "pvbridge.io/pkg/apis/infrastructure/v1alpha1"
	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
)

func TestMachineTemplateCapacity(t *testing.T) {
	small := &vmv1.VirtualMachineClass{
		ObjectMeta: metav1.ObjectMeta{Name: "small"},
		Spec:       vmv1.VirtualMachineClassSpec{CPUs: 2, Memory: resource.MustParse("2Gi")},
	}
	for _, tt := range []struct {
		name      string
		className string
		resources *infrav1.MachineResources
		want      corev1.ResourceList
	}{{
		name: "the class's cpu and memory", className: "small",
		want: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("2"), corev1.ResourceMemory: resource.MustParse("2Gi")},
	}, {
		name: "the machine's resources where it sets them", className: "small",
		resources: &infrav1.MachineResources{Memory: ptr.To(resource.MustParse("1Gi"))},
		want:      corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("2"), corev1.ResourceMemory: resource.MustParse("1Gi")},
	}, {
		name: "none while the class does not exist", className: "large",
	}, {
		name: "none without a class",
	}} {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			mt := &infrav1.PVBridgeMachineTemplate{
				ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "md-0"},
				Spec: infrav1.PVBridgeMachineTemplateSpec{Template: infrav1.PVBridgeMachineTemplateResource{
					Spec: infrav1.PVBridgeMachineSpec{ClassName: tt.className, Resources: tt.resources},
				}},
			}
			c := newClient(t, mt, small)
			r := &MachineTemplateReconciler{Client: c}

			_, err := r.Reconcile(t.Context(), ctrl.Request{NamespacedName: client.ObjectKeyFromObject(mt)})

			g.Expect(err).NotTo(HaveOccurred())
			got := get(t, c, &infrav1.PVBridgeMachineTemplate{ObjectMeta: mt.ObjectMeta}).Status.Capacity
			g.Expect(got).To(HaveLen(len(tt.want)))
			for name, q := range tt.want {
				g.Expect(got).To(HaveKey(name))
				have := got[name]
				g.Expect(have.Cmp(q)).To(BeZero(), "%s: %s, want %s", name, have.String(), q.String())
			}
			if tt.className != "" {
				g.Expect(r.templatesOfClass(t.Context(), &vmv1.VirtualMachineClass{ObjectMeta: metav1.ObjectMeta{Name: tt.className}})).
					To(ConsistOf(ctrl.Request{NamespacedName: client.ObjectKeyFromObject(mt)}))
			}
		})
	}
}
