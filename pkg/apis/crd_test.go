// Package apis_test checks the generated CRDs with the apiserver's own code: the CRD validation
// kube-apiserver runs on create (structural schema, CEL compilation and cost), and the
// defaulting, schema, list-map and CEL validation it runs on every custom resource write.
package apis_test

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	. "github.com/onsi/gomega"
	"k8s.io/apiextensions-apiserver/pkg/apis/apiextensions"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	crdvalidation "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/validation"
	structuralschema "k8s.io/apiextensions-apiserver/pkg/apiserver/schema"
	"k8s.io/apiextensions-apiserver/pkg/apiserver/schema/cel"
	"k8s.io/apiextensions-apiserver/pkg/apiserver/schema/defaulting"
	"k8s.io/apiextensions-apiserver/pkg/apiserver/schema/listtype"
	crvalidation "k8s.io/apiextensions-apiserver/pkg/apiserver/validation"
	utiljson "k8s.io/apimachinery/pkg/util/json"
	celconfig "k8s.io/apiserver/pkg/apis/cel"
	"sigs.k8s.io/yaml"
)

const crdDir = "../../manifests/crd/bases"

func readCRD(t *testing.T, file string) *apiextensionsv1.CustomResourceDefinition {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(crdDir, file))
	if err != nil {
		t.Fatalf("read CRD (run the CRD generation first): %v", err)
	}
	crd := &apiextensionsv1.CustomResourceDefinition{}
	if err := yaml.UnmarshalStrict(data, crd); err != nil {
		t.Fatalf("parse %s: %v", file, err)
	}
	return crd
}

func toInternal(t *testing.T, crd *apiextensionsv1.CustomResourceDefinition) *apiextensions.CustomResourceDefinition {
	t.Helper()
	internal := &apiextensions.CustomResourceDefinition{}
	if err := apiextensionsv1.Convert_v1_CustomResourceDefinition_To_apiextensions_CustomResourceDefinition(crd, internal, nil); err != nil {
		t.Fatalf("convert %s: %v", crd.Name, err)
	}
	return internal
}

