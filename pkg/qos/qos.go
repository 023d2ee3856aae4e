// Package qos is the vocabulary of a volume's live I/O limits: the parameters of a management
// VolumeAttributesClass of pmem.csi.pvbridge.io. mgmt-csi validates them (CreateVolume's and
// ControllerModifyVolume's mutable parameters); the vm-operator host agent reads the class of
// each attached volume's PV and has the hypervisor enforce them on the VM's disk.
package qos

import (
	"fmt"
	"slices"
	"strconv"
	"strings"

	"k8s.io/apimachinery/pkg/api/resource"
)

// Parameters of a management VolumeAttributesClass.
const (
	// MaxIOPSParam bounds the read and write operations per second of the volume in its VM
	// (an integer; 0 or absent: no limit).
	MaxIOPSParam = "maxIOPS"
	// MaxBytesPerSecondParam bounds the bytes read and written per second (a quantity such as
	// "8Mi" or "10M"; 0 or absent: no limit).
	MaxBytesPerSecondParam = "maxBytesPerSecond"
)

// MaxValue bounds both limits: QEMU's throttling takes at most 10^15 per second.
const MaxValue = 1_000_000_000_000_000

// Limits are a volume's I/O limits; zero is no limit.
type Limits struct {
	IOPS           int64
	BytesPerSecond int64
}

// Parse reads the limits from a class's parameters. Every error names the parameter and what
// is expected; an unknown parameter is an error, so that a misspelt limit is never ignored.
func Parse(params map[string]string) (Limits, error) {
	var l Limits
	var errs []string
	keys := make([]string, 0, len(params))
	for k := range params {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for _, k := range keys {
		v := params[k]
		var err error
		switch k {
		case MaxIOPSParam:
			l.IOPS, err = parseValue(v, false)
		case MaxBytesPerSecondParam:
			l.BytesPerSecond, err = parseValue(v, true)
		default:
			err = fmt.Errorf("unknown parameter (only %s and %s)", MaxIOPSParam, MaxBytesPerSecondParam)
		}
		if err != nil {
			errs = append(errs, fmt.Sprintf("%s %q: %v", k, v, err))
		}
	}
	if len(errs) > 0 {
		return Limits{}, fmt.Errorf("invalid I/O limits: %s", strings.Join(errs, "; "))
	}
	return l, nil
}

func parseValue(v string, quantity bool) (int64, error) {
	var n int64
	if quantity {
		q, err := resource.ParseQuantity(v)
		if err != nil {
			return 0, fmt.Errorf("not a number")
		}
		var ok bool
		if n, ok = q.AsInt64(); !ok {
			return 0, fmt.Errorf("not a whole number of bytes")
		}
	} else {
		var err error
		if n, err = strconv.ParseInt(v, 10, 64); err != nil {
			return 0, fmt.Errorf("not a whole number")
		}
	}
	switch {
	case n < 0:
		return 0, fmt.Errorf("negative")
	case n > MaxValue:
		return 0, fmt.Errorf("above %d", int64(MaxValue))
	}
	return n, nil
}

// String describes the limits for people: "200 IOPS, 8388608 bytes/s", "no limits".
func (l Limits) String() string {
	var parts []string
	if l.IOPS > 0 {
		parts = append(parts, fmt.Sprintf("%d IOPS", l.IOPS))
	}
	if l.BytesPerSecond > 0 {
		parts = append(parts, fmt.Sprintf("%d bytes/s", l.BytesPerSecond))
	}
	if len(parts) == 0 {
		return "no limits"
	}
	return strings.Join(parts, ", ")
}
