package driver

import (
	"testing"

	. "github.com/onsi/gomega"
	"sigs.k8s.io/controller-runtime/pkg/client"
)

// An edit whose caller stopped waiting is still queued or being written; the next edit of the
// same volume must follow it, not return at once.
func TestEditing(t *testing.T) {
	g := NewWithT(t)
	vm1, vm2 := client.ObjectKey{Namespace: "ns", Name: "vm-1"}, client.ObjectKey{Namespace: "ns", Name: "vm-2"}
	e := &volumeEdits{
		queues:  map[client.ObjectKey]*volumeBatch{vm1: {add: []string{"queued"}, remove: []string{"leaving"}}},
		writing: map[client.ObjectKey]*volumeBatch{vm1: {add: []string{"in-flight"}}},
	}
	g.Expect(e.editing(vm1, "queued")).To(BeTrue())
	g.Expect(e.editing(vm1, "in-flight")).To(BeTrue())
	g.Expect(e.editing(vm1, "leaving")).To(BeTrue())
	g.Expect(e.editing(vm1, "other")).To(BeFalse())
	g.Expect(e.editing(vm2, "queued")).To(BeFalse(), "another VM's edits")
	g.Expect((&volumeEdits{}).editing(vm1, "queued")).To(BeFalse())
}
