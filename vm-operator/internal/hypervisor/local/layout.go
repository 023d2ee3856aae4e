package local

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"golang.org/x/sys/unix"

	"pvbridge.io/vm-operator/internal/hypervisor"
)

// Paths inside a VM directory.
const (
	sysBlockDir = "sys/block"
	devDir      = "dev"
	byIDDir     = "dev/disk/by-id"
	stateDir    = ".hypervisor"
	recordsDir  = stateDir + "/disks"
	tmpDir      = stateDir + "/tmp"
	runningFile = stateDir + "/running"
	// seedDir is where cloud-init's NoCloud data source looks on the guest's own filesystem:
	// the VM directory is the guest's root, so the VM's node runs its bootstrap from there.
	seedDir = "var/lib/cloud/seed/nocloud"
)

// makeSkeleton creates the directories of a VM.
func makeSkeleton(r *os.Root) error {
	for _, dir := range []string{sysBlockDir, byIDDir, recordsDir, tmpDir} {
		if err := r.MkdirAll(dir, 0o755); err != nil {
			return err
		}
	}
	return nil
}

// record is what the driver remembers of a disk, in .hypervisor/disks/<serial>.json. The
// guest's view (sys/block, dev) is derived from it and rebuilt from it.
type record struct {
	// Serial is the disk's serial.
	Serial string `json:"serial"`
	// Name is the disk's name in the VM, vdX.
	Name string `json:"name"`
	// Device is the host block device as Attach was given it.
	Device string `json:"device"`
	// Major and Minor are the number of Device when it was attached.
	Major uint32 `json:"major"`
	Minor uint32 `json:"minor"`
	// Throttle is set for a disk attached with I/O limits, which the guest sees through a
	// qemu-storage-daemon (throttle.go); nil for a disk whose device the guest sees directly.
	Throttle *throttle `json:"throttle,omitempty"`
}

// throttle is what the record of a throttled disk adds. The daemon's files are not named here
// but found by the VM and the serial (daemonDir): the driver never acts on a host object
// that a file in the VM directory names.
type throttle struct {
	// IOPS and BytesPerSecond are the limits the daemon enforces; zero is no limit.
	IOPS           int64 `json:"iops"`
	BytesPerSecond int64 `json:"bytesPerSecond"`
	// LoopMajor and LoopMinor are the number of the loop device over the daemon's export, the
	// disk the guest sees; 0:0 until Attach made it.
	LoopMajor uint32 `json:"loopMajor"`
	LoopMinor uint32 `json:"loopMinor"`
}

func newRecord(serial, name, device string, dev uint64) record {
	return record{Serial: serial, Name: name, Device: device, Major: unix.Major(dev), Minor: unix.Minor(dev)}
}

// dev returns the number of the host device.
func (rec record) dev() uint64 { return unix.Mkdev(rec.Major, rec.Minor) }

// number returns the number of the host device as sysfs writes it, "major:minor".
func (rec record) number() string { return formatDev(rec.dev()) }

// guestDev returns the number of the device the guest sees: the host device's, or for a
// throttled disk that of the loop device over its daemon's export.
func (rec record) guestDev() uint64 {
	if rec.Throttle != nil {
		return unix.Mkdev(rec.Throttle.LoopMajor, rec.Throttle.LoopMinor)
	}
	return rec.dev()
}

// guestNumber returns guestDev as sysfs writes it.
func (rec record) guestNumber() string { return formatDev(rec.guestDev()) }

// limits returns the disk's limits; nil for a disk attached without.
func (rec record) limits() *hypervisor.Limits {
	if rec.Throttle == nil {
		return nil
	}
	return &hypervisor.Limits{IOPS: rec.Throttle.IOPS, BytesPerSecond: rec.Throttle.BytesPerSecond}
}

// formatDev writes a device number as sysfs does, "major:minor".
func formatDev(dev uint64) string { return fmt.Sprintf("%d:%d", unix.Major(dev), unix.Minor(dev)) }

func (rec record) node() string    { return filepath.Join(devDir, rec.Name) }
func (rec record) sysDir() string  { return filepath.Join(sysBlockDir, rec.Name) }
func (rec record) link() string    { return filepath.Join(byIDDir, "virtio-"+rec.Serial) }
func (rec record) recFile() string { return recordFile(rec.Serial) }

func recordFile(serial string) string { return filepath.Join(recordsDir, serial+".json") }

// readRecord returns the record of serial, and false if there is none.
func readRecord(r *os.Root, serial string) (record, bool, error) {
	data, err := r.ReadFile(recordFile(serial))
	if errors.Is(err, fs.ErrNotExist) {
		return record{}, false, nil
	}
	if err != nil {
		return record{}, false, fmt.Errorf("read disk record: %w", err)
	}
	rec, err := parseRecord(serial, data)
	if err != nil {
		return record{}, false, err
	}
	return rec, true, nil
}

