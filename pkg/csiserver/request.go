package csiserver

import (
	"strconv"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// DefaultVolumeSize is the size of a volume whose request names none: 1 GiB.
const DefaultVolumeSize = 1 << 30

// RequestedSize returns the size to allocate for a capacity range: the required bytes, or
// the limit if it is below DefaultVolumeSize, or DefaultVolumeSize. A negative or inverted
// range is InvalidArgument.
func RequestedSize(r *csi.CapacityRange) (int64, error) {
	req, limit := r.GetRequiredBytes(), r.GetLimitBytes()
	switch {
	case req < 0 || limit < 0:
		return 0, status.Error(codes.InvalidArgument, "capacity_range must not be negative")
	case limit > 0 && req > limit:
		return 0, status.Errorf(codes.InvalidArgument, "required_bytes %d exceed limit_bytes %d", req, limit)
	case req > 0:
		return req, nil
	case limit > 0:
		return min(limit, DefaultVolumeSize), nil
	}
	return DefaultVolumeSize, nil
}

// Page returns the page of entries a List call asks for with starting_token and max_entries,
// and the token of the next page ("" after the last). A token is the index of the page's first
// entry; one that is not is Aborted, as the CSI spec asks.
func Page[T any](entries []T, token string, maxEntries int32) ([]T, string, error) {
	start := 0
	if token != "" {
		n, err := strconv.Atoi(token)
		if err != nil || n < 0 || n > len(entries) {
			return nil, "", status.Errorf(codes.Aborted, "starting_token %q is not valid", token)
		}
		start = n
	}
	end := len(entries)
	if m := int(maxEntries); m > 0 && start+m < end {
		end = start + m
	}
	next := ""
	if end < len(entries) {
		next = strconv.Itoa(end)
	}
	return entries[start:end], next, nil
}