func TestCRDsAreAcceptedByTheAPIServer(t *testing.T) {
	tests := []struct {
		file       string
		kind       string
		scope      apiextensionsv1.ResourceScope
		shortNames []string
		columns    []string
		selectable []string
		noStatus   bool // a kind without a status subresource
	}{
		{
			file: "vm.pvbridge.io_virtualmachines.yaml", kind: "VirtualMachine", scope: apiextensionsv1.NamespaceScoped,
			shortNames: []string{"vm"}, columns: []string{"Host", "Power", "Phase", "Age"},
			selectable: []string{".status.host"},
		},
		{
			file: "vm.pvbridge.io_virtualmachineclasses.yaml", kind: "VirtualMachineClass", scope: apiextensionsv1.ClusterScoped,
			shortNames: []string{"vmclass"}, columns: []string{"CPUs", "Memory", "Volumes", "Age"}, noStatus: true,
		},
		{
			file: "pmem.pvbridge.io_pmemvolumes.yaml", kind: "PmemVolume", scope: apiextensionsv1.ClusterScoped,
			shortNames: []string{"pmv"}, columns: []string{"Node", "Replicas", "Size", "Device", "Ready", "Reason", "Allocated", "Degraded", "Target", "Age"},
			selectable: []string{".spec.node"},
		},
		{
			file: "pmem.pvbridge.io_pmemreplicas.yaml", kind: "PmemReplica", scope: apiextensionsv1.ClusterScoped,
			shortNames: []string{"pmr"}, columns: []string{"Volume", "Node", "Size", "Ready", "Reason", "Device", "Address", "Age"},
			selectable: []string{".spec.node", ".spec.volumeID"},
		},
		{
			file: "pmem.pvbridge.io_pmemsnapshots.yaml", kind: "PmemSnapshot", scope: apiextensionsv1.ClusterScoped,
			shortNames: []string{"pms"}, columns: []string{"Node", "Source", "Group", "Size", "Ready", "Age"},
			selectable: []string{".spec.node"},
		},
		{
			file: "pmem.pvbridge.io_pmemnodes.yaml", kind: "PmemNode", scope: apiextensionsv1.ClusterScoped,
			shortNames: []string{"pmn"}, columns: []string{"Mode", "Total", "Free", "Largest", "Ready", "Age"},
		},
	}
	// controller-gen names every CRD file <group>_<plural>.yaml; the rest (the kustomization)
	// is not a CRD.
	files, err := filepath.Glob(filepath.Join(crdDir, "*_*.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if len(files) != len(tests) {
		t.Errorf("%s holds %d CRDs, the test knows %d", crdDir, len(files), len(tests))
	}
	for _, tt := range tests {
		t.Run(tt.kind, func(t *testing.T) {
			g := NewWithT(t)
			crd := readCRD(t, tt.file)
			// kube-apiserver records the stored version before it validates a new CRD.
			crd.Status.StoredVersions = []string{crd.Spec.Versions[0].Name}
			g.Expect(crdvalidation.ValidateCustomResourceDefinition(t.Context(), toInternal(t, crd))).To(BeEmpty())

			g.Expect(crd.Spec.Names.Kind).To(Equal(tt.kind))
			g.Expect(crd.Spec.Scope).To(Equal(tt.scope))
			g.Expect(crd.Spec.Names.ShortNames).To(Equal(tt.shortNames))
			g.Expect(crd.Spec.Names.Categories).To(ConsistOf("pvbridge"))
			g.Expect(crd.Spec.Versions).To(HaveLen(1))
			v := crd.Spec.Versions[0]
			if tt.noStatus {
				g.Expect(v.Subresources == nil || v.Subresources.Status == nil).To(BeTrue(), "no status subresource")
			} else {
				g.Expect(v.Subresources.Status).NotTo(BeNil())
			}
			var columns []string
			for _, c := range v.AdditionalPrinterColumns {
				columns = append(columns, c.Name)
			}
			g.Expect(columns).To(Equal(tt.columns))
			var selectable []string
			for _, f := range v.SelectableFields {
				selectable = append(selectable, f.JSONPath)
			}
			g.Expect(selectable).To(Equal(tt.selectable))
		})
	}
}

// validator applies what kube-apiserver applies to a custom resource write.
type validator struct {
	structural *structuralschema.Structural
	schema     crvalidation.SchemaValidator
	cel        *cel.Validator
}

func newValidator(t *testing.T, file string) *validator {
	t.Helper()
	props := &apiextensions.JSONSchemaProps{}
	v1Props := readCRD(t, file).Spec.Versions[0].Schema.OpenAPIV3Schema
	if err := apiextensionsv1.Convert_v1_JSONSchemaProps_To_apiextensions_JSONSchemaProps(v1Props, props, nil); err != nil {
		t.Fatal(err)
	}
	structural, err := structuralschema.NewStructural(props)
	if err != nil {
		t.Fatal(err)
	}
	schema, _, err := crvalidation.NewSchemaValidator(props)
	if err != nil {
		t.Fatal(err)
	}
	return &validator{
		structural: structural,
		schema:     schema,
		cel:        cel.NewValidator(structural, true, celconfig.PerCallLimit),
	}
}

// write defaults and validates obj, an update of old when old is not empty, and returns the
// object as stored and the errors.
func (v *validator) write(t *testing.T, obj, old string) (map[string]any, []string) {
	t.Helper()
	newObj := decode(t, obj)
	defaulting.Default(newObj, v.structural)
	errs := crvalidation.ValidateCustomResource(nil, newObj, v.schema)
	errs = append(errs, listtype.ValidateListSetsAndMaps(nil, v.structural, newObj)...)
	var oldObj map[string]any
	if old != "" {
		oldObj = decode(t, old)
		defaulting.Default(oldObj, v.structural)
	}
	celErrs, _ := v.cel.Validate(t.Context(), nil, v.structural, newObj, oldObj, celconfig.RuntimeCELCostBudget)
	errs = append(errs, celErrs...)

	var msgs []string
	for _, err := range errs {
		msgs = append(msgs, err.Error())
	}
	return newObj, msgs
}

func decode(t *testing.T, y string) map[string]any {
	t.Helper()
	j, err := yaml.YAMLToJSON([]byte(y))
	if err != nil {
		t.Fatal(err)
	}
	obj := map[string]any{}
	// utiljson decodes numbers as int64 where they fit, like the apiserver.
	if err := utiljson.Unmarshal(j, &obj); err != nil {
		t.Fatal(err)
	}
	return obj
}

// validationCase is one write: obj, as an update of old when old is set. wantErr is a substring
// of the only error expected; empty means the write is valid.
type validationCase struct {
	name    string
	old     string
	obj     string
	wantErr string
}

func runValidationCases(t *testing.T, file string, tests []validationCase) {
	v := newValidator(t, file)
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			_, errs := v.write(t, tt.obj, tt.old)
			if tt.wantErr == "" {
				g.Expect(errs).To(BeEmpty())
				return
			}
			g.Expect(errs).To(ConsistOf(ContainSubstring(tt.wantErr)))
		})
	}
}

