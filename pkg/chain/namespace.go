package chain

import (
	"context"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"pvbridge.io/pkg/tenancy"
)

// guestIdentityNamespace is where the tenants controller installs the guest side.
const guestIdentityNamespace = "pvbridge-system"

// clusterListKind lists Cluster API's Clusters by their metadata (no Cluster API types needed).
var clusterListKind = schema.GroupVersionKind{Group: "cluster.x-k8s.io", Version: "v1beta2", Kind: "ClusterList"}

// FindMgmtNamespace finds the guest cluster's namespace in the management cluster from what the
// guest already knows: its Cluster's UID (ConfigMap pvbridge-system/pvbridge-cluster, which the
// tenants controller installs), looked up among the management cluster's Cluster API Clusters.
// It returns the namespace and how it was found, for the operator to read.
func FindMgmtNamespace(ctx context.Context, guest, mgmt client.Reader) (namespace, how string, err error) {
	cm := &corev1.ConfigMap{}
	key := client.ObjectKey{Namespace: guestIdentityNamespace, Name: tenancy.GuestIdentityConfigMap}
	if err := guest.Get(ctx, key, cm); err != nil {
		if apierrors.IsNotFound(err) {
			return "", "", fmt.Errorf("the guest cluster has no ConfigMap %s with its identity (is guest-csi installed?); give --mgmt-namespace", key)
		}
		return "", "", fmt.Errorf("read the guest's identity, ConfigMap %s: %w", key, err)
	}
	uid, name := cm.Data[tenancy.GuestIdentityUIDKey], cm.Data[tenancy.GuestIdentityNameKey]
	if uid == "" {
		return "", "", fmt.Errorf("ConfigMap %s has no %s; give --mgmt-namespace", key, tenancy.GuestIdentityUIDKey)
	}
	clusters := &metav1.PartialObjectMetadataList{}
	clusters.SetGroupVersionKind(clusterListKind)
	if err := mgmt.List(ctx, clusters); err != nil {
		return "", "", fmt.Errorf("list the management cluster's Clusters to find cluster %s (uid %s): %w; give --mgmt-namespace", name, uid, err)
	}
	for _, c := range clusters.Items {
		if string(c.UID) == uid {
			return c.Namespace, fmt.Sprintf("Cluster %s/%s, whose UID %s the guest's ConfigMap %s names", c.Namespace, c.Name, uid, key), nil
		}
	}
	return "", "", fmt.Errorf("no Cluster of the management cluster has UID %s (cluster %s, from the guest's ConfigMap %s): was it deleted?", uid, name, key)
}
