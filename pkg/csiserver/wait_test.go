package csiserver

import (
	"context"
	"errors"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/runtime/schema"

	"pvbridge.io/pkg/await"
)

func TestAwait(t *testing.T) {
	key := await.Key{Kind: "PVC", Namespace: "ns", Name: "a"}
	why := func() string { return ": ProvisioningFailed: no room" }
	for _, tt := range []struct {
		name string
		// done answers the first evaluation; later ones (after Notify) answer true.
		first    error
		timeout  time.Duration
		cancel   bool
		wantCode codes.Code
		wantMsg  string
	}{
		{name: "a condition that becomes true ends the wait", timeout: time.Minute, wantCode: codes.OK},
		{name: "a status of the condition is kept", first: status.Error(codes.ResourceExhausted, "full"), timeout: time.Minute,
			wantCode: codes.ResourceExhausted, wantMsg: "full"},
		{name: "an API error of the condition is mapped", first: apierrors.NewForbidden(schema.GroupResource{Resource: "pvcs"}, "a", errors.New("denied")), timeout: time.Minute,
			wantCode: codes.PermissionDenied},
		{name: "a wait that runs out answers DeadlineExceeded with why", first: errNever, timeout: 200 * time.Millisecond,
			wantCode: codes.DeadlineExceeded, wantMsg: "PVC ns/a is not ready yet: ProvisioningFailed: no room"},
		{name: "a cancelled call answers Canceled", first: errNever, timeout: time.Minute, cancel: true,
			wantCode: codes.Canceled, wantMsg: "waiting for PVC ns/a was canceled"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			hub := await.NewHub()
			ctx, cancel := context.WithTimeout(t.Context(), tt.timeout)
			defer cancel()
			if tt.cancel {
				cancel()
			}
			calls := 0
			err := Await(ctx, hub, key, "PVC ns/a", why, func(context.Context) (bool, error) {
				calls++
				switch {
				case calls > 1:
					return true, nil
				case errors.Is(tt.first, errNever):
					return false, nil
				case tt.first != nil:
					return false, tt.first
				}
				go hub.Notify(key) // the event that makes the condition true
				return false, nil
			})
			g.Expect(status.Code(err)).To(Equal(tt.wantCode), "%v", err)
			if tt.wantMsg != "" {
				g.Expect(status.Convert(err).Message()).To(ContainSubstring(tt.wantMsg))
			}
		})
	}
}

// errNever marks a condition that never becomes true.
var errNever = errors.New("never")

func TestWaitContextEndsBeforeTheCallsDeadline(t *testing.T) {
	g := NewWithT(t)
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	deadline, _ := ctx.Deadline()
	wctx, wcancel := waitContext(ctx)
	defer wcancel()
	wdeadline, ok := wctx.Deadline()
	g.Expect(ok).To(BeTrue())
	g.Expect(deadline.Sub(wdeadline)).To(BeNumerically("~", 2*time.Second, 100*time.Millisecond), "2 s at most")

	short, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	deadline, _ = short.Deadline()
	wctx, wcancel = waitContext(short)
	defer wcancel()
	wdeadline, _ = wctx.Deadline()
	g.Expect(deadline.Sub(wdeadline)).To(BeNumerically("~", time.Second, 100*time.Millisecond), "a tenth of the time left")

	none, wcancel := waitContext(t.Context())
	defer wcancel()
	_, ok = none.Deadline()
	g.Expect(ok).To(BeFalse())
}
