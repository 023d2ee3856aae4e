package hostagent

import (
	"testing"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/yaml"

	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
)

func TestBootstrapDataIsHandedToTheVMItStarts(t *testing.T) {
	secret := &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Namespace: "tenant", Name: "vm-1-bootstrap"},
		Data:       map[string][]byte{"value": []byte("#cloud-config\nruncmd: [kubeadm join]\n"), "format": []byte("cloud-config")},
	}
	tests := []struct {
		name string
		// secret is in the API server when set.
		secret *corev1.Secret
		// running: the VM runs already.
		running       bool
		wantBootstrap bool
		wantOn        bool
		wantReason    string
	}{{
		name:   "a VM started with bootstrap data gets the secret's value and its meta-data",
		secret: secret, wantBootstrap: true, wantOn: true, wantReason: vmv1.PoweredOnReason,
	}, {
		name:    "a running VM is not given its data again (and the secret is not read)",
		running: true, wantOn: true, wantReason: vmv1.PoweredOnReason,
	}, {
		name:       "a missing secret keeps the VM off and says why",
		wantReason: vmv1.BootstrapDataUnavailableReason,
	}, {
		name:       "a secret without a value keeps the VM off",
		secret:     &corev1.Secret{ObjectMeta: secret.ObjectMeta, Data: map[string][]byte{"format": []byte("cloud-config")}},
		wantReason: vmv1.BootstrapDataUnavailableReason,
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			vm := virtualMachine(nil, nil)
			vm.Spec.Bootstrap = &vmv1.VirtualMachineBootstrap{DataSecretName: secret.Name}
			c := newClient(g, vm, true)
			if tt.secret != nil {
				g.Expect(c.Create(t.Context(), tt.secret.DeepCopy())).To(Succeed())
			}
			h := newFakeHypervisor()
			h.on[vm.Name] = tt.running
			r := &Reconciler{Client: c, Node: "host-a", Hypervisor: h, CSI: &fakeCSI{}, StateDir: t.TempDir()}

			_, err := r.Reconcile(t.Context(), ctrl.Request{NamespacedName: client.ObjectKeyFromObject(vm)})

			g.Expect(err != nil).To(Equal(tt.wantReason == vmv1.BootstrapDataUnavailableReason))
			g.Expect(h.on[vm.Name]).To(Equal(tt.wantOn))
			got := &vmv1.VirtualMachine{}
			g.Expect(c.Get(t.Context(), client.ObjectKeyFromObject(vm), got)).To(Succeed())
			ready := meta.FindStatusCondition(got.Status.Conditions, vmv1.ReadyCondition)
			g.Expect(ready).NotTo(BeNil())
			g.Expect(ready.Reason).To(Equal(tt.wantReason))
			if !tt.wantBootstrap {
				g.Expect(h.bootstraps).NotTo(HaveKey(vm.Name))
				return
			}
			b := h.bootstraps[vm.Name]
			g.Expect(b).NotTo(BeNil())
			g.Expect(b.UserData).To(Equal(secret.Data["value"]))
			var md map[string]string
			g.Expect(yaml.Unmarshal(b.MetaData, &md)).To(Succeed())
			g.Expect(md).To(Equal(map[string]string{
				"instance-id": "uid-1", "local-hostname": "vm-1", "namespace": "tenant", "provider-id": "pvbridge://tenant/vm-1",
			}))
		})
	}
}
