// Package hostloss tells the controllers that wait on a host's agents when that host is lost
// for good (vmv1.HostLost, or its Node gone), so that they stop waiting for agents that will
// never act: the attachment controller releases a deleted VirtualMachine's volumes, the
// infrastructure provider deletes a machine's VirtualMachine without waiting for them, and
// mgmt-csi's node agent takes over a replicated volume that a lost host served.
package hostloss

import (
	"context"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/event"
	"sigs.k8s.io/controller-runtime/pkg/predicate"

	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
)

// Lost tells whether host is lost: its Node tainted out of service (vmv1.HostLost), or gone. A
// miss of cached is confirmed with live, so that a cache not yet synced loses no host.
func Lost(ctx context.Context, cached, live client.Reader, host string) (bool, error) {
	st, err := StateOf(ctx, cached, live, host)
	return st == LostState, err
}

// State is how a host stands for what is placed on it.
type State string

const (
	// Available is a host that may take new VMs and replicas, as far as its loss and drain go.
	Available State = ""
	// Drained is a host whose Node carries vmv1.DrainTaint: it takes nothing new and gives up its replicas.
	Drained State = "drained (tainted " + vmv1.DrainTaint + ")"
	// LostState is a host lost (vmv1.HostLost), or whose Node is gone: its agents never act again.
	LostState State = "lost (tainted " + corev1.TaintNodeOutOfService + ", or its Node gone)"
)

// StateOf tells how host stands, from its Node, read as Lost reads it.
func StateOf(ctx context.Context, cached, live client.Reader, host string) (State, error) {
	node := &corev1.Node{}
	err := cached.Get(ctx, client.ObjectKey{Name: host}, node)
	if apierrors.IsNotFound(err) {
		err = live.Get(ctx, client.ObjectKey{Name: host}, node)
	}
	switch {
	case apierrors.IsNotFound(err):
		return LostState, nil
	case err != nil:
		return Available, fmt.Errorf("get Node %s: %w", host, err)
	case vmv1.HostLost(node):
		return LostState, nil
	case vmv1.HostDraining(node):
		return Drained, nil
	}
	return Available, nil
}

// VMsOn lists the VirtualMachines that run on host (their status.host), for the watches that map
// a lost host to what waits on it; nil, logged, when the list fails.
func VMsOn(ctx context.Context, c client.Reader, host string) []*vmv1.VirtualMachine {
	vms := &vmv1.VirtualMachineList{}
	if err := c.List(ctx, vms); err != nil {
		ctrl.LoggerFrom(ctx).Error(err, "List VirtualMachines")
		return nil
	}
	var on []*vmv1.VirtualMachine
	for i := range vms.Items {
		if vms.Items[i].Status.Host == host {
			on = append(on, &vms.Items[i])
		}
	}
	return on
}

// Changed lets through the Node events that can make a host lost (its deletion, the
// out-of-service taint's coming), not the routine updates of every Node.
func Changed() predicate.Predicate {
	return nodeUpdates(func(oldNode, newNode *corev1.Node) bool { return !vmv1.HostLost(oldNode) && vmv1.HostLost(newNode) })
}

// StateChanged lets through the Node events that change a host's State: its drain's start and
// end, its loss (a deletion included).
func StateChanged() predicate.Predicate {
	return nodeUpdates(func(oldNode, newNode *corev1.Node) bool {
		return vmv1.HostLost(oldNode) != vmv1.HostLost(newNode) || vmv1.HostDraining(oldNode) != vmv1.HostDraining(newNode)
	})
}

// nodeUpdates lets through the deletions of Nodes and their updates for which changed holds.
func nodeUpdates(changed func(oldNode, newNode *corev1.Node) bool) predicate.Predicate {
	return predicate.Funcs{
		CreateFunc: func(event.CreateEvent) bool { return false },
		UpdateFunc: func(e event.UpdateEvent) bool {
			oldNode, ok1 := e.ObjectOld.(*corev1.Node)
			newNode, ok2 := e.ObjectNew.(*corev1.Node)
			return ok1 && ok2 && changed(oldNode, newNode)
		},
		GenericFunc: func(event.GenericEvent) bool { return false },
	}
}
