package driver

import (
	"context"
	"errors"
	"fmt"
	"testing"

	. "github.com/onsi/gomega"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"pvbridge.io/mgmt-csi/internal/pmem"
	"pvbridge.io/pkg/mounter"
)

func TestStatusError(t *testing.T) {
	tests := []struct {
		name string
		err  error
		code codes.Code
		msg  string
	}{
		{name: "nil stays nil", err: nil, code: codes.OK},
		{name: "a missing volume is not found", err: fmt.Errorf("volume v: %w", pmem.ErrNotFound), code: codes.NotFound, msg: "volume v: not found"},
		{name: "no space is resource exhausted", err: fmt.Errorf("create v: %w", pmem.ErrNoSpace), code: codes.ResourceExhausted},
		{name: "a volume in use is a failed precondition", err: fmt.Errorf("delete v: %w", pmem.ErrInUse), code: codes.FailedPrecondition},
		{name: "an invalid request is an invalid argument", err: fmt.Errorf("shrink v: %w", pmem.ErrInvalid), code: codes.InvalidArgument},
		{name: "a missing path is not found", err: fmt.Errorf("%w: /t", mounter.ErrNotFound), code: codes.NotFound},
		{name: "a volume that is not staged is a failed precondition", err: fmt.Errorf("%w: /s", mounter.ErrNotMounted), code: codes.FailedPrecondition},
		{name: "an incompatible mount is already exists", err: fmt.Errorf("%w: /t", mounter.ErrIncompatible), code: codes.AlreadyExists},
		{name: "a device with data is a failed precondition", err: fmt.Errorf("%w: xfs", mounter.ErrHasData), code: codes.FailedPrecondition},
		{name: "an unsupported filesystem is an invalid argument", err: fmt.Errorf("%w: btrfs", mounter.ErrUnsupported), code: codes.InvalidArgument},
		{name: "a deadline is a deadline", err: fmt.Errorf("lvcreate: %w", context.DeadlineExceeded), code: codes.DeadlineExceeded},
		{name: "a cancellation is a cancellation", err: fmt.Errorf("mkfs: %w", context.Canceled), code: codes.Canceled},
		{name: "a status keeps its code", err: status.Error(codes.Unavailable, "apiserver"), code: codes.Unavailable, msg: "apiserver"},
		{
			name: "a wrapped status keeps its code and the whole message",
			err:  fmt.Errorf("get v: %w", status.Error(codes.Aborted, "busy")),
			code: codes.Aborted, msg: "get v: rpc error: code = Aborted desc = busy",
		},
		{name: "anything else is internal", err: errors.New("mkfs.xfs: out of memory"), code: codes.Internal, msg: "out of memory"},
		{
			name: "the first sentinel in the chain decides",
			err:  fmt.Errorf("stage: %w", errors.Join(fmt.Errorf("%w: /s", mounter.ErrNotMounted), errors.New("and more"))),
			code: codes.FailedPrecondition,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			err := statusError(tt.err)
			if tt.code == codes.OK {
				g.Expect(err).NotTo(HaveOccurred())
				return
			}
			s, ok := status.FromError(err)
			g.Expect(ok).To(BeTrue())
			g.Expect(s.Code()).To(Equal(tt.code))
			g.Expect(s.Message()).To(ContainSubstring(tt.msg))
			if _, carriesStatus := status.FromError(tt.err); !carriesStatus {
				g.Expect(s.Message()).To(Equal(tt.err.Error()), "the message is the error's text")
			}
		})
	}
}
