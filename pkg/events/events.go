// Package events reads the Events Kubernetes keeps about an object: how pvbridge tells a user
// why something waits, in a CSI error (guest-csi) or in the operator CLI's chain.
package events

import (
	"context"
	"fmt"
	"slices"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/fields"
	"sigs.k8s.io/controller-runtime/pkg/client"
)

// LatestWarning returns ": <reason>: <message>" of the latest Warning Event about obj (by UID),
// "" if there is none, obj was never seen, or the Events cannot be read: it only adds to a
// message.
func LatestWarning(ctx context.Context, r client.Reader, obj client.Object) string {
	if obj.GetUID() == "" {
		return ""
	}
	events := &corev1.EventList{}
	err := r.List(ctx, events, client.InNamespace(obj.GetNamespace()),
		client.MatchingFieldsSelector{Selector: fields.SelectorFromSet(fields.Set{"involvedObject.uid": string(obj.GetUID()), "type": corev1.EventTypeWarning})})
	if err != nil || len(events.Items) == 0 {
		return ""
	}
	latest := slices.MaxFunc(events.Items, func(a, b corev1.Event) int { return eventTime(a).Compare(eventTime(b)) })
	return fmt.Sprintf(": %s: %s", latest.Reason, latest.Message)
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
