package apis_test

import (
	"math/rand"
	"testing"

	. "github.com/onsi/gomega"
	"k8s.io/apimachinery/pkg/api/apitesting/fuzzer"
	"k8s.io/apimachinery/pkg/api/apitesting/roundtrip"
	metafuzzer "k8s.io/apimachinery/pkg/apis/meta/fuzzer"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/runtime/serializer"

	infrav1alpha1 "pvbridge.io/pkg/apis/infrastructure/v1alpha1"
	pmemv1alpha1 "pvbridge.io/pkg/apis/pmem/v1alpha1"
	vmv1alpha1 "pvbridge.io/pkg/apis/vm/v1alpha1"
)

func newScheme(t *testing.T) *runtime.Scheme {
	t.Helper()
	scheme := runtime.NewScheme()
	if err := vmv1alpha1.AddToScheme(scheme); err != nil {
		t.Fatal(err)
	}
	if err := pmemv1alpha1.AddToScheme(scheme); err != nil {
		t.Fatal(err)
	}
	if err := infrav1alpha1.AddToScheme(scheme); err != nil {
		t.Fatal(err)
	}
	return scheme
}

func TestSchemeKnowsEveryKind(t *testing.T) {
	tests := []struct {
		obj  runtime.Object
		want schema.GroupVersionKind
	}{
		{obj: &vmv1alpha1.VirtualMachine{}, want: vmv1alpha1.GroupVersion.WithKind("VirtualMachine")},
		{obj: &vmv1alpha1.VirtualMachineList{}, want: vmv1alpha1.GroupVersion.WithKind("VirtualMachineList")},
		{obj: &pmemv1alpha1.PmemVolume{}, want: pmemv1alpha1.GroupVersion.WithKind("PmemVolume")},
		{obj: &pmemv1alpha1.PmemVolumeList{}, want: pmemv1alpha1.GroupVersion.WithKind("PmemVolumeList")},
		{obj: &pmemv1alpha1.PmemSnapshot{}, want: pmemv1alpha1.GroupVersion.WithKind("PmemSnapshot")},
		{obj: &pmemv1alpha1.PmemSnapshotList{}, want: pmemv1alpha1.GroupVersion.WithKind("PmemSnapshotList")},
		{obj: &pmemv1alpha1.PmemReplica{}, want: pmemv1alpha1.GroupVersion.WithKind("PmemReplica")},
		{obj: &pmemv1alpha1.PmemReplicaList{}, want: pmemv1alpha1.GroupVersion.WithKind("PmemReplicaList")},
		{obj: &pmemv1alpha1.PmemNode{}, want: pmemv1alpha1.GroupVersion.WithKind("PmemNode")},
		{obj: &pmemv1alpha1.PmemNodeList{}, want: pmemv1alpha1.GroupVersion.WithKind("PmemNodeList")},
		{obj: &infrav1alpha1.PVBridgeCluster{}, want: infrav1alpha1.GroupVersion.WithKind("PVBridgeCluster")},
		{obj: &infrav1alpha1.PVBridgeClusterList{}, want: infrav1alpha1.GroupVersion.WithKind("PVBridgeClusterList")},
		{obj: &infrav1alpha1.PVBridgeMachine{}, want: infrav1alpha1.GroupVersion.WithKind("PVBridgeMachine")},
		{obj: &infrav1alpha1.PVBridgeMachineList{}, want: infrav1alpha1.GroupVersion.WithKind("PVBridgeMachineList")},
		{obj: &infrav1alpha1.PVBridgeMachineTemplate{}, want: infrav1alpha1.GroupVersion.WithKind("PVBridgeMachineTemplate")},
		{obj: &infrav1alpha1.PVBridgeMachineTemplateList{}, want: infrav1alpha1.GroupVersion.WithKind("PVBridgeMachineTemplateList")},
	}
	scheme := newScheme(t)
	for _, tt := range tests {
		t.Run(tt.want.Kind, func(t *testing.T) {
			g := NewWithT(t)
			gvks, _, err := scheme.ObjectKinds(tt.obj)
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(gvks).To(ConsistOf(tt.want))
		})
	}
}

// TestTypesRoundTripThroughJSON fills every kind with random values and checks that deep copy
// and a JSON encode/decode change nothing: the generated deepcopy is current and no field loses
// data to its JSON tag.
func TestTypesRoundTripThroughJSON(t *testing.T) {
	scheme := newScheme(t)
	codecs := serializer.NewCodecFactory(scheme)
	seed := rand.Int63()
	t.Logf("fuzzer seed %d", seed)
	f := fuzzer.FuzzerFor(metafuzzer.Funcs, rand.NewSource(seed), codecs)
	roundtrip.RoundTripExternalTypesWithoutProtobuf(t, scheme, codecs, f, nil)
}
