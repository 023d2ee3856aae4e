package driver

import (
	"context"
	"slices"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/klog/v2"
	"sigs.k8s.io/controller-runtime/pkg/client"

	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
	"pvbridge.io/pkg/listpatch"
)

// The edits of a VM's spec.volumes are written in batches, one batch at a time per VM (a group
// commit): the publishes of a burst to one VM become a few patches instead of one per volume,
// and the driver's writers never move the indices each other's patch tests. Each edit waits for
// the patch that carries it. An edit whose caller stopped waiting is still written: the sidecar
// retries, publishing is idempotent, and a removal of the volume follows it (removeVolume).
type volumeEdits struct {
	mu sync.Mutex
	// queues holds, for each VM with a batch being written, the edits that wait for the next.
	queues map[client.ObjectKey]*volumeBatch
	// writing holds the batch being written for each VM.
	writing map[client.ObjectKey]*volumeBatch
}

// editing reports whether an edit of id's entry of the VM at key is queued or being written.
func (e *volumeEdits) editing(key client.ObjectKey, id string) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.queues[key].holds(id) || e.writing[key].holds(id)
}

// holds reports whether the batch edits id's entry; a nil batch holds nothing.
func (b *volumeBatch) holds(id string) bool {
	return b != nil && (slices.Contains(b.add, id) || slices.Contains(b.remove, id))
}

// volumeBatch is the edits of one patch of a VM's spec.volumes: the management PVCs whose
// entries it adds and removes. err is the outcome, and refused the adds that did not fit the
// VM's slots (ResourceExhausted), both set before done is closed.
type volumeBatch struct {
	add, remove []string
	done        chan struct{}
	err         error
	refused     map[string]error
}

// batchTimeout bounds the writing of one batch, rereads included.
const batchTimeout = 30 * time.Second

// addVolume adds management PVC id to the VM's spec.volumes.
func (s *controllerServer) addVolume(ctx context.Context, vm *vmv1.VirtualMachine, id string) error {
	return s.editVolume(ctx, vm, id, true)
}

// removeVolume removes management PVC id from the VM's spec.volumes.
func (s *controllerServer) removeVolume(ctx context.Context, vm *vmv1.VirtualMachine, id string) error {
	return s.editVolume(ctx, vm, id, false)
}

// editVolume adds or removes id's entry, unless the VM, as cached, already is as asked and no
// edit of id is queued or being written. An edit whose caller stopped waiting may still be:
// the next edit of the volume then follows it instead of returning at once (a detach would
// otherwise return before an earlier attach landed, and the volume be attached after it).
func (s *controllerServer) editVolume(ctx context.Context, vm *vmv1.VirtualMachine, id string, add bool) error {
	if listed(vm, id) == add && !s.edits.editing(client.ObjectKeyFromObject(vm), id) {
		return nil
	}
	return s.editVolumes(ctx, vm, id, add)
}

// editVolumes queues the edit of id's entry into the next batch of the VM, starts writing the
// VM's batches unless that is under way, and waits for the batch's outcome.
func (s *controllerServer) editVolumes(ctx context.Context, vm *vmv1.VirtualMachine, id string, add bool) error {
	key := client.ObjectKeyFromObject(vm)
	s.edits.mu.Lock()
	if s.edits.queues == nil {
		s.edits.queues = map[client.ObjectKey]*volumeBatch{}
	}
	next, writing := s.edits.queues[key]
	if next == nil {
		next = &volumeBatch{done: make(chan struct{})}
		s.edits.queues[key] = next
	}
	// The last edit of a volume wins: an add whose caller stopped waiting and the removal that
	// followed it leave the removal alone in the batch.
	next.add = slices.DeleteFunc(next.add, func(v string) bool { return v == id })
	next.remove = slices.DeleteFunc(next.remove, func(v string) bool { return v == id })
	if add {
		next.add = append(next.add, id)
	} else {
		next.remove = append(next.remove, id)
	}
	s.edits.mu.Unlock()
	if !writing {
		// Not the caller's logger: the batch holds other callers' volumes too.
		wctx := klog.NewContext(context.WithoutCancel(ctx), klog.Background().WithValues("vm", klog.KObj(vm)))
		go s.writeBatches(wctx, vm.DeepCopy())
	}
	select {
	case <-next.done:
		if err := next.refused[id]; err != nil {
			return err
		}
		return next.err
	case <-ctx.Done():
		return status.FromContextError(ctx.Err()).Err()
	}
}

// writeBatches writes the VM's batches until none is queued. Each patch starts from the VM the
// one before stored, or, for the first, from the cache.
func (s *controllerServer) writeBatches(ctx context.Context, vm *vmv1.VirtualMachine) {
	key := client.ObjectKeyFromObject(vm)
	for {
		s.edits.mu.Lock()
		b := s.edits.queues[key]
		if b == nil || (len(b.add) == 0 && len(b.remove) == 0) {
			delete(s.edits.queues, key)
			s.edits.mu.Unlock()
			return
		}
		// Edits that arrive while this batch is written wait for the next one.
		s.edits.queues[key] = &volumeBatch{done: make(chan struct{})}
		if s.edits.writing == nil {
			s.edits.writing = map[client.ObjectKey]*volumeBatch{}
		}
		s.edits.writing[key] = b
		s.edits.mu.Unlock()

		bctx, cancel := context.WithTimeout(ctx, batchTimeout)
		b.err = s.writeBatch(bctx, vm, b)
		cancel()
		s.edits.mu.Lock()
		delete(s.edits.writing, key)
		s.edits.mu.Unlock()
		close(b.done)
	}
}

