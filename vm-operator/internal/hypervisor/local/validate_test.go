package local

import (
	"errors"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	. "github.com/onsi/gomega"

	"pvbridge.io/vm-operator/internal/hypervisor"
)

func TestInvalidArgumentsAreRefused(t *testing.T) {
	e := newEnv(t)
	vm := e.runningVM(t, "node-1")
	device, _ := e.loop(t, 16*mib)
	regular := e.path("regular")
	NewWithT(t).Expect(os.WriteFile(regular, nil, 0o644)).To(Succeed())

	// Every call of the driver, with the VM, serial and device of a case.
	calls := map[string]func(vm hypervisor.VM, serial, device string) error{
		"PowerOn":  func(vm hypervisor.VM, _, _ string) error { return e.d.PowerOn(t.Context(), vm) },
		"PowerOff": func(vm hypervisor.VM, _, _ string) error { return e.d.PowerOff(t.Context(), vm) },
		"Running": func(vm hypervisor.VM, _, _ string) error {
			_, err := e.d.Running(t.Context(), vm)
			return err
		},
		"Disks": func(vm hypervisor.VM, _, _ string) error {
			_, err := e.d.Disks(t.Context(), vm)
			return err
		},
		"Attach": func(vm hypervisor.VM, serial, device string) error {
			return e.d.Attach(t.Context(), vm, hypervisor.Disk{Serial: serial, Device: device})
		},
		"Detach": func(vm hypervisor.VM, serial, _ string) error { return e.d.Detach(t.Context(), vm, serial) },
	}
	vmCalls := []string{"PowerOn", "PowerOff", "Running", "Disks", "Attach", "Detach"}

	tests := []struct {
		name           string
		vm             hypervisor.VM
		serial, device string
		calls          []string
	}{
		{name: "namespace ..", vm: hypervisor.VM{Namespace: "..", Name: "node-1"}, serial: "disk-1", device: device, calls: vmCalls},
		{name: "namespace with a separator", vm: hypervisor.VM{Namespace: "../outside", Name: "node-1"}, serial: "disk-1", device: device, calls: vmCalls},
		{name: "empty namespace", vm: hypervisor.VM{Name: "node-1"}, serial: "disk-1", device: device, calls: vmCalls},
		{name: "namespace with a dot", vm: hypervisor.VM{Namespace: "a.b", Name: "node-1"}, serial: "disk-1", device: device, calls: vmCalls},
		{name: "name ..", vm: hypervisor.VM{Namespace: "tenant-a", Name: ".."}, serial: "disk-1", device: device, calls: vmCalls},
		{name: "name .", vm: hypervisor.VM{Namespace: "tenant-a", Name: "."}, serial: "disk-1", device: device, calls: vmCalls},
		{name: "name climbing out", vm: hypervisor.VM{Namespace: "tenant-a", Name: "../../outside"}, serial: "disk-1", device: device, calls: vmCalls},
		{name: "name with a separator", vm: hypervisor.VM{Namespace: "tenant-a", Name: "node-1/sys"}, serial: "disk-1", device: device, calls: vmCalls},
		{name: "upper-case name", vm: hypervisor.VM{Namespace: "tenant-a", Name: "Node-1"}, serial: "disk-1", device: device, calls: vmCalls},
		{name: "name too long", vm: hypervisor.VM{Namespace: "tenant-a", Name: strings.Repeat("a", 254)}, serial: "disk-1", device: device, calls: vmCalls},
		{name: "serial climbing out", vm: vm, serial: "../../../outside", device: device, calls: []string{"Attach", "Detach"}},
		{name: "serial with a separator", vm: vm, serial: "a/b", device: device, calls: []string{"Attach", "Detach"}},
		{name: "serial ..", vm: vm, serial: "..", device: device, calls: []string{"Attach", "Detach"}},
		{name: "empty serial", vm: vm, serial: "", device: device, calls: []string{"Attach", "Detach"}},
		{name: "serial too long for virtio", vm: vm, serial: strings.Repeat("a", 21), device: device, calls: []string{"Attach", "Detach"}},
		{name: "serial with a space", vm: vm, serial: "a b", device: device, calls: []string{"Attach", "Detach"}},
		{name: "serial with a non-ASCII letter", vm: vm, serial: "dïsk", device: device, calls: []string{"Attach", "Detach"}},
		{name: "relative device", vm: vm, serial: "disk-1", device: strings.TrimPrefix(device, "/"), calls: []string{"Attach"}},
		{name: "missing device", vm: vm, serial: "disk-1", device: "/dev/pvbridge-none", calls: []string{"Attach"}},
		{name: "character device", vm: vm, serial: "disk-1", device: "/dev/null", calls: []string{"Attach"}},
		{name: "regular file", vm: vm, serial: "disk-1", device: regular, calls: []string{"Attach"}},
	}
	for _, tt := range tests {
		for _, call := range tt.calls {
			t.Run(tt.name+"/"+call, func(t *testing.T) {
				g := NewWithT(t)
				g.Expect(calls[call](tt.vm, tt.serial, tt.device)).To(MatchError(errInvalid))

				g.Expect(os.ReadDir(e.dir)).To(HaveLen(3), "nothing but the root, the backing file and the regular file")
				g.Expect(os.ReadDir(e.root)).To(HaveLen(1), "nothing but the namespace of the VM")
				g.Expect(guestDisks(t, e.vmDir(vm))).To(BeEmpty())
			})
		}
	}
}

