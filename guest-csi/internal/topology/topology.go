// Package topology tells every guest node which management host runs its VirtualMachine, and how
// many volumes the VM can hold. The guest-csi controller, which has the management credential,
// labels each guest Node with the host of the VM of the same name and annotates it with the VM's
// hot-plug slots; the node plugin, which has none, reads its own Node and reports the label as
// its CSI topology, so that a guest PV is only used on VMs of the host that holds its PMEM, and
// the slots as its volume limit, so that the scheduler places no more volumes on the node than
// its VM can hold. The controller also taints the node of a VM that went with a lost host out of
// service (Labeller).
package topology

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	toolscache "k8s.io/client-go/tools/cache"
	watchtools "k8s.io/client-go/tools/watch"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"

	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
	"pvbridge.io/pkg/names"
)

// Key is the topology segment, and the guest Node label, naming the management host.
const Key = names.GuestTopologyKey

// MaxVolumesAnnotation is the guest Node annotation that holds its VirtualMachine's
// status.maxVolumes: how many volumes the VM can hold hot-plugged at once.
const MaxVolumesAnnotation = "guest.csi.pvbridge.io/max-volumes"

// ErrHostUnknown is what a node's host is while the controller has not labelled the node.
var ErrHostUnknown = errors.New("the host of this node is not known yet")

// VM is what a guest node knows of its VirtualMachine.
type VM struct {
	// Host is the management host that runs it.
	Host string
	// MaxVolumes is how many volumes it can hold hot-plugged at once; 0 when not known.
	MaxVolumes int64
	// HostLost says that its host is declared lost: the VM went with it (vmv1.HostLostReason).
	HostLost bool
}

// NodeHost reads the host of a guest node from the node's label, and its VM's slots from the
// node's annotation.
type NodeHost struct {
	Client kubernetes.Interface
	Node   string
}

// VMOf returns what the node knows of its VM, or an error wrapping ErrHostUnknown while it has
// no host label. An annotation that is no positive number is no limit: the controller writes
// only those, so anything else was written by somebody else.
func (h NodeHost) VMOf(ctx context.Context) (VM, error) {
	n, err := h.Client.CoreV1().Nodes().Get(ctx, h.Node, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return VM{}, fmt.Errorf("%w: node %s is not registered", ErrHostUnknown, h.Node)
	}
	if err != nil {
		return VM{}, fmt.Errorf("read node %s: %w", h.Node, err)
	}
	host := n.Labels[Key]
	if host == "" {
		return VM{}, fmt.Errorf("%w: node %s has no label %s", ErrHostUnknown, h.Node, Key)
	}
	vm := VM{Host: host}
	if v, err := strconv.ParseInt(n.Annotations[MaxVolumesAnnotation], 10, 32); err == nil && v > 0 {
		vm.MaxVolumes = v
	}
	return vm, nil
}

// WaitForHost watches the node until it has its host label, or ctx ends.
func (h NodeHost) WaitForHost(ctx context.Context) error {
	selector := fields.OneTermEqualSelector("metadata.name", h.Node).String()
	lw := &toolscache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, opts metav1.ListOptions) (runtime.Object, error) {
			opts.FieldSelector = selector
			return h.Client.CoreV1().Nodes().List(ctx, opts)
		},
		WatchFuncWithContext: func(ctx context.Context, opts metav1.ListOptions) (watch.Interface, error) {
			opts.FieldSelector = selector
			return h.Client.CoreV1().Nodes().Watch(ctx, opts)
		},
	}
	// The client tells whether it can stream the initial list (a fake cannot), as informers ask.
	_, err := watchtools.UntilWithSync(ctx, toolscache.ToListWatcherWithWatchListSemantics(lw, h.Client), &corev1.Node{}, nil, func(ev watch.Event) (bool, error) {
		n, ok := ev.Object.(*corev1.Node)
		return ok && n.Name == h.Node && n.Labels[Key] != "", nil
	})
	return err
}

// VMFunc returns what a guest node is to know of its VM: no host while it has none, or when the
// node is no VM of the cluster.
type VMFunc func(ctx context.Context, vm string) (VM, error)

// Labeller labels every guest Node with the host of its VM and annotates it with the VM's
// slots. It reconciles a node when the node or its VM changes. A node that is not Ready and
// whose VM went with a host declared lost gets the out-of-service taint (OutOfServiceTaint), as
// Kubernetes' non-graceful node shutdown asks an admin to: the guest's attach/detach controller
// then detaches its volumes at once, instead of after its 6 minutes' wait for an unmount that
// will never come, and its pods are deleted, so that a replacement node runs them with their
// volumes. The VM being gone with its host, nothing can write through it any more.
type Labeller struct {
	guest kubernetes.Interface
	vmOf  VMFunc
	queue workqueue.TypedRateLimitingInterface[string]
}

// NewLabeller returns a Labeller of the guest cluster's Nodes.
func NewLabeller(guest kubernetes.Interface, vmOf VMFunc) *Labeller {
	return &Labeller{
		guest: guest,
		vmOf:  vmOf,
		queue: workqueue.NewTypedRateLimitingQueueWithConfig(
			workqueue.NewTypedItemExponentialFailureRateLimiter[string](100*time.Millisecond, 30*time.Second),
			workqueue.TypedRateLimitingQueueConfig[string]{Name: "node-labeller"}),
	}
}

