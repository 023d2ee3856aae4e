package agent

import (
	"context"
	"fmt"
	"sync"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/klog/v2"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"pvbridge.io/mgmt-csi/internal/pmem"
	pmemv1 "pvbridge.io/pkg/apis/pmem/v1alpha1"
)

// NodeReporter publishes the node's PMEM capacity in its PmemNode: at start, after allocation
// changes, and every Interval (capacity can also change outside the agent, e.g. a region added
// to LVM). csi-provisioner turns it into CSIStorageCapacity through GetCapacity. Refreshes
// asked for while one is being written are coalesced into one, so a burst of a hundred creates
// costs a few status writes, not a hundred.
type NodeReporter struct {
	Client   client.Client
	Backend  pmem.Backend
	Node     string
	Interval time.Duration
	// WaitForSync blocks until the API cache is ready (the manager starts runnables before).
	WaitForSync func(context.Context) bool
	// ReplicaAddress is the address of the node's replica server; empty when it has none.
	ReplicaAddress string

	once    sync.Once
	trigger chan struct{}
}

func (r *NodeReporter) triggers() chan struct{} {
	r.once.Do(func() { r.trigger = make(chan struct{}, 1) })
	return r.trigger
}

// Start refreshes the PmemNode until ctx ends; it is a controller-runtime Runnable.
func (r *NodeReporter) Start(ctx context.Context) error {
	if !r.WaitForSync(ctx) {
		return nil // ctx ended
	}
	t := time.NewTicker(r.Interval)
	defer t.Stop()
	for {
		// One writer: a slow write never overwrites a newer one.
		if err := r.refresh(ctx); err != nil {
			klog.FromContext(ctx).Error(err, "Cannot publish PMEM capacity", "node", r.Node)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		case <-r.triggers():
		}
	}
}

// Refresh asks for the capacity to be published soon; it does not wait.
func (r *NodeReporter) Refresh(context.Context) {
	select {
	case r.triggers() <- struct{}{}:
	default: // a refresh is pending already
	}
}

func (r *NodeReporter) refresh(ctx context.Context) error {
	node := &pmemv1.PmemNode{}
	err := r.Client.Get(ctx, client.ObjectKey{Name: r.Node}, node)
	if apierrors.IsNotFound(err) {
		node = &pmemv1.PmemNode{ObjectMeta: metav1.ObjectMeta{Name: r.Node}}
		if err = r.Client.Create(ctx, node); apierrors.IsAlreadyExists(err) {
			err = r.Client.Get(ctx, client.ObjectKey{Name: r.Node}, node)
		}
	}
	if err != nil {
		return fmt.Errorf("get PmemNode %s: %w", r.Node, err)
	}

	patch := client.MergeFrom(node.DeepCopy())
	node.Status.Mode = r.Backend.Mode()
	node.Status.ReplicaAddress = r.ReplicaAddress
	ready := metav1.Condition{Type: pmemv1.ReadyCondition, Status: metav1.ConditionTrue, Reason: pmemv1.BackendReadyReason}
	if c, err := r.Backend.Capacity(ctx); err != nil {
		ready.Status, ready.Reason, ready.Message = metav1.ConditionFalse, pmemv1.BackendUnavailableReason, err.Error()
	} else {
		q := func(v int64) *resource.Quantity { return resource.NewQuantity(v, resource.BinarySI) }
		node.Status.Total, node.Status.Free = q(c.Total), q(c.Free)
		node.Status.LargestAllocatable, node.Status.Alignment = q(c.LargestAllocatable), q(c.Alignment)
		pmemTotalBytes.WithLabelValues(r.Node).Set(float64(c.Total))
		pmemFreeBytes.WithLabelValues(r.Node).Set(float64(c.Free))
	}
	meta.SetStatusCondition(&node.Status.Conditions, ready)
	if err := r.Client.Status().Patch(ctx, node, patch); err != nil {
		return fmt.Errorf("update status of PmemNode %s: %w", r.Node, err)
	}
	return nil
}