func vm(spec string) string {
	return "apiVersion: vm.pvbridge.io/v1alpha1\nkind: VirtualMachine\nmetadata: {name: node-1, namespace: tenant-a}\nspec:\n" + indent(spec)
}

func vmStatus(status string) string {
	return vm("{}") + "status:\n" + indent(status)
}

func indent(s string) string {
	return "  " + strings.ReplaceAll(strings.TrimSpace(s), "\n", "\n  ") + "\n"
}

func volumes(names ...string) string {
	s := "volumes:\n"
	for _, n := range names {
		s += fmt.Sprintf("- {name: %s, persistentVolumeClaim: {claimName: %s}}\n", n, n)
	}
	return s
}

// mgmtPVC is the name of a management PVC: <cluster UID>-<guest PV UID>.
const mgmtPVC = "6f1d3c1e-3f0a-4b9e-9a7e-0d6c2b1f8a11-0b8e7a52-1c3d-4e5f-8a9b-c0d1e2f3a4b5"

func TestVirtualMachineDefaultsPowerStateToPoweredOn(t *testing.T) {
	g := NewWithT(t)
	v := newValidator(t, "vm.pvbridge.io_virtualmachines.yaml")
	obj, errs := v.write(t, vm("{}"), "")
	g.Expect(errs).To(BeEmpty())
	g.Expect(obj["spec"]).To(HaveKeyWithValue("powerState", "PoweredOn"))
}

