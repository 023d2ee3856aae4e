package pmem

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"

	"golang.org/x/sys/unix"
)

// How cloneFile copied a file's data.
const (
	copyReflink = "reflink"
	copySparse  = "sparse"
)

// cloneFile fills the empty file dst with the first size bytes of src: a reflink (FICLONE)
// where the filesystem shares extents between files (xfs with reflink=1, btrfs), otherwise a
// copy of the data segments that leaves holes as holes. It returns how it copied. dst may be
// longer than size afterwards only by the reflink of a longer src; callers truncate it.
func cloneFile(ctx context.Context, dst, src *os.File, size int64) (string, error) {
	err := unix.IoctlFileClone(int(dst.Fd()), int(src.Fd()))
	if err == nil {
		return copyReflink, nil
	}
	if !reflinkUnsupported(err) {
		return "", fmt.Errorf("reflink: %w", err)
	}
	if err := dst.Truncate(0); err != nil {
		return "", err
	}
	return copySparse, sparseCopy(ctx, dst, src, size)
}

// reflinkUnsupported tells the errors of a filesystem (or a pair of files) that cannot share
// extents from errors of one that can.
func reflinkUnsupported(err error) bool {
	return errors.Is(err, unix.EOPNOTSUPP) || errors.Is(err, unix.ENOTTY) ||
		errors.Is(err, unix.EXDEV) || errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOSYS)
}

// sparseCopy copies the data segments of the first size bytes of src into dst, found with
// SEEK_DATA and SEEK_HOLE (a filesystem without them reports one segment, the whole file),
// and skips chunks of zeroes inside them too, so the copy allocates no more than the source.
func sparseCopy(ctx context.Context, dst, src *os.File, size int64) error {
	buf := make([]byte, 1<<20)
	for off := int64(0); off < size; {
		data, err := unix.Seek(int(src.Fd()), off, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) {
			break // only a hole is left
		}
		if err != nil {
			return fmt.Errorf("find data: %w", err)
		}
		hole, err := unix.Seek(int(src.Fd()), data, unix.SEEK_HOLE)
		if err != nil {
			return fmt.Errorf("find hole: %w", err)
		}
		hole = min(hole, size)
		for pos := data; pos < hole; {
			if err := ctx.Err(); err != nil {
				return err
			}
			p := buf[:min(hole-pos, int64(len(buf)))]
			if _, err := src.ReadAt(p, pos); err != nil && !errors.Is(err, io.EOF) {
				return err
			}
			if !allZero(p) {
				if _, err := dst.WriteAt(p, pos); err != nil {
					return err
				}
			}
			pos += int64(len(p))
		}
		off = hole
	}
	return nil
}

func allZero(p []byte) bool {
	for _, b := range p {
		if b != 0 {
			return false
		}
	}
	return true
}
