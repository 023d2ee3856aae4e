package csinode

import (
	"context"
	"errors"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"pvbridge.io/pkg/mounter"
)

// ErrorCode is a sentinel error and the gRPC code the CSI spec asks for when an RPC fails with it.
type ErrorCode struct {
	Err  error
	Code codes.Code
}

// contextCodes come first, a driver's own codes next, mounterCodes last.
var contextCodes = []ErrorCode{
	{context.DeadlineExceeded, codes.DeadlineExceeded},
	{context.Canceled, codes.Canceled},
}

var mounterCodes = []ErrorCode{
	// The volume, the disk (not attached yet: kubelet retries) or the path the call names is
	// not there.
	{mounter.ErrNotFound, codes.NotFound},
	// Publishing a filesystem that is not staged, growing one that is not mounted.
	{mounter.ErrNotMounted, codes.FailedPrecondition},
	// The spec's "volume published but is incompatible".
	{mounter.ErrIncompatible, codes.AlreadyExists},
	// A device holding data is never formatted: the volume is not usable as asked.
	{mounter.ErrHasData, codes.FailedPrecondition},
	{mounter.ErrUnsupported, codes.InvalidArgument},
}

// StatusError turns an error into the gRPC status an RPC returns: an error that carries a
// status already keeps it, a known sentinel error (wrapped anywhere in the chain) gets its code
// from the context's errors, the driver's Codes, then the mounter's, anything else is Internal. The message is the
// error's text. nil stays nil.
func (b *Base) StatusError(err error) error {
	return StatusError(err, b.Codes...)
}

// StatusError is Base.StatusError for code outside a Node service (a controller).
func StatusError(err error, driverCodes ...ErrorCode) error {
	if err == nil {
		return nil
	}
	var withStatus interface{ GRPCStatus() *status.Status }
	if errors.As(err, &withStatus) {
		// status.FromError keeps the code and uses the whole wrapped message.
		s, _ := status.FromError(err)
		return s.Err()
	}
	for _, table := range [][]ErrorCode{contextCodes, driverCodes, mounterCodes} {
		for _, c := range table {
			if errors.Is(err, c.Err) {
				return status.Error(c.Code, err.Error())
			}
		}
	}
	return status.Error(codes.Internal, err.Error())
}