func TestVirtualMachineValidation(t *testing.T) {
	many := make([]string, 65)
	for i := range many {
		many[i] = fmt.Sprintf("vol-%d", i)
	}
	runValidationCases(t, "vm.pvbridge.io_virtualmachines.yaml", []validationCase{
		{name: "volume named after a management PVC", obj: vm(volumes(mgmtPVC))},
		{name: "volume name that is not a DNS subdomain", obj: vm("volumes: [{name: Vol_1, persistentVolumeClaim: {claimName: a}}]"), wantErr: "spec.volumes[0].name"},
		{name: "volume name longer than 253", obj: vm("volumes: [{name: " + strings.Repeat("a", 254) + ", persistentVolumeClaim: {claimName: a}}]"), wantErr: "spec.volumes[0].name: Too long"},
		{name: "claim name that is not a DNS subdomain", obj: vm("volumes: [{name: a, persistentVolumeClaim: {claimName: Claim_1}}]"), wantErr: "spec.volumes[0].persistentVolumeClaim.claimName"},
		{name: "duplicate volume names", obj: vm(volumes("a", "a")), wantErr: "Duplicate value"},
		{name: "more than 64 volumes", obj: vm(volumes(many...)), wantErr: "spec.volumes: Too many"},
		{name: "volume without a claim", obj: vm("volumes: [{name: a}]"), wantErr: "spec.volumes[0].persistentVolumeClaim: Required value"},
		{name: "powered off", obj: vm("powerState: PoweredOff")},
		{name: "unknown power state", obj: vm("powerState: Paused"), wantErr: "spec.powerState: Unsupported value"},
		{name: "host is set later", old: vm("{}"), obj: vm("host: host-a")},
		{name: "host changes", old: vm("host: host-a"), obj: vm("host: host-b"), wantErr: "host is immutable once set"},
		{name: "host is removed", old: vm("host: host-a"), obj: vm("{}"), wantErr: "host cannot be removed once set"},
		{name: "image named by its Kubernetes version", obj: vm("image: node-v1.37.2")},
		{name: "image named by a path", obj: vm("image: ../node-v1.37.2"), wantErr: "spec.image: Invalid value"},
		{name: "image with capitals", obj: vm("image: Node"), wantErr: "spec.image: Invalid value"},
		{name: "image changes", old: vm("image: node-v1.37.2"), obj: vm("image: node-v1.38.0"), wantErr: "image is immutable once set"},
		{name: "image is removed", old: vm("image: node-v1.37.2"), obj: vm("{}"), wantErr: "image cannot be removed once set"},
		{name: "volume is added and another removed", old: vm(volumes("a")), obj: vm(volumes("b"))},
		{
			name:    "claim of a volume changes",
			old:     vm(volumes("a")),
			obj:     vm("volumes: [{name: a, persistentVolumeClaim: {claimName: b}}]"),
			wantErr: "claimName is immutable",
		},
		{name: "attached volume with a 20-character serial", obj: vmStatus("volumes: [{name: a, attached: true, diskSerial: 0123456789abcdefghij}]")},
		{name: "serial longer than 20 characters", obj: vmStatus("volumes: [{name: a, diskSerial: 0123456789abcdefghijk}]"), wantErr: "status.volumes[0].diskSerial: Too long"},
		{name: "serial with a space", obj: vmStatus("volumes: [{name: a, diskSerial: 'a b'}]"), wantErr: "status.volumes[0].diskSerial"},
		{name: "duplicate volume status", obj: vmStatus("volumes: [{name: a}, {name: a}]"), wantErr: "Duplicate value"},
		{name: "unknown phase", obj: vmStatus("phase: Paused"), wantErr: "status.phase: Unsupported value"},
	})
}

func pmemVolume(name, spec string) string {
	return "apiVersion: pmem.pvbridge.io/v1alpha1\nkind: PmemVolume\nmetadata: {name: " + name + "}\nspec:\n" + indent(spec)
}

func TestVirtualMachineClassValidation(t *testing.T) {
	class := func(spec string) string {
		return "apiVersion: vm.pvbridge.io/v1alpha1\nkind: VirtualMachineClass\nmetadata: {name: small}\nspec:\n" + indent(spec)
	}
	runValidationCases(t, "vm.pvbridge.io_virtualmachineclasses.yaml", []validationCase{
		{name: "a size", obj: class("{cpus: 2, memory: 2Gi}")},
		{name: "with hot-plug slots", obj: class("{cpus: 2, memory: 2Gi, maxVolumes: 16}")},
		{name: "no CPU", obj: class("{cpus: 0, memory: 2Gi}"), wantErr: "spec.cpus"},
		{name: "more than 64 CPUs", obj: class("{cpus: 65, memory: 2Gi}"), wantErr: "spec.cpus"},
		{name: "less memory than a guest boots with", obj: class("{cpus: 1, memory: 32Mi}"), wantErr: "memory must be at least 64Mi"},
		{name: "without memory", obj: class("{cpus: 1}"), wantErr: "spec.memory: Required value"},
		{name: "more than 64 slots", obj: class("{cpus: 1, memory: 1Gi, maxVolumes: 65}"), wantErr: "spec.maxVolumes"},
	})
}

