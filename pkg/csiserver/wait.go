package csiserver

import (
	"context"
	"errors"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"pvbridge.io/pkg/await"
)

// Await is the drivers' one wait policy: a CSI call that needs an object to change waits for it
// by watch (hub.Until on key; done reads the cache with the context it is given) and answers
// before its caller gives up, so that the answer is heard:
//   - nil when done reports true, or done's error (a gRPC status is kept, an API error mapped by
//     APIError);
//   - DeadlineExceeded "<what> is not ready yet<why()>" once the call's deadline is near: the
//     work goes on and the sidecar calls again; why (may be nil) says what holds it, e.g. the
//     latest warning Event, which the sidecar copies into the Events of the object it serves;
//   - Canceled when the call was.
func Await(ctx context.Context, hub *await.Hub, key await.Key, what string, why func() string, done func(context.Context) (bool, error)) error {
	wctx, cancel := waitContext(ctx)
	defer cancel()
	err := hub.Until(wctx, key, func() (bool, error) { return done(wctx) })
	switch {
	case err == nil:
		return nil
	case ctx.Err() != nil && errors.Is(err, context.Canceled):
		return status.Errorf(codes.Canceled, "waiting for %s was canceled", what)
	case wctx.Err() != nil:
		reason := ""
		if why != nil {
			reason = why()
		}
		return status.Errorf(codes.DeadlineExceeded, "%s is not ready yet%s", what, reason)
	}
	if _, ok := status.FromError(err); ok {
		return err
	}
	return APIError(err, "wait for %s", what)
}

// waitContext ends a little before ctx (a tenth of the time left, at most 2 s): a call must
// answer before its deadline to be heard.
func waitContext(ctx context.Context) (context.Context, context.CancelFunc) {
	deadline, ok := ctx.Deadline()
	if !ok {
		return context.WithCancel(ctx)
	}
	margin := min(2*time.Second, time.Until(deadline)/10)
	return context.WithDeadline(ctx, deadline.Add(-margin))
}