// VMHandler is the event handler for the informer of the cluster's VirtualMachines.
func (l *Labeller) VMHandler() toolscache.ResourceEventHandler { return l.handler() }

func (l *Labeller) handler() toolscache.ResourceEventHandler {
	enqueue := func(obj any) {
		if tomb, ok := obj.(toolscache.DeletedFinalStateUnknown); ok {
			obj = tomb.Obj
		}
		if m, ok := obj.(metav1.Object); ok {
			l.queue.Add(m.GetName())
		}
	}
	return toolscache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { enqueue(obj) },
		UpdateFunc: func(_, obj any) { enqueue(obj) },
	}
}

// Run watches the guest Nodes and labels them until ctx ends.
func (l *Labeller) Run(ctx context.Context) error {
	defer l.queue.ShutDown()
	factory := informers.NewSharedInformerFactory(l.guest, 0)
	nodes := factory.Core().V1().Nodes()
	if _, err := nodes.Informer().AddEventHandler(l.handler()); err != nil {
		return err
	}
	factory.Start(ctx.Done())
	defer factory.Shutdown()
	if !toolscache.WaitForCacheSync(ctx.Done(), nodes.Informer().HasSynced) {
		return nil // ctx ended
	}
	lister := nodes.Lister()
	go func() {
		<-ctx.Done()
		l.queue.ShutDown()
	}()
	logger := klog.FromContext(ctx)
	for {
		name, quit := l.queue.Get()
		if quit {
			return nil
		}
		node, err := lister.Get(name)
		if err == nil {
			err = l.label(ctx, node)
		} else if apierrors.IsNotFound(err) {
			err = nil // a VM that is no guest node (yet)
		}
		if err != nil {
			logger.Error(err, "Cannot label guest node with its host", "node", name)
			l.queue.AddRateLimited(name)
		} else {
			l.queue.Forget(name)
		}
		l.queue.Done(name)
	}
}

// OutOfServiceTaint is the taint the Labeller gives the node of a VM that went with its host.
var OutOfServiceTaint = corev1.Taint{Key: corev1.TaintNodeOutOfService, Value: "nodeshutdown", Effect: corev1.TaintEffectNoExecute}

func (l *Labeller) label(ctx context.Context, node *corev1.Node) error {
	vm, err := l.vmOf(ctx, node.Name)
	if err != nil || vm.Host == "" {
		return err
	}
	if vm.HostLost && !vmv1.NodeReady(node) {
		if err := l.taintOutOfService(ctx, node); err != nil {
			return err
		}
	}
	if msgs := validation.IsValidLabelValue(vm.Host); len(msgs) > 0 {
		return fmt.Errorf("host %q of VM %s is no label value: %v", vm.Host, node.Name, msgs)
	}
	// The slots go only where the host is (a VM that has none has not run yet), and are
	// removed when the VM no longer says: a stale limit would keep volumes from a node that
	// can hold them, or place more than it can.
	var maxVolumes *string // null in a merge patch removes the annotation
	if vm.MaxVolumes > 0 {
		maxVolumes = ptr.To(strconv.FormatInt(vm.MaxVolumes, 10))
	}
	if node.Labels[Key] == vm.Host && node.Annotations[MaxVolumesAnnotation] == ptr.Deref(maxVolumes, "") {
		return nil
	}
	patch, err := json.Marshal(map[string]any{"metadata": map[string]any{
		"labels":      map[string]string{Key: vm.Host},
		"annotations": map[string]*string{MaxVolumesAnnotation: maxVolumes},
	}})
	if err != nil {
		return err
	}
	if _, err := l.guest.CoreV1().Nodes().Patch(ctx, node.Name, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		if apierrors.IsNotFound(err) {
			return nil // deleted meanwhile
		}
		return err
	}
	klog.FromContext(ctx).Info("Labelled guest node with its host and slots", "node", node.Name, "host", vm.Host, "maxVolumes", vm.MaxVolumes)
	return nil
}

// taintOutOfService gives node OutOfServiceTaint, unless it has it: a JSON patch that holds only
// on the node as read, so that no taint written meanwhile is lost (a conflict is retried).
func (l *Labeller) taintOutOfService(ctx context.Context, node *corev1.Node) error {
	for _, t := range node.Spec.Taints {
		if t.MatchTaint(&OutOfServiceTaint) {
			return nil
		}
	}
	ops := []map[string]any{{"op": "test", "path": "/metadata/resourceVersion", "value": node.ResourceVersion}}
	if len(node.Spec.Taints) == 0 {
		ops = append(ops, map[string]any{"op": "add", "path": "/spec/taints", "value": []corev1.Taint{OutOfServiceTaint}})
	} else {
		ops = append(ops, map[string]any{"op": "add", "path": "/spec/taints/-", "value": OutOfServiceTaint})
	}
	patch, err := json.Marshal(ops)
	if err != nil {
		return err
	}
	if _, err := l.guest.CoreV1().Nodes().Patch(ctx, node.Name, types.JSONPatchType, patch, metav1.PatchOptions{}); err != nil {
		if apierrors.IsNotFound(err) {
			return nil // deleted meanwhile
		}
		return fmt.Errorf("taint node %s out of service: %w", node.Name, err)
	}
	klog.FromContext(ctx).Info("Tainted guest node out of service: its VM went with its lost host", "node", node.Name, "taint", OutOfServiceTaint.ToString())
	return nil
}
