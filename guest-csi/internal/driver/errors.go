package driver

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	apierrors "k8s.io/apimachinery/pkg/api/errors"

	"pvbridge.io/guest-csi/internal/mgmt"
	"pvbridge.io/pkg/csinode"
)

// driverCodes are this driver's sentinel errors with the gRPC code the CSI spec asks for when
// an RPC fails with them; csinode adds the context's and the mounter's.
var driverCodes = []csinode.ErrorCode{
	{Err: errInvalidSerial, Code: codes.InvalidArgument},
	// The host of this node is not known yet: NodeGetInfo is retried by kubelet.
	{Err: ErrHostUnknown, Code: codes.Unavailable},
}

// statusError turns an error into the gRPC status an RPC returns (see csinode.StatusError).
func statusError(err error) error {
	return csinode.StatusError(err, driverCodes...)
}

// apiError turns an error of a management API call into the gRPC status a controller RPC
// returns. The management side's refusals keep their reason in the message: RBAC and the
// admission policy (PermissionDenied, InvalidArgument), a ResourceQuota (ResourceExhausted);
// everything that may pass by itself (no session yet, a credential not accepted while a
// rotation reaches the guest, the apiserver unreachable or overloaded, a conflict) is
// retryable.
func apiError(err error, format string, args ...any) error {
	msg := fmt.Sprintf(format, args...) + ": " + err.Error()
	switch {
	case errors.Is(err, context.DeadlineExceeded):
		return status.Error(codes.DeadlineExceeded, msg)
	case errors.Is(err, context.Canceled):
		return status.Error(codes.Canceled, msg)
	case errors.Is(err, mgmt.ErrNotConnected):
		return status.Error(codes.Unavailable, msg)
	case apierrors.IsForbidden(err) && strings.Contains(err.Error(), "exceeded quota"):
		return status.Error(codes.ResourceExhausted, msg)
	case apierrors.IsForbidden(err):
		return status.Error(codes.PermissionDenied, msg)
	case apierrors.IsUnauthorized(err):
		// The credential is not accepted (yet): it was rotated or revoked and the new one is
		// on its way (the Secret volume, then the next reread).
		return status.Error(codes.Unavailable, msg)
	case apierrors.IsInvalid(err), apierrors.IsBadRequest(err):
		return status.Error(codes.InvalidArgument, msg)
	case apierrors.IsNotFound(err):
		return status.Error(codes.NotFound, msg)
	case apierrors.IsConflict(err), apierrors.IsAlreadyExists(err):
		return status.Error(codes.Aborted, msg)
	}
	return status.Error(codes.Unavailable, msg)
}
