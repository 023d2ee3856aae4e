package agent

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"golang.org/x/sys/unix"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	pmemv1 "pvbridge.io/pkg/apis/pmem/v1alpha1"
	"pvbridge.io/pkg/hold"
)

// WritersNotHeldReason is the Ready condition's reason while a group snapshot waits for its
// writers to be held (no holder answers on this host, or it failed); retried.
const WritersNotHeldReason = "WritersNotHeld"

// CutReason is the Ready condition's reason of a member whose group was cut whole and that is
// marked Ready next; its message says how the member was cut. Every member carries it before
// any is marked Ready, so a member finished later (a status write failed) says the same.
const CutReason = "Cut"

// groupWait is how long a member waits for the others of its group to appear in the cache.
const groupWait = time.Second

// cutGroup cuts the members of snap's group, all of them at once: it asks the host's holder
// (the vm-operator host agent) to hold the writers of their volumes, cuts each member, and lets
// the writers go. The members then show one instant, as a crash would leave the volumes. A
// group is cut whole or not at all: a member that fails, or a hold that ends before the last
// member is cut, removes what was cut, and the next attempt cuts every member anew; but a
// group whose cut outlasted the hold is not attempted again (HoldExpiredReason).
//
// The statuses are written after the release, in two rounds: every member's how it was cut
// (CutReason), then each member Ready. A group some of whose members are Ready was cut whole
// and stopped while writing them: the others' data is of the same instant, the back end returns
// it as it is (CreateSnapshot is idempotent) without a second hold, and their own CutReason
// message is what their Ready condition says.
func (r *SnapshotReconciler) cutGroup(ctx context.Context, snap *pmemv1.PmemSnapshot) (ctrl.Result, error) {
	g := snap.Spec.Group
	log := ctrl.LoggerFrom(ctx).WithValues("groupSnapshotID", g.ID)
	// One group at a time (the holder holds one lease at a time too); a worker never waits for
	// another group's cut, which may take the whole hold: it comes back.
	if !r.groupMu.TryLock() {
		return ctrl.Result{RequeueAfter: groupWait}, nil
	}
	defer r.groupMu.Unlock()

	list := &pmemv1.PmemSnapshotList{}
	if err := r.Client.List(ctx, list, client.MatchingLabels{pmemv1.GroupLabel: g.ID}); err != nil {
		return ctrl.Result{}, fmt.Errorf("list the members of group snapshot %s: %w", g.ID, err)
	}
	var members, todo []*pmemv1.PmemSnapshot
	uncut := 0 // members neither Ready nor cut whole (CutReason)
	for i := range list.Items {
		m := &list.Items[i]
		if m.Spec.Group == nil || m.Spec.Group.ID != g.ID || m.Spec.Node != r.Node || !m.DeletionTimestamp.IsZero() {
			continue
		}
		members = append(members, m)
		ready := meta.FindStatusCondition(m.Status.Conditions, pmemv1.ReadyCondition)
		if ready == nil || ready.Status != metav1.ConditionTrue {
			todo = append(todo, m)
		}
		if ready == nil || (ready.Status != metav1.ConditionTrue && ready.Reason != CutReason) {
			uncut++
		}
	}
	switch {
	case len(todo) == 0 || slices.ContainsFunc(todo, holdExpired):
		// Cut, or given up: a group whose cut outlasted the hold waits for its deletion.
		return ctrl.Result{}, nil
	case len(members) < int(g.Size):
		log.V(4).Info("Waiting for the other members of the group", "members", len(members), "size", g.Size)
		return ctrl.Result{RequeueAfter: groupWait}, nil
	case uncut == 0 || len(todo) < len(members):
		// Cut whole: every member says so, or some are Ready, which they are only once all
		// say so.
		return ctrl.Result{}, r.markReady(ctx, todo)
	}

	// Nothing is Ready, and not every member was cut whole: whatever the back end has of these
	// members is a leftover of a cut that was interrupted, perhaps of another instant.
	for _, m := range todo {
		if err := r.Backend.DeleteSnapshot(ctx, m.Name); err != nil {
			return ctrl.Result{}, err
		}
	}
	sources := make([]string, len(todo))
	for i, m := range todo {
		sources[i] = m.Spec.SourceVolumeID
	}
	lease, err := hold.Acquire(ctx, r.HoldSocket, sources)
	if err != nil {
		for _, m := range todo {
			if serr := r.setStatus(ctx, m, nil, metav1.ConditionFalse, WritersNotHeldReason, err.Error()); serr != nil {
				return ctrl.Result{}, serr
			}
		}
		return ctrl.Result{}, err
	}
	cut, cutErr := r.cutMembers(ctx, todo, lease.Held)
	heldFor, relErr := lease.Release(ctx)
	if cutErr == nil {
		cutErr = relErr
	}
	if cutErr != nil {
		for _, id := range cut {
			if err := r.Backend.DeleteSnapshot(ctx, id); err != nil {
				cutErr = errors.Join(cutErr, err)
			}
		}
		reason, retry := failureReason(cutErr)
		switch {
		case errors.Is(cutErr, errUnheld):
			reason, retry = WritersNotHeldReason, true
		case errors.Is(cutErr, hold.ErrExpired):
			reason, retry = pmemv1.HoldExpiredReason, false
			cutErr = fmt.Errorf("cutting the %d members took longer than the host's longest hold of their writers: "+
				"not tried again, since each try would hold them again (raise the host agent's --hold-max, or snapshot fewer or smaller volumes together): %w",
				len(todo), cutErr)
		}
		for _, m := range todo {
			if serr := r.setStatus(ctx, m, nil, metav1.ConditionFalse, reason, cutErr.Error()); serr != nil {
				return ctrl.Result{}, serr
			}
		}
		if retry {
			return ctrl.Result{}, cutErr
		}
		return ctrl.Result{}, nil
	}
	log.Info("Cut group snapshot", "members", cut, "heldVolumeIDs", lease.Held, "heldFor", heldFor)
	r.Capacity.Refresh(ctx)
	for _, m := range todo {
		if err := r.setStatus(ctx, m, nil, metav1.ConditionFalse, CutReason, howCut(m, lease.Held, heldFor)); err != nil {
			return ctrl.Result{}, err
		}
	}
	return ctrl.Result{}, r.markReady(ctx, todo)
}

