// Package events reads the Events Kubernetes keeps about an object: how pvbridge tells a user
// why something waits, in a CSI error (guest-csi) or in the operator CLI's chain.
package events

import (
	"context"
	"fmt"
	"maps"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"
)

// LatestWarning returns ": <reason>: <message>" of the latest Warning Event about obj (by UID),
// "" if there is none, obj was never seen, or the Events cannot be read: it only adds to a
// message.
func LatestWarning(ctx context.Context, r client.Reader, obj client.Object) string {
	if obj.GetUID() == "" {
		return ""
	}
	latest, err := latestWarnings(ctx, r, obj.GetNamespace(), fields.Set{"involvedObject.uid": string(obj.GetUID())})
	if err != nil {
		return ""
	}
	return latest[obj.GetUID()]
}

// Warnings answers LatestWarning for the objects of a namespace from one List of the
// namespace's Warning Events, made at most once per period and shared by every caller in
// between: an answer is at most period old. kube-apiserver keeps no watch cache of Events, so
// every List reads all of a namespace's Events from etcd; in a burst (a thousand waits running
// out, each asking about its own object) one List per caller was the management apiserver's
// largest request time.
type Warnings struct {
	reader client.Reader
	period time.Duration

	mu         sync.Mutex
	namespaces map[string]*namespaceWarnings
}

// namespaceWarnings is the latest List of a namespace's Warning Events.
type namespaceWarnings struct {
	mu     sync.Mutex // held while listing: the callers in between wait and share its answer
	listed time.Time
	latest map[types.UID]string
}

// NewWarnings returns Warnings that list with r at most once per period and namespace.
func NewWarnings(r client.Reader, period time.Duration) *Warnings {
	return &Warnings{reader: r, period: period, namespaces: map[string]*namespaceWarnings{}}
}

// Latest returns ": <reason>: <message>" of the latest Warning Event about obj as of a List at
// most period old, "" if there is none or obj was never seen. A List that fails keeps the
// previous answer until the next period: callers do not queue behind failing Lists.
func (w *Warnings) Latest(ctx context.Context, obj client.Object) string {
	if obj.GetUID() == "" {
		return ""
	}
	w.mu.Lock()
	ns, ok := w.namespaces[obj.GetNamespace()]
	if !ok {
		ns = &namespaceWarnings{}
		w.namespaces[obj.GetNamespace()] = ns
	}
	w.mu.Unlock()

	ns.mu.Lock()
	defer ns.mu.Unlock()
	if time.Since(ns.listed) >= w.period {
		if latest, err := latestWarnings(ctx, w.reader, obj.GetNamespace(), nil); err == nil {
			ns.latest = latest
		}
		ns.listed = time.Now()
	}
	return ns.latest[obj.GetUID()]
}

// latestWarnings lists the Warning Events of namespace that match set and returns, for each
// object they are about, ": <reason>: <message>" of the latest.
func latestWarnings(ctx context.Context, r client.Reader, namespace string, set fields.Set) (map[types.UID]string, error) {
	selector := fields.Set{"type": corev1.EventTypeWarning}
	maps.Copy(selector, set)
	list := &corev1.EventList{}
	if err := r.List(ctx, list, client.InNamespace(namespace), client.MatchingFieldsSelector{Selector: fields.SelectorFromSet(selector)}); err != nil {
		return nil, err
	}
	latest := map[types.UID]*corev1.Event{}
	for i := range list.Items {
		e := &list.Items[i]
		if cur, ok := latest[e.InvolvedObject.UID]; !ok || eventTime(*e).After(eventTime(*cur)) {
			latest[e.InvolvedObject.UID] = e
		}
	}
	out := make(map[types.UID]string, len(latest))
	for uid, e := range latest {
		out[uid] = fmt.Sprintf(": %s: %s", e.Reason, e.Message)
	}
	return out, nil
}

// eventTime is when an Event last happened, whichever API wrote it.
func eventTime(e corev1.Event) time.Time {
	switch {
	case !e.LastTimestamp.IsZero():
		return e.LastTimestamp.Time
	case !e.EventTime.IsZero():
		return e.EventTime.Time
	}
	return e.CreationTimestamp.Time
}
