package guestcsi_test

import (
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// retryable reports whether a sidecar retries an error as work in progress.
func retryable(err error) bool {
	switch status.Code(err) {
	case codes.Unavailable, codes.DeadlineExceeded, codes.Aborted:
		return true
	}
	return false
}
