// Package capi is pvbridge's Cluster API infrastructure provider (contract v1beta2), run by
// vm-operator in the infrastructure-provider role. One reconciler per kind:
//
//   - ClusterReconciler (cluster.go): a PVBridgeCluster's failure domains (management hosts)
//     and its status.initialization.provisioned once the control plane endpoint is known; it
//     blocks clusterctl move, which would delete the guest's VMs;
//   - MachineReconciler (machine.go, machine_delete.go): a PVBridgeMachine's VirtualMachine of
//     the same name, created once the Cluster's infrastructure is provisioned and the Machine
//     has its bootstrap data, the providerID, addresses and provisioned flag once the VM runs
//     (a provisioned machine whose VM is deleted is reported, never given a new one); and its
//     deletion, which waits for the VM's volumes to detach before it powers the VM
//     off and deletes it;
//   - MachineTemplateReconciler (machinetemplate.go): a PVBridgeMachineTemplate's capacity
//     (its VirtualMachineClass's cpu and memory), for the autoscaler's scale from zero.
//
// The provider writes no VirtualMachine status and places no VM itself: vm-operator's
// controller places a VM on spec.host (the Machine's failure domain) or on the least loaded
// host, and the host agent runs it with its bootstrap data. The helpers here read the Cluster
// API objects (owner Machine and Cluster, pause) from sigs.k8s.io/cluster-api/api only.
package capi

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	infrav1 "pvbridge.io/pkg/apis/infrastructure/v1alpha1"
)

// fieldManager names the provider in managedFields and Events.
const fieldManager = "pvbridge-infrastructure-provider"

// DefaultVolumeDetachTimeout is how long a deleted PVBridgeMachine waits for its VirtualMachine's
// volumes to detach before it powers the VM off anyway: as long as the host agent's default
// unplug timeout, so a guest that never lets go delays its Machine's deletion by at most twice
// that (this wait, then the host agent's before it forces the VM off).
const DefaultVolumeDetachTimeout = 5 * time.Minute

// Options configure the provider's reconcilers.
type Options struct {
	// VolumeDetachTimeout bounds the wait of a deleted machine for its volumes to detach;
	// zero waits for ever.
	VolumeDetachTimeout time.Duration
	// WatchFilter restricts the provider to the objects labelled with it.
	WatchFilter WatchFilter
}

// WatchFilter is the value of the cluster.x-k8s.io/watch-filter label of the objects a provider
// instance reconciles (clusterctl's --watch-filter, for instances side by side); empty: every
// object. Each reconciler checks its own object, which every watch's event leads to.
type WatchFilter string

// Matches reports whether obj is this instance's to reconcile.
func (f WatchFilter) Matches(obj metav1.Object) bool {
	return f == "" || obj.GetLabels()[clusterv1.WatchLabel] == string(f)
}

// The Lease of the provider's leader election (vm-operator --leader-elect), in its namespace,
// and the core Events controller-runtime records on it.
// +kubebuilder:rbac:groups=coordination.k8s.io,resources=leases,verbs=get;create;update,namespace=pvbridge-capi-system
// +kubebuilder:rbac:groups="",resources=events,verbs=create;patch,namespace=pvbridge-capi-system

// SetupWithManager registers the provider's reconcilers with mgr.
func SetupWithManager(mgr ctrl.Manager, opts Options) error {
	clusters := &ClusterReconciler{Client: mgr.GetClient(), Filter: opts.WatchFilter}
	if err := clusters.SetupWithManager(mgr); err != nil {
		return fmt.Errorf("set up the PVBridgeCluster controller: %w", err)
	}
	machines := &MachineReconciler{
		Client:              mgr.GetClient(),
		APIReader:           mgr.GetAPIReader(),
		Recorder:            mgr.GetEventRecorder(fieldManager),
		VolumeDetachTimeout: opts.VolumeDetachTimeout,
		Filter:              opts.WatchFilter,
	}
	if err := machines.SetupWithManager(mgr); err != nil {
		return fmt.Errorf("set up the PVBridgeMachine controller: %w", err)
	}
	templates := &MachineTemplateReconciler{Client: mgr.GetClient(), Filter: opts.WatchFilter}
	if err := templates.SetupWithManager(mgr); err != nil {
		return fmt.Errorf("set up the PVBridgeMachineTemplate controller: %w", err)
	}
	return nil
}

