package chain

import (
	"testing"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"
)

// TestFindMgmtNamespace: the guest's Cluster UID, from its identity ConfigMap, names the
// management Cluster and so its namespace; anything missing is an error that says what to give.
func TestFindMgmtNamespace(t *testing.T) {
	identity := func(uid string) client.Object {
		return &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: "pvbridge-system", Name: "pvbridge-cluster"},
			Data: map[string]string{"cluster-name": "alpha", "cluster-uid": uid}}
	}
	cluster := func(ns, name, uid string) client.Object {
		c := &metav1.PartialObjectMetadata{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, UID: types.UID(uid)}}
		c.SetGroupVersionKind(schema.GroupVersionKind{Group: "cluster.x-k8s.io", Version: "v1beta2", Kind: "Cluster"})
		return c
	}
	clusters := []client.Object{cluster("tenant-a", "alpha", "uid-alpha"), cluster("tenant-b", "alpha", "uid-other-alpha")}
	for _, tc := range []struct {
		name    string
		guest   []client.Object
		want    string
		wantErr string
	}{
		{name: "found by UID, not by name", guest: []client.Object{identity("uid-alpha")}, want: "tenant-a"},
		{name: "no identity in the guest", wantErr: "give --mgmt-namespace"},
		{name: "an identity without a UID", guest: []client.Object{identity("")}, wantErr: "has no cluster-uid"},
		{name: "a Cluster that is gone", guest: []client.Object{identity("uid-gone")}, wantErr: "no Cluster of the management cluster has UID uid-gone"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			scheme := runtime.NewScheme()
			g.Expect(clientgoscheme.AddToScheme(scheme)).To(Succeed())
			guest := fake.NewClientBuilder().WithScheme(scheme).WithObjects(tc.guest...).Build()
			mgmt := fake.NewClientBuilder().WithScheme(scheme).WithObjects(clusters...).Build()
			ns, how, err := FindMgmtNamespace(t.Context(), guest, mgmt)
			if tc.wantErr != "" {
				g.Expect(err).To(MatchError(ContainSubstring(tc.wantErr)))
				return
			}
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(ns).To(Equal(tc.want))
			g.Expect(how).To(ContainSubstring("Cluster tenant-a/alpha"))
		})
	}
}
