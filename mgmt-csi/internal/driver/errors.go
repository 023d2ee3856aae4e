package driver

import (
	"google.golang.org/grpc/codes"

	"pvbridge.io/mgmt-csi/internal/pmem"
	"pvbridge.io/pkg/csinode"
)

// driverCodes are the sentinel errors of the PMEM back ends with the gRPC code the CSI spec
// asks for when an RPC fails with them; csinode adds the context's and the mounter's.
var driverCodes = []csinode.ErrorCode{
	{Err: pmem.ErrNotFound, Code: codes.NotFound},
	{Err: pmem.ErrNoSpace, Code: codes.ResourceExhausted},
	{Err: pmem.ErrInUse, Code: codes.FailedPrecondition},
	{Err: pmem.ErrInvalid, Code: codes.InvalidArgument},
	{Err: errReplicaNotReady, Code: codes.Aborted},
	{Err: errNoReplica, Code: codes.FailedPrecondition},
	{Err: errServedElsewhere, Code: codes.FailedPrecondition},
}

// statusError turns an error into the gRPC status an RPC returns (see csinode.StatusError).
func statusError(err error) error {
	return csinode.StatusError(err, driverCodes...)
}