func TestASymlinkPlantedInTheVMCannotLeadOutside(t *testing.T) {
	g := NewWithT(t)
	e := newEnv(t)
	vm := e.runningVM(t, "node-1")
	device, _ := e.loop(t, 16*mib)
	outside := e.path("outside")
	g.Expect(os.Mkdir(outside, 0o755)).To(Succeed())
	byID := filepath.Join(e.vmDir(vm), "dev/disk/by-id")
	g.Expect(os.Remove(byID)).To(Succeed())
	g.Expect(os.Symlink(outside, byID)).To(Succeed())

	g.Expect(e.d.Attach(t.Context(), vm, hypervisor.Disk{Serial: "disk-1", Device: device})).NotTo(Succeed())

	g.Expect(os.ReadDir(outside)).To(BeEmpty())
}

// validSerial is the rule validateSerial implements, as a regular expression.
var validSerial = regexp.MustCompile(`^[A-Za-z0-9_-]{1,20}$`)

func FuzzValidateSerial(f *testing.F) {
	for _, s := range []string{"", "a", "pvb-0123456789abcdef", "pvb-0123456789abcdefg", "../x", "a/b", ".", "..",
		"a b", "dïsk", "a\x00b", "a\n", strings.Repeat("_", 20), "virtio-x"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, serial string) {
		err := validateSerial(serial)
		if validSerial.MatchString(serial) != (err == nil) {
			t.Fatalf("validateSerial(%q) = %v, disagreeing with %s", serial, err, validSerial)
		}
		if err != nil {
			if !errors.Is(err, errInvalid) {
				t.Fatalf("validateSerial(%q) = %v, not an invalid argument", serial, err)
			}
			return
		}
		// A valid serial names one file in the directory it is joined to.
		for _, name := range []string{"virtio-" + serial, serial + ".json"} {
			if !filepath.IsLocal(name) || filepath.Base(name) != name {
				t.Fatalf("serial %q makes the file name %q leave its directory", serial, name)
			}
		}
	})
}

func FuzzValidateVM(f *testing.F) {
	for _, s := range [][2]string{
		{"tenant-a", "node-1"}, {"tenant-a", "node-1.example.com"}, {"..", "x"}, {"x", ".."}, {"x", "."},
		{"a/b", "c"}, {"a", "b/../../c"}, {"", ""}, {"a.b", "c"}, {"A", "b"}, {"a", "-b"}, {"a", "b\x00"},
	} {
		f.Add(s[0], s[1])
	}
	root := "/vms"
	f.Fuzz(func(t *testing.T, namespace, name string) {
		err := validateVM(hypervisor.VM{Namespace: namespace, Name: name})
		if err != nil {
			if !errors.Is(err, errInvalid) {
				t.Fatalf("validateVM(%q, %q) = %v, not an invalid argument", namespace, name, err)
			}
			return
		}
		// A valid VM has a directory exactly two levels below the root.
		rel := filepath.Join(namespace, name)
		dir := filepath.Join(root, rel)
		if !filepath.IsLocal(rel) || filepath.Dir(filepath.Dir(dir)) != root || dir != root+"/"+namespace+"/"+name {
			t.Fatalf("VM %q/%q has the directory %q, not two levels below %s", namespace, name, dir, root)
		}
	})
}
