package pmem

import (
	"context"
	"fmt"
	"os"
)

// BlockIO moves data on block devices for the lvm and ndctl back ends: copies for snapshots
// and clones, zeroes for new volumes, and the small records the ndctl back end keeps inside
// its namespaces. Every write is flushed to the device before the method returns.
type BlockIO interface {
	// Copy copies length bytes at offset of src to the same offset of dst.
	Copy(ctx context.Context, dst, src string, offset, length int64) error
	// Zero writes zeroes to length bytes of dev at offset.
	Zero(ctx context.Context, dev string, offset, length int64) error
	// ReadAt fills p from dev at offset.
	ReadAt(ctx context.Context, dev string, p []byte, offset int64) error
	// WriteAt writes p to dev at offset.
	WriteAt(ctx context.Context, dev string, p []byte, offset int64) error
}

// DeviceIO is BlockIO on the host's block devices, with plain reads and writes in chunks of
// 4 MiB: PMEM has no faster way to zero, and a chunk is the unit at which a cancelled context
// stops a long copy.
type DeviceIO struct{}

var _ BlockIO = DeviceIO{}

const ioChunk = 4 << 20

// Copy implements BlockIO.
func (DeviceIO) Copy(ctx context.Context, dst, src string, offset, length int64) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	return writeChunks(ctx, dst, offset, length, func(p []byte, off int64) error {
		_, err := in.ReadAt(p, off)
		if err != nil {
			return fmt.Errorf("read %s at %d: %w", src, off, err)
		}
		return nil
	})
}

// Zero implements BlockIO.
func (DeviceIO) Zero(ctx context.Context, dev string, offset, length int64) error {
	return writeChunks(ctx, dev, offset, length, func(p []byte, _ int64) error {
		clear(p)
		return nil
	})
}

// ReadAt implements BlockIO.
func (DeviceIO) ReadAt(_ context.Context, dev string, p []byte, offset int64) error {
	f, err := os.Open(dev)
	if err != nil {
		return err
	}
	defer f.Close()
	if _, err := f.ReadAt(p, offset); err != nil {
		return fmt.Errorf("read %s at %d: %w", dev, offset, err)
	}
	return nil
}

// WriteAt implements BlockIO.
func (DeviceIO) WriteAt(ctx context.Context, dev string, p []byte, offset int64) error {
	return writeChunks(ctx, dev, offset, int64(len(p)), func(chunk []byte, off int64) error {
		copy(chunk, p[off-offset:])
		return nil
	})
}

// writeChunks writes length bytes to dev at offset, each chunk filled by fill, then flushes dev.
func writeChunks(ctx context.Context, dev string, offset, length int64, fill func(p []byte, off int64) error) error {
	out, err := os.OpenFile(dev, os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	buf := make([]byte, min(length, ioChunk))
	for done := int64(0); done < length; {
		if err := ctx.Err(); err != nil {
			_ = out.Close()
			return err
		}
		p := buf[:min(length-done, int64(len(buf)))]
		if err := fill(p, offset+done); err != nil {
			_ = out.Close()
			return err
		}
		if _, err := out.WriteAt(p, offset+done); err != nil {
			_ = out.Close()
			return fmt.Errorf("write %s at %d: %w", dev, offset+done, err)
		}
		done += int64(len(p))
	}
	if err := out.Sync(); err != nil {
		_ = out.Close()
		return fmt.Errorf("flush %s: %w", dev, err)
	}
	return out.Close()
}