// cutWith says that member m was cut with the rest of its group.
func cutWith(m *pmemv1.PmemSnapshot) string {
	return fmt.Sprintf("cut with the %d members of group snapshot %s", m.Spec.Group.Size, m.Spec.Group.ID)
}

// holdExpired reports whether m's group was given up because its cut outlasted the hold.
func holdExpired(m *pmemv1.PmemSnapshot) bool {
	c := meta.FindStatusCondition(m.Status.Conditions, pmemv1.ReadyCondition)
	return c != nil && c.Reason == pmemv1.HoldExpiredReason
}

// howCut says how a member of a group that was cut whole was cut: whether the writers of its
// volume were held, and how long.
func howCut(m *pmemv1.PmemSnapshot, held []string, heldFor time.Duration) string {
	msg := cutWith(m)
	if slices.Contains(held, m.Spec.SourceVolumeID) {
		return msg + fmt.Sprintf(" while the writers of its volume were held for %s", heldFor.Round(time.Millisecond))
	}
	return msg + "; its volume had no writer to hold"
}

// cutMembers cuts the members, in the hold of the volumes held, and returns those it cut.
func (r *SnapshotReconciler) cutMembers(ctx context.Context, members []*pmemv1.PmemSnapshot, held []string) ([]string, error) {
	if err := r.unheld(ctx, members, held); err != nil {
		return nil, err
	}
	var cut []string
	for _, m := range members {
		if _, err := r.Backend.CreateSnapshot(ctx, m.Name, snapshotSource(m)); err != nil {
			return cut, fmt.Errorf("member %s of volume %s: %w", m.Name, m.Spec.SourceVolumeID, err)
		}
		cut = append(cut, m.Name)
	}
	return cut, nil
}

