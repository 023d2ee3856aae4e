package driver

import (
	"context"
	"errors"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"pvbridge.io/mgmt-csi/internal/pmem"
	"pvbridge.io/pkg/mounter"
)

// codeOf lists the sentinel errors of the PMEM back ends and of the mounter with the gRPC code
// the CSI spec asks for when an RPC fails with them. The first match wins.
var codeOf = []struct {
	err  error
	code codes.Code
}{
	{context.DeadlineExceeded, codes.DeadlineExceeded},
	{context.Canceled, codes.Canceled},

	{pmem.ErrNotFound, codes.NotFound},
	{pmem.ErrNoSpace, codes.ResourceExhausted},
	{pmem.ErrInUse, codes.FailedPrecondition},
	{pmem.ErrInvalid, codes.InvalidArgument},

	// The volume or the path the call names is not there.
	{mounter.ErrNotFound, codes.NotFound},
	// Publishing a filesystem that is not staged, growing one that is not mounted.
	{mounter.ErrNotMounted, codes.FailedPrecondition},
	// The spec's "volume published but is incompatible".
	{mounter.ErrIncompatible, codes.AlreadyExists},
	// A device holding data is never formatted: the volume is not usable as asked.
	{mounter.ErrHasData, codes.FailedPrecondition},
	{mounter.ErrUnsupported, codes.InvalidArgument},
}

// statusError turns an error into the gRPC status an RPC returns: an error that carries a
// status already keeps it, a known sentinel error (wrapped anywhere in the chain) gets its
// code from codeOf, anything else is Internal. The message is the error's text. nil stays nil.
func statusError(err error) error {
	if err == nil {
		return nil
	}
	var withStatus interface{ GRPCStatus() *status.Status }
	if errors.As(err, &withStatus) {
		// status.FromError keeps the code and uses the whole wrapped message.
		s, _ := status.FromError(err)
		return s.Err()
	}
	for _, c := range codeOf {
		if errors.Is(err, c.err) {
			return status.Error(c.code, err.Error())
		}
	}
	return status.Error(codes.Internal, err.Error())
}