func TestPmemVolumeValidation(t *testing.T) {
	const base = "node: host-a\nvolumeID: pvc-1\nsize: 1Gi"
	vol := func(extra string) string { return pmemVolume("pvc-1", base+"\n"+extra) }
	runValidationCases(t, "pmem.pvbridge.io_pmemvolumes.yaml", []validationCase{
		{name: "new volume", obj: vol("")},
		{name: "size in bytes", obj: pmemVolume("pvc-1", "node: host-a\nvolumeID: pvc-1\nsize: 1073741824")},
		{name: "name differs from volumeID", obj: pmemVolume("pvc-2", base), wantErr: "metadata.name must equal spec.volumeID"},
		{name: "volumeID too long for the device", obj: pmemVolume(strings.Repeat("a", 64), "node: host-a\nsize: 1Gi\nvolumeID: "+strings.Repeat("a", 64)), wantErr: "spec.volumeID: Too long"},
		{name: "volumeID with characters a device name cannot carry", obj: pmemVolume("PVC_1", "node: host-a\nsize: 1Gi\nvolumeID: PVC_1"), wantErr: "spec.volumeID"},
		{name: "zero size", obj: pmemVolume("pvc-1", "node: host-a\nvolumeID: pvc-1\nsize: '0'"), wantErr: "size must be positive"},
		{name: "negative size", obj: pmemVolume("pvc-1", "node: host-a\nvolumeID: pvc-1\nsize: -1Gi"), wantErr: "size must be positive"},
		{name: "size grows", old: vol(""), obj: pmemVolume("pvc-1", "node: host-a\nvolumeID: pvc-1\nsize: 2Gi")},
		{name: "size grows from bytes to a suffix", old: pmemVolume("pvc-1", "node: host-a\nvolumeID: pvc-1\nsize: 1073741824"), obj: pmemVolume("pvc-1", "node: host-a\nvolumeID: pvc-1\nsize: 2Gi")},
		{name: "size shrinks", old: vol(""), obj: pmemVolume("pvc-1", "node: host-a\nvolumeID: pvc-1\nsize: 512Mi"), wantErr: "size cannot shrink"},
		{name: "node changes", old: vol(""), obj: pmemVolume("pvc-1", "node: host-b\nvolumeID: pvc-1\nsize: 1Gi"), wantErr: "node is immutable"},
		{name: "restored from a snapshot", obj: vol("source: {snapshotID: snap-1}")},
		{name: "cloned from a volume", obj: vol("source: {volumeID: pvc-0}")},
		{name: "source names both a snapshot and a volume", obj: vol("source: {snapshotID: snap-1, volumeID: pvc-0}"), wantErr: "exactly one of snapshotID and volumeID"},
		{name: "source names nothing", obj: vol("source: {}"), wantErr: "exactly one of snapshotID and volumeID"},
		{name: "cloned from a replica of a replicated volume", obj: vol("source: {volumeID: pvc-0, sourceReplica: pvc-0-r1}")},
		{name: "a replica of a snapshot", obj: vol("source: {snapshotID: snap-1, sourceReplica: pvc-0-r1}"), wantErr: "sourceReplica is the replica of the volume to clone"},
		{name: "source changes", old: vol("source: {snapshotID: snap-1}"), obj: vol("source: {snapshotID: snap-2}"), wantErr: "source is immutable"},
		{name: "source added after creation", old: vol(""), obj: vol("source: {snapshotID: snap-1}"), wantErr: "source is immutable"},
		{name: "source removed", old: vol("source: {snapshotID: snap-1}"), obj: vol(""), wantErr: "source is immutable"},
		{name: "one replica, said", obj: vol("replicas: 1")},
		{name: "replicated, without a node", obj: pmemVolume("pvc-1", "volumeID: pvc-1\nsize: 1Gi\nreplicas: 3")},
		{name: "replicated with a node", obj: vol("replicas: 2"), wantErr: "a volume of one replica has a node"},
		{name: "neither a node nor replicas", obj: pmemVolume("pvc-1", "volumeID: pvc-1\nsize: 1Gi"), wantErr: "a volume of one replica has a node"},
		{name: "more than 3 replicas", obj: pmemVolume("pvc-1", "volumeID: pvc-1\nsize: 1Gi\nreplicas: 4"), wantErr: "spec.replicas"},
		{
			name: "replicas change", old: pmemVolume("pvc-1", "volumeID: pvc-1\nsize: 1Gi\nreplicas: 2"),
			obj: pmemVolume("pvc-1", "volumeID: pvc-1\nsize: 1Gi\nreplicas: 3"), wantErr: "replicas is immutable",
		},
	})
}