// errUnheld: a member's volume is in use by a writer that no holder held.
var errUnheld = errors.New("in use on this host by a writer that no holder holds (not a VM's disk: a management pod?), so that the group could not be cut at one instant")

// unheld checks, inside the hold, that every member whose volume the holder did not hold has
// no writer: the device its writers use here is not mounted or claimed (an exclusive open
// succeeds). A volume no VM has attached may be a management pod's, whose writes nothing here
// can hold: such a group is refused rather than cut torn.
func (r *SnapshotReconciler) unheld(ctx context.Context, members []*pmemv1.PmemSnapshot, held []string) error {
	inUse := r.InUse
	if inUse == nil {
		inUse = claimed
	}
	for _, m := range members {
		if slices.Contains(held, m.Spec.SourceVolumeID) {
			continue
		}
		device, err := r.writersDevice(ctx, m)
		if err != nil {
			return fmt.Errorf("volume %s of member %s: %w", m.Spec.SourceVolumeID, m.Name, err)
		}
		if device == "" {
			continue
		}
		busy, err := inUse(device)
		if err != nil {
			return fmt.Errorf("volume %s of member %s: %w", m.Spec.SourceVolumeID, m.Name, err)
		}
		if busy {
			return fmt.Errorf("volume %s (%s) of member %s is %w", m.Spec.SourceVolumeID, device, m.Name, errUnheld)
		}
	}
	return nil
}

// writersDevice returns the device through which the writers of member m's volume write on
// this node: the volume's own, or a replicated volume's target's ("" when no target runs
// here). A replicated volume that another node serves now has writers this host cannot hold.
func (r *SnapshotReconciler) writersDevice(ctx context.Context, m *pmemv1.PmemSnapshot) (string, error) {
	if m.Spec.SourceReplica == "" {
		vol, err := r.Backend.GetVolume(ctx, m.Spec.SourceVolumeID)
		return vol.Device, err
	}
	vol := &pmemv1.PmemVolume{}
	if err := r.Reader.Get(ctx, client.ObjectKey{Name: m.Spec.SourceVolumeID}, vol); err != nil {
		return "", err
	}
	switch vol.Status.Target {
	case "":
		return "", nil // no node serves it: it has no writer
	case r.Node:
		if r.TargetDevice == nil {
			return "", fmt.Errorf("node %s serves the replicated volume and has no targets", r.Node)
		}
		return r.TargetDevice(vol.Name)
	default:
		return "", fmt.Errorf("served by node %s now, whose writers this host does not hold: %w", vol.Status.Target, errUnheld)
	}
}

// claimed reports whether the block device is mounted or claimed exclusively: the kernel then
// refuses an exclusive open with EBUSY.
func claimed(device string) (bool, error) {
	fd, err := unix.Open(device, unix.O_RDONLY|unix.O_EXCL|unix.O_CLOEXEC, 0)
	if errors.Is(err, unix.EBUSY) {
		return true, nil
	}
	if err != nil {
		return false, fmt.Errorf("open %s exclusively: %w", device, err)
	}
	return false, unix.Close(fd)
}

// markReady marks the members of a group that was cut whole Ready, each with the message its
// CutReason condition carries.
func (r *SnapshotReconciler) markReady(ctx context.Context, todo []*pmemv1.PmemSnapshot) error {
	for _, m := range todo {
		got, err := r.Backend.CreateSnapshot(ctx, m.Name, snapshotSource(m))
		if err != nil {
			return err
		}
		msg := cutWith(m)
		if c := meta.FindStatusCondition(m.Status.Conditions, pmemv1.ReadyCondition); c != nil && c.Reason == CutReason {
			msg = c.Message
		}
		if err := r.setStatus(ctx, m, &got, metav1.ConditionTrue, pmemv1.CreatedReason, msg); err != nil {
			return err
		}
	}
	return nil
}