// writeBatch patches the VM's spec.volumes with the batch: a JSON patch that tests the VM's UID
// (it was not replaced by another of its name), appends the entries to add and removes those
// to remove at their indices, each tested to hold it (see listpatch); spec.volumes is a map
// keyed by name, so the apiserver also refuses a second entry of one name. A list read empty
// may not exist, and is written whole by a merge patch under the resourceVersion read instead.
// A patch the apiserver refuses (Invalid, or Conflict for the merge patch) was made from a VM
// that changed since: it is read again and the patch made anew, up to editAttempts times.
func (s *controllerServer) writeBatch(ctx context.Context, vm *vmv1.VirtualMachine, b *volumeBatch) error {
	start := time.Now()
	for attempt := 0; ; attempt++ {
		base := vm.DeepCopy()
		vm.Spec.Volumes = slices.DeleteFunc(vm.Spec.Volumes, func(v vmv1.VirtualMachineVolume) bool { return slices.Contains(b.remove, v.Name) })
		b.refused = nil
		for _, id := range b.add {
			switch {
			case listed(vm, id):
			case full(vm):
				if b.refused == nil {
					b.refused = map[string]error{}
				}
				b.refused[id] = status.Errorf(codes.ResourceExhausted,
					"VirtualMachine %s/%s holds %d volumes, as many as its hot-plug slots (status.maxVolumes); management PVC %s does not fit until one is detached",
					vm.Namespace, vm.Name, *vm.Status.MaxVolumes, id)
			default:
				vm.Spec.Volumes = append(vm.Spec.Volumes, vmv1.VirtualMachineVolume{Name: id, PersistentVolumeClaim: vmv1.PersistentVolumeClaimVolumeSource{ClaimName: id}})
			}
		}
		edit := listpatch.Diff("/spec/volumes", "name", base.Spec.Volumes, vm.Spec.Volumes, func(v vmv1.VirtualMachineVolume) string { return v.Name }, false)
		ops, ok := edit.Ops()
		var patch client.Patch
		switch {
		case !ok:
			patch = client.MergeFromWithOptions(base, client.MergeFromWithOptimisticLock{})
		case len(ops) == 0:
			return nil
		default:
			var err error
			if patch, err = listpatch.Patch(append([]listpatch.Op{listpatch.Test("/metadata/uid", vm.UID)}, ops...)...); err != nil {
				return status.Errorf(codes.Internal, "VirtualMachine %s/%s: %v", vm.Namespace, vm.Name, err)
			}
		}
		uid := vm.UID
		err := s.mgmt.Patch(ctx, vm, patch)
		if err == nil {
			klog.FromContext(ctx).V(2).Info("Wrote spec.volumes", "add", len(b.add), "remove", len(b.remove), "attempts", attempt+1, "took", time.Since(start))
		}
		switch {
		case !apierrors.IsInvalid(err) && !apierrors.IsConflict(err):
			return volumesError(vm, err)
		case attempt == editAttempts:
			return status.Errorf(codes.Aborted, "VirtualMachine %s/%s: other writers changed spec.volumes %d times while it was written (%v); retrying",
				vm.Namespace, vm.Name, attempt+1, err)
		}
		// Into an empty VM: decoding keeps the fields the stored object lacks, and this one holds
		// the edit that failed.
		key := client.ObjectKeyFromObject(vm)
		*vm = vmv1.VirtualMachine{}
		if err := s.mgmt.Live().Get(ctx, key, vm); err != nil {
			vm.Namespace, vm.Name = key.Namespace, key.Name
			return volumesError(vm, err)
		}
		if vm.UID != uid {
			return status.Errorf(codes.NotFound, "VirtualMachine %s/%s was replaced", vm.Namespace, vm.Name)
		}
	}
}

// full reports whether every hot-plug slot of the VM (status.maxVolumes; none: no limit) is
// taken: by an entry of spec.volumes, or by a disk still plugged whose entry left spec (its
// detach is under way, and its slot is free only once the hypervisor lets it go).
func full(vm *vmv1.VirtualMachine) bool {
	if vm.Status.MaxVolumes == nil {
		return false
	}
	taken := len(vm.Spec.Volumes)
	for _, e := range vm.Status.Volumes {
		if e.Attached && !listed(vm, e.Name) {
			taken++
		}
	}
	return taken >= int(*vm.Status.MaxVolumes)
}

// listed reports whether the VM's spec.volumes has id's entry.
func listed(vm *vmv1.VirtualMachine, id string) bool {
	return slices.ContainsFunc(vm.Spec.Volumes, func(v vmv1.VirtualMachineVolume) bool { return v.Name == id })
}

// editAttempts bounds the rereads of a batch: each one means another writer changed the list
// between a read and a patch.
const editAttempts = 10
