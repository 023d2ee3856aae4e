package pmem

import (
	"context"
	"fmt"

	pmemv1 "pvbridge.io/pkg/apis/pmem/v1alpha1"
)

// Options configure the back end of each mode; New reads those of the mode it makes.
type Options struct {
	File  FileOptions
	LVM   LVMOptions
	Ndctl NdctlOptions
}

// New makes the back end of mode.
func New(ctx context.Context, mode pmemv1.Mode, opts Options) (Backend, error) {
	switch mode {
	case pmemv1.ModeFile:
		return NewFile(opts.File)
	case pmemv1.ModeLVM:
		return NewLVM(ctx, opts.LVM)
	case pmemv1.ModeNdctl:
		return NewNdctl(opts.Ndctl)
	}
	return nil, fmt.Errorf("unknown PMEM mode %q", mode)
}