// readRecords returns the records of all disks of a VM in the order of their names.
func readRecords(r *os.Root) ([]record, error) {
	entries, err := fs.ReadDir(r.FS(), recordsDir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("list disk records: %w", err)
	}
	var records []record
	for _, e := range entries {
		serial, ok := strings.CutSuffix(e.Name(), ".json")
		if !ok {
			continue
		}
		rec, found, err := readRecord(r, serial)
		if err != nil {
			return nil, err
		}
		if found {
			records = append(records, rec)
		}
	}
	slices.SortFunc(records, func(a, b record) int { return compareNames(a.Name, b.Name) })
	return records, nil
}

// parseRecord parses the record stored for serial. A record names paths that the driver
// creates and removes, so one that does not hold a valid serial and disk name is refused.
func parseRecord(serial string, data []byte) (record, error) {
	var rec record
	if err := json.Unmarshal(data, &rec); err != nil {
		return record{}, fmt.Errorf("parse disk record %s: %w", serial, err)
	}
	if rec.Serial != serial || validateSerial(serial) != nil || !isDiskName(rec.Name) {
		return record{}, fmt.Errorf("disk record %s is corrupt: %s", serial, data)
	}
	return rec, nil
}

// writeRecord stores rec.
func writeRecord(r *os.Root, rec record) error {
	data, err := json.Marshal(rec)
	if err != nil {
		return err
	}
	if err := writeFile(r, rec.recFile(), append(data, '\n')); err != nil {
		return fmt.Errorf("write disk record: %w", err)
	}
	return nil
}

// writeFile replaces the file name with data atomically: a reader sees the old content or the
// new one, never a part. The caller holds the VM's lock, which makes the temporary name unique.
func writeFile(r *os.Root, name string, data []byte) error {
	return writeFileMode(r, name, data, 0o644)
}

// writeFileMode is writeFile with the file's mode: 0o600 for a file only root may read
// (bootstrap data).
func writeFileMode(r *os.Root, name string, data []byte, mode os.FileMode) error {
	if err := r.MkdirAll(tmpDir, 0o755); err != nil {
		return err
	}
	tmp := filepath.Join(tmpDir, strings.ReplaceAll(name, "/", "_"))
	if err := r.WriteFile(tmp, data, mode); err != nil {
		return err
	}
	// WriteFile keeps the mode of a file left over from an interrupted write.
	if err := r.Chmod(tmp, mode); err != nil {
		return err
	}
	return r.Rename(tmp, name)
}

// writeSeed writes the VM's NoCloud seed: user-data and meta-data, readable by root only.
func writeSeed(r *os.Root, b *hypervisor.Bootstrap) error {
	if err := r.MkdirAll(seedDir, 0o700); err != nil {
		return err
	}
	if err := writeFileMode(r, seedDir+"/meta-data", b.MetaData, 0o600); err != nil {
		return err
	}
	return writeFileMode(r, seedDir+"/user-data", b.UserData, 0o600)
}

// removeIfExists removes the file or empty directory name; a missing one is success.
func removeIfExists(r *os.Root, name string) error {
	if err := r.Remove(name); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	return nil
}

// diskName returns the name of the disk with index i as the kernel's virtio_blk makes it:
// vda … vdz, vdaa … vdzz, vdaaa …
func diskName(i int) string {
	var b []byte
	for {
		b = append(b, byte('a'+i%26))
		i = i/26 - 1
		if i < 0 {
			break
		}
	}
	slices.Reverse(b)
	return "vd" + string(b)
}

// isDiskName reports whether name has the form of a virtio disk name.
func isDiskName(name string) bool {
	suffix, ok := strings.CutPrefix(name, "vd")
	if !ok || suffix == "" {
		return false
	}
	for _, c := range []byte(suffix) {
		if c < 'a' || c > 'z' {
			return false
		}
	}
	return true
}

// compareNames orders disk names by index: vdz before vdaa.
func compareNames(a, b string) int {
	if len(a) != len(b) {
		return len(a) - len(b)
	}
	return strings.Compare(a, b)
}

// lowestFreeName returns the first disk name not in use in the VM: neither recorded nor present
// in its sys/block or dev directory, whoever made it.
func lowestFreeName(r *os.Root, records []record) (string, error) {
	used := make(map[string]bool)
	for _, rec := range records {
		used[rec.Name] = true
	}
	for _, dir := range []string{sysBlockDir, devDir} {
		entries, err := fs.ReadDir(r.FS(), dir)
		if err != nil && !errors.Is(err, fs.ErrNotExist) {
			return "", fmt.Errorf("list disk names: %w", err)
		}
		for _, e := range entries {
			used[e.Name()] = true
		}
	}
	for i := 0; ; i++ {
		if name := diskName(i); !used[name] {
			return name, nil
		}
	}
}