func TestPmemVolumeDefaultsToOneReplica(t *testing.T) {
	g := NewWithT(t)
	obj, errs := newValidator(t, "pmem.pvbridge.io_pmemvolumes.yaml").write(t, pmemVolume("pvc-1", "node: host-a\nvolumeID: pvc-1\nsize: 1Gi"), "")
	g.Expect(errs).To(BeEmpty())
	g.Expect(obj["spec"]).To(HaveKeyWithValue("replicas", int64(1)))
}

func TestPmemReplicaValidation(t *testing.T) {
	replica := func(spec string) string {
		return "apiVersion: pmem.pvbridge.io/v1alpha1\nkind: PmemReplica\nmetadata: {name: pvc-1-r0}\nspec:\n" + indent(spec)
	}
	const spec = "volumeID: pvc-1\nnode: host-a\nsize: 1Gi"
	runValidationCases(t, "pmem.pvbridge.io_pmemreplicas.yaml", []validationCase{
		{name: "new replica", obj: replica(spec)},
		{name: "without a volume", obj: replica("node: host-a\nsize: 1Gi"), wantErr: "spec.volumeID: Required value"},
		{name: "without a node", obj: replica("volumeID: pvc-1\nsize: 1Gi"), wantErr: "spec.node: Required value"},
		{name: "size grows", old: replica(spec), obj: replica("volumeID: pvc-1\nnode: host-a\nsize: 2Gi")},
		{name: "size shrinks", old: replica(spec), obj: replica("volumeID: pvc-1\nnode: host-a\nsize: 512Mi"), wantErr: "size cannot shrink"},
		{name: "node changes", old: replica(spec), obj: replica("volumeID: pvc-1\nnode: host-b\nsize: 1Gi"), wantErr: "node is immutable"},
		{name: "volume changes", old: replica(spec), obj: replica("volumeID: pvc-2\nnode: host-a\nsize: 1Gi"), wantErr: "volumeID is immutable"},
	})
}

func pmemSnapshot(name, spec string) string {
	return "apiVersion: pmem.pvbridge.io/v1alpha1\nkind: PmemSnapshot\nmetadata: {name: " + name + "}\nspec:\n" + indent(spec)
}

func TestPmemSnapshotValidation(t *testing.T) {
	const spec = "node: host-a\nsnapshotID: snap-1\nsourceVolumeID: pvc-1"
	runValidationCases(t, "pmem.pvbridge.io_pmemsnapshots.yaml", []validationCase{
		{name: "new snapshot", obj: pmemSnapshot("snap-1", spec)},
		{name: "name differs from snapshotID", obj: pmemSnapshot("snap-2", spec), wantErr: "metadata.name must equal spec.snapshotID"},
		{name: "missing source", obj: pmemSnapshot("snap-1", "node: host-a\nsnapshotID: snap-1"), wantErr: "spec.sourceVolumeID: Required value"},
		{
			name:    "spec changes",
			old:     pmemSnapshot("snap-1", spec),
			obj:     pmemSnapshot("snap-1", "node: host-a\nsnapshotID: snap-1\nsourceVolumeID: pvc-2"),
			wantErr: "spec is immutable",
		},
	})
}

func TestPmemNodeValidation(t *testing.T) {
	node := func(status string) string {
		return "apiVersion: pmem.pvbridge.io/v1alpha1\nkind: PmemNode\nmetadata: {name: host-a}\nstatus:\n" + indent(status)
	}
	runValidationCases(t, "pmem.pvbridge.io_pmemnodes.yaml", []validationCase{
		{name: "capacity report", obj: node("mode: file\ntotal: 64Gi\nfree: 60Gi\nlargestAllocatable: 59Gi\nalignment: 4Mi")},
		{name: "unknown mode", obj: node("mode: zfs"), wantErr: "status.mode: Unsupported value"},
	})
}
