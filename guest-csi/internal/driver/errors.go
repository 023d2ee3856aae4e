package driver

import (
	"google.golang.org/grpc/codes"

	"pvbridge.io/guest-csi/internal/request"
	"pvbridge.io/pkg/csinode"
)

// driverCodes are this driver's sentinel errors with the gRPC code the CSI spec asks for when
// an RPC fails with them; csinode adds the context's and the mounter's.
var driverCodes = []csinode.ErrorCode{
	{Err: request.ErrInvalidSerial, Code: codes.InvalidArgument},
	// The host of this node is not known yet: NodeGetInfo is retried by kubelet.
	{Err: ErrHostUnknown, Code: codes.Unavailable},
}

// statusError turns an error into the gRPC status an RPC returns (see csinode.StatusError). An
// error of a management API call goes through csiserver.APIError instead.
func statusError(err error) error {
	return csinode.StatusError(err, driverCodes...)
}
