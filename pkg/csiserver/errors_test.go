package csiserver

import (
	"context"
	"errors"
	"fmt"
	"testing"

	. "github.com/onsi/gomega"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/runtime/schema"
)

func TestAPIError(t *testing.T) {
	gr := schema.GroupResource{Resource: "persistentvolumeclaims"}
	for _, tt := range []struct {
		name     string
		err      error
		wantCode codes.Code
	}{
		{"a quota is exhausted", apierrors.NewForbidden(gr, "x", errors.New(`exceeded quota: q, requested: requests.storage=1Gi`)), codes.ResourceExhausted},
		{"a quota not computed yet is retryable", apierrors.NewForbidden(gr, "x", errors.New(`status unknown for quota: pvbridge-snapshots, resources: count/volumesnapshots.snapshot.storage.k8s.io`)), codes.Unavailable},
		{"RBAC or an admission policy is a permission denied", apierrors.NewForbidden(gr, "x", errors.New("denied")), codes.PermissionDenied},
		{"a credential not accepted while it rotates is retryable", apierrors.NewUnauthorized("token revoked"), codes.Unavailable},
		{"an invalid object is an invalid argument", apierrors.NewInvalid(schema.GroupKind{Kind: "PersistentVolumeClaim"}, "x", nil), codes.InvalidArgument},
		{"a bad request is an invalid argument", apierrors.NewBadRequest("no"), codes.InvalidArgument},
		{"a missing object is not found", apierrors.NewNotFound(gr, "x"), codes.NotFound},
		{"a conflict is aborted", apierrors.NewConflict(gr, "x", errors.New("changed")), codes.Aborted},
		{"an object created meanwhile is aborted", apierrors.NewAlreadyExists(gr, "x"), codes.Aborted},
		{"an overloaded apiserver is unavailable", apierrors.NewTooManyRequests("slow down", 1), codes.Unavailable},
		{"an unreachable apiserver is unavailable", errors.New("connection refused"), codes.Unavailable},
		{"a deadline is a deadline", fmt.Errorf("wait: %w", context.DeadlineExceeded), codes.DeadlineExceeded},
		{"a cancelled call is cancelled", fmt.Errorf("wait: %w", context.Canceled), codes.Canceled},
	} {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			s, ok := status.FromError(APIError(tt.err, "create PVC %s", "x"))
			g.Expect(ok).To(BeTrue())
			g.Expect(s.Code()).To(Equal(tt.wantCode), s.Message())
			g.Expect(s.Message()).To(Equal("create PVC x: " + tt.err.Error()))
		})
	}
}
