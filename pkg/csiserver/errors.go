package csiserver

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
)

// APIError turns an error of a Kubernetes API call into the gRPC status a controller RPC returns,
// with the message format, args and the error's text. Refusals keep their reason in the message
// and are not retried as if they could pass by themselves: RBAC and admission policies
// (PermissionDenied), an invalid object (InvalidArgument), a ResourceQuota (ResourceExhausted).
// What may pass by itself is retryable: the apiserver unreachable or overloaded, no session
// yet, a credential not accepted while a rotation reaches its user, a quota not computed yet
// (Unavailable), a conflict
// (Aborted), the call's deadline (DeadlineExceeded). Both drivers map their API errors here.
func APIError(err error, format string, args ...any) error {
	msg := fmt.Sprintf(format, args...) + ": " + err.Error()
	switch {
	case errors.Is(err, context.DeadlineExceeded):
		return status.Error(codes.DeadlineExceeded, msg)
	case errors.Is(err, context.Canceled):
		return status.Error(codes.Canceled, msg)
	case apierrors.IsForbidden(err) && strings.Contains(err.Error(), "exceeded quota"):
		return status.Error(codes.ResourceExhausted, msg)
	case apierrors.IsForbidden(err) && strings.Contains(err.Error(), "status unknown for quota"):
		// A quota whose usage kube-controller-manager has not computed yet (just created):
		// the apiserver admits nothing it covers until then.
		return status.Error(codes.Unavailable, msg)
	case apierrors.IsForbidden(err):
		return status.Error(codes.PermissionDenied, msg)
	case apierrors.IsUnauthorized(err):
		// The credential is not accepted (yet): it was rotated or revoked and the new one is
		// on its way.
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
