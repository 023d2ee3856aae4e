package driver

import (
	"context"
	"errors"
	"fmt"
	"testing"

	. "github.com/onsi/gomega"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"pvbridge.io/guest-csi/internal/request"
	"pvbridge.io/pkg/mounter"
)

func TestStatusError(t *testing.T) {
	tests := []struct {
		name     string
		err      error
		wantCode codes.Code
		wantMsg  string
	}{
		{name: "a disk not attached yet is not found", err: fmt.Errorf("find the disk: %w", mounter.ErrNotFound), wantCode: codes.NotFound, wantMsg: "find the disk: not found"},
		{name: "a bad serial is an invalid argument", err: fmt.Errorf("%w: x", request.ErrInvalidSerial), wantCode: codes.InvalidArgument},
		{name: "an unknown host is unavailable", err: fmt.Errorf("node n: %w", ErrHostUnknown), wantCode: codes.Unavailable},
		{name: "a disk with data is a failed precondition", err: fmt.Errorf("stage: %w", mounter.ErrHasData), wantCode: codes.FailedPrecondition},
		{name: "a different mount is already exists", err: mounter.ErrIncompatible, wantCode: codes.AlreadyExists},
		{name: "not staged is a failed precondition", err: mounter.ErrNotMounted, wantCode: codes.FailedPrecondition},
		{name: "an unsupported filesystem is an invalid argument", err: mounter.ErrUnsupported, wantCode: codes.InvalidArgument},
		{name: "a deadline is a deadline", err: fmt.Errorf("wait: %w", context.DeadlineExceeded), wantCode: codes.DeadlineExceeded},
		{name: "a status keeps its code", err: fmt.Errorf("outer: %w", status.Error(codes.Aborted, "busy")), wantCode: codes.Aborted, wantMsg: "outer: rpc error: code = Aborted desc = busy"},
		{name: "anything else is internal", err: errors.New("boom"), wantCode: codes.Internal, wantMsg: "boom"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			expectCode(NewWithT(t), statusError(tt.err), tt.wantCode, tt.wantMsg)
		})
	}
	NewWithT(t).Expect(statusError(nil)).To(Succeed())
}