// ownerOfKind returns the name of obj's owner of the given Cluster API kind, or "" if it has none.
func ownerOfKind(obj metav1.Object, kind string) string {
	for _, ref := range obj.GetOwnerReferences() {
		gv, err := schema.ParseGroupVersion(ref.APIVersion)
		if err == nil && gv.Group == clusterv1.GroupVersion.Group && ref.Kind == kind {
			return ref.Name
		}
	}
	return ""
}

// getOwned reads obj (a Machine or Cluster) named name in namespace; a missing object is (false, nil).
func getOwned(ctx context.Context, c client.Client, namespace, name string, obj client.Object) (bool, error) {
	if name == "" {
		return false, nil
	}
	if err := c.Get(ctx, types.NamespacedName{Namespace: namespace, Name: name}, obj); err != nil {
		if apierrors.IsNotFound(err) {
			return false, nil
		}
		return false, fmt.Errorf("get %T %s/%s: %w", obj, namespace, name, err)
	}
	return true, nil
}

// isPaused reports whether reconciling obj of cluster is paused: the Cluster's spec.paused or the
// cluster.x-k8s.io/paused annotation on obj (the contract's rule).
func isPaused(cluster *clusterv1.Cluster, obj metav1.Object) bool {
	if cluster != nil && cluster.Spec.Paused != nil && *cluster.Spec.Paused {
		return true
	}
	_, ok := obj.GetAnnotations()[clusterv1.PausedAnnotation]
	return ok
}

// setCondition sets a condition of an object of the given generation.
func setCondition(conds *[]metav1.Condition, generation int64, typ string, status metav1.ConditionStatus, reason, message string) {
	meta.SetStatusCondition(conds, metav1.Condition{
		Type: typ, Status: status, Reason: reason, Message: message, ObservedGeneration: generation,
	})
}

// pausedCondition sets the Paused condition.
func pausedCondition(conds *[]metav1.Condition, generation int64, paused bool) {
	if paused {
		setCondition(conds, generation, infrav1.PausedCondition, metav1.ConditionTrue, infrav1.PausedReason,
			"reconciliation is paused (Cluster spec.paused or the cluster.x-k8s.io/paused annotation)")
		return
	}
	setCondition(conds, generation, infrav1.PausedCondition, metav1.ConditionFalse, infrav1.NotPausedReason, "")
}

// patchObject writes what changed in obj since base: metadata and spec by a merge patch, then
// the status (a subresource) the same way, each only if it changed. A merge patch replaces a
// list whole, so one that changes the finalizers carries base's resourceVersion (a conflict if
// another wrote the object since, retried by the next reconcile): it would drop a finalizer
// another controller added meanwhile. Otherwise it carries none: the provider is the only writer
// of these fields but for Cluster API's labels and owner references, which it never changes. An
// object gone meanwhile is no error.
func patchObject(ctx context.Context, c client.Client, base, obj client.Object) error {
	data, err := client.MergeFrom(base).Data(obj)
	if err != nil {
		return err
	}
	var changed map[string]any
	if err := json.Unmarshal(data, &changed); err != nil {
		return err
	}
	_, statusChanged := changed["status"]
	delete(changed, "status")
	if len(changed) > 0 {
		// The main resource ignores status; a copy keeps obj's status for the second patch.
		patch := client.MergeFrom(base)
		if !slices.Equal(base.GetFinalizers(), obj.GetFinalizers()) {
			patch = client.MergeFromWithOptions(base, client.MergeFromWithOptimisticLock{})
		}
		if err := c.Patch(ctx, obj.DeepCopyObject().(client.Object), patch, client.FieldOwner(fieldManager)); err != nil {
			return client.IgnoreNotFound(fmt.Errorf("patch %s: %w", client.ObjectKeyFromObject(obj), err))
		}
	}
	if statusChanged {
		if err := c.Status().Patch(ctx, obj, client.MergeFrom(base), client.FieldOwner(fieldManager)); err != nil {
			return client.IgnoreNotFound(fmt.Errorf("patch status of %s: %w", client.ObjectKeyFromObject(obj), err))
		}
	}
	return nil
}
