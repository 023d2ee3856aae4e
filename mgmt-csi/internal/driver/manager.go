package driver

import (
	"context"
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/config"
	"sigs.k8s.io/controller-runtime/pkg/metrics"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	"pvbridge.io/mgmt-csi/internal/agent"
	"pvbridge.io/mgmt-csi/internal/pmem"
	"pvbridge.io/mgmt-csi/internal/replicated"
	pmemv1 "pvbridge.io/pkg/apis/pmem/v1alpha1"
	"pvbridge.io/pkg/await"
)

// capacityInterval is how often a node agent republishes its capacity without a change of its
// own: enough for space taken outside the agent to show up within a minute.
const capacityInterval = 30 * time.Second

func newScheme() (*runtime.Scheme, error) {
	s := runtime.NewScheme()
	if err := clientgoscheme.AddToScheme(s); err != nil {
		return nil, err
	}
	if err := pmemv1.AddToScheme(s); err != nil {
		return nil, err
	}
	return s, nil
}

// newManager returns the controller-runtime manager that holds the driver's API cache. A node
// agent caches only its own node's objects: field selectors on spec.node and the PmemNode name.
// A controller that stops gives its Lease up, for another to take over at once.
func newManager(cfg *rest.Config, o Options) (ctrl.Manager, error) {
	scheme, err := newScheme()
	if err != nil {
		return nil, err
	}
	opts := ctrl.Options{
		Scheme: scheme,
		// A driver may run more than once in a process (the tests restart it); controller
		// names then repeat.
		Controller:             config.Controller{SkipNameValidation: ptr.To(true)},
		Metrics:                metricsserver.Options{BindAddress: o.MetricsAddress},
		HealthProbeBindAddress: "0",
		// Nothing here reads managedFields: the cache does not keep them.
		Cache:                         cache.Options{DefaultTransform: cache.TransformStripManagedFields()},
		LeaderElection:                o.LeaderElection,
		LeaderElectionID:              leaseName,
		LeaderElectionNamespace:       o.LeaderElectionNamespace,
		LeaderElectionReleaseOnCancel: true,
	}
	if o.Mode == ModeController {
		// The replicated-volume reconciler watches the hosts' drains and losses, in their
		// taints: the cache keeps no more of a Node.
		opts.Cache.ByObject = map[client.Object]cache.ByObject{&corev1.Node{}: {Transform: nodeTaints}}
	}
	if o.Mode == ModeNode {
		own := fields.OneTermEqualSelector("spec.node", o.NodeID)
		opts.Cache.ByObject = map[client.Object]cache.ByObject{
			&pmemv1.PmemVolume{}:   {Field: own},
			&pmemv1.PmemSnapshot{}: {Field: own},
			&pmemv1.PmemReplica{}:  {Field: own},
			&pmemv1.PmemNode{}:     {Field: fields.OneTermEqualSelector("metadata.name", o.NodeID)},
		}
	}
	return ctrl.NewManager(cfg, opts)
}

// nodeTaints is a cache transform that keeps of a Node its name, version and taints.
func nodeTaints(o any) (any, error) {
	n, ok := o.(*corev1.Node)
	if !ok {
		return o, nil
	}
	return &corev1.Node{
		TypeMeta: n.TypeMeta,
		ObjectMeta: metav1.ObjectMeta{
			Name: n.Name, UID: n.UID, ResourceVersion: n.ResourceVersion, DeletionTimestamp: n.DeletionTimestamp,
		},
		Spec: corev1.NodeSpec{Taints: n.Spec.Taints},
	}, nil
}

// setupController registers the waits of the controller service on the manager's informers,
// and the reconciler of replicated volumes' Degraded condition and faulted replicas.
func setupController(ctx context.Context, mgr ctrl.Manager) (*controllerServer, error) {
	hub := await.NewHub()
	for kind, obj := range map[string]client.Object{
		kindVolume:   &pmemv1.PmemVolume{},
		kindSnapshot: &pmemv1.PmemSnapshot{},
		kindReplica:  &pmemv1.PmemReplica{},
	} {
		inf, err := mgr.GetCache().GetInformer(ctx, obj)
		if err != nil {
			return nil, fmt.Errorf("informer for %s: %w", kind, err)
		}
		if _, err := inf.AddEventHandler(hub.Handler(kind)); err != nil {
			return nil, fmt.Errorf("watch %s: %w", kind, err)
		}
	}
	cs := newControllerServer(mgr.GetClient(), mgr.GetCache(), mgr.GetAPIReader(), hub)
	degraded := &replicated.Reconciler{Client: mgr.GetClient(), Recorder: mgr.GetEventRecorder("mgmt-csi"), Repairer: cs}
	if err := degraded.SetupWithManager(mgr, metrics.Registry); err != nil {
		return nil, err
	}
	return cs, nil
}

// setupAgent registers the node agent's reconcilers and capacity reporter. A group snapshot's
// cut takes a lease on the host's writers at holdSocket. A node with a replica server carves
// and exports replicas.
func setupAgent(mgr ctrl.Manager, backend pmem.Backend, node, holdSocket string, repl ReplicationOptions) error {
	reporter := &agent.NodeReporter{
		Client: mgr.GetClient(), Backend: backend, Node: node, Interval: capacityInterval,
		WaitForSync: mgr.GetCache().WaitForCacheSync, ReplicaAddress: repl.Address,
	}
	if err := mgr.Add(reporter); err != nil {
		return err
	}
	if err := (&agent.VolumeReconciler{Client: mgr.GetClient(), Backend: backend, Node: node, Capacity: reporter}).SetupWithManager(mgr); err != nil {
		return err
	}
	if server := repl.server(); server != nil {
		r := &agent.ReplicaReconciler{Client: mgr.GetClient(), Backend: backend, Node: node, Server: server, Address: repl.Address, Capacity: reporter}
		if err := r.SetupWithManager(mgr); err != nil {
			return err
		}
	}
	snapshots := &agent.SnapshotReconciler{Client: mgr.GetClient(), Reader: mgr.GetAPIReader(), Backend: backend, Node: node, Capacity: reporter, HoldSocket: holdSocket}
	if targets := repl.targets(); targets != nil {
		snapshots.TargetDevice = targets.Device
	}
	return snapshots.SetupWithManager(mgr)
}
