package capi

import (
	"testing"
	"time"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/util/retry"
	"k8s.io/utils/ptr"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/config"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	infrav1 "pvbridge.io/pkg/apis/infrastructure/v1alpha1"
	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
	"pvbridge.io/pkg/tenancy"
	"pvbridge.io/pkg/testenv"
)

// envTest is one test's view of the test apiserver: the provider running in a manager, an
// uncached client, and a namespace of its own.
type envTest struct {
	g  *WithT
	c  client.Client
	ns string
}

func newEnvTest(t *testing.T, detachTimeout time.Duration) *envTest {
	t.Helper()
	g := NewWithT(t)
	g.SetDefaultEventuallyTimeout(20 * time.Second)
	g.SetDefaultEventuallyPollingInterval(50 * time.Millisecond)
	scheme := newScheme(t)
	mgr, err := ctrl.NewManager(testEnv, ctrl.Options{
		Scheme:                 scheme,
		Metrics:                metricsserver.Options{BindAddress: "0"},
		HealthProbeBindAddress: "0",
		Controller:             config.Controller{SkipNameValidation: ptr.To(true)},
	})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(SetupWithManager(mgr, Options{VolumeDetachTimeout: detachTimeout})).To(Succeed())
	testenv.RunManager(t, mgr)
	c, err := client.New(testEnv, client.Options{Scheme: scheme})
	g.Expect(err).NotTo(HaveOccurred())
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{GenerateName: "capi-"}}
	g.Expect(c.Create(t.Context(), ns)).To(Succeed())
	// The management hosts the machines' VMs run on: a VM on a host without a Node is on a lost
	// host, whose volumes no deletion waits for.
	for _, name := range []string{"host-a", "host-b"} {
		err := c.Create(t.Context(), host(name, true))
		g.Expect(client.IgnoreAlreadyExists(err)).To(Succeed())
	}
	return &envTest{g: g, c: c, ns: ns.Name}
}

// update changes obj (read fresh) with change, retrying on conflicts; status writes the status.
func (e *envTest) update(t *testing.T, obj client.Object, status bool, change func()) {
	t.Helper()
	e.g.Expect(retry.RetryOnConflict(retry.DefaultRetry, func() error {
		if err := e.c.Get(t.Context(), client.ObjectKeyFromObject(obj), obj); err != nil {
			return err
		}
		change()
		if status {
			return e.c.Status().Update(t.Context(), obj)
		}
		return e.c.Update(t.Context(), obj)
	})).To(Succeed())
}

// readyReason returns a function of the Ready reason of obj, for Eventually.
func (e *envTest) readyReason(t *testing.T, obj client.Object, conds func() []metav1.Condition) func() string {
	return func() string {
		if err := e.c.Get(t.Context(), client.ObjectKeyFromObject(obj), obj); err != nil {
			return err.Error()
		}
		if c := meta.FindStatusCondition(conds(), infrav1.ReadyCondition); c != nil {
			return c.Reason
		}
		return ""
	}
}

// createCluster plays the user and Cluster API: a Cluster with its PVBridgeCluster, owned by it.
func (e *envTest) createCluster(t *testing.T, name string) (*clusterv1.Cluster, *infrav1.PVBridgeCluster) {
	t.Helper()
	cluster := &clusterv1.Cluster{
		ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: name, Labels: map[string]string{tenancy.EnabledLabel: "true"}},
		Spec: clusterv1.ClusterSpec{InfrastructureRef: clusterv1.ContractVersionedObjectReference{
			APIGroup: infrav1.GroupVersion.Group, Kind: "PVBridgeCluster", Name: name,
		}},
	}
	e.g.Expect(e.c.Create(t.Context(), cluster)).To(Succeed())
	ic := &infrav1.PVBridgeCluster{
		ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: name,
			Labels: map[string]string{clusterv1.ClusterNameLabel: name},
			OwnerReferences: []metav1.OwnerReference{{
				APIVersion: clusterv1.GroupVersion.String(), Kind: "Cluster", Name: name, UID: cluster.UID,
			}},
		},
		Spec: infrav1.PVBridgeClusterSpec{
			ControlPlaneEndpoint: infrav1.APIEndpoint{Host: "10.0.0.10", Port: 6443},
			FailureDomains:       []infrav1.FailureDomain{{Name: "host-a"}, {Name: "host-b"}},
		},
	}
	e.g.Expect(e.c.Create(t.Context(), ic)).To(Succeed())
	return cluster, ic
}

// createMachine plays Cluster API: a Machine of the cluster, without bootstrap data yet, on
// host, and its PVBridgeMachine, owned by it.
func (e *envTest) createMachine(t *testing.T, cluster *clusterv1.Cluster, name, host string) (*clusterv1.Machine, *infrav1.PVBridgeMachine) {
	t.Helper()
	machine := &clusterv1.Machine{
		ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: name, Labels: map[string]string{clusterv1.ClusterNameLabel: cluster.Name}},
		Spec: clusterv1.MachineSpec{
			ClusterName: cluster.Name,
			Bootstrap: clusterv1.Bootstrap{ConfigRef: clusterv1.ContractVersionedObjectReference{
				APIGroup: "bootstrap.cluster.x-k8s.io", Kind: "KubeadmConfig", Name: name,
			}},
			InfrastructureRef: clusterv1.ContractVersionedObjectReference{
				APIGroup: infrav1.GroupVersion.Group, Kind: "PVBridgeMachine", Name: name,
			},
			FailureDomain: host,
		},
	}
	e.g.Expect(e.c.Create(t.Context(), machine)).To(Succeed())
	pm := &infrav1.PVBridgeMachine{
		ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: name,
			Labels: map[string]string{clusterv1.ClusterNameLabel: cluster.Name},
			OwnerReferences: []metav1.OwnerReference{{
				APIVersion: clusterv1.GroupVersion.String(), Kind: "Machine", Name: name, UID: machine.UID, Controller: ptr.To(true),
			}},
		},
		Spec: infrav1.PVBridgeMachineSpec{ClassName: "small"},
	}
	e.g.Expect(e.c.Create(t.Context(), pm)).To(Succeed())
	return machine, pm
}

// provisionedMachine goes through a machine's provisioning: infrastructure, bootstrap data, the
// VM running on host (vm-operator's part played here). It returns the running VM.
func (e *envTest) provisionedMachine(t *testing.T, name string) (*infrav1.PVBridgeMachine, *vmv1.VirtualMachine) {
	t.Helper()
	g := e.g
	cluster, ic := e.createCluster(t, "guest")
	g.Eventually(e.readyReason(t, ic, func() []metav1.Condition { return ic.Status.Conditions })).Should(Equal(infrav1.ProvisionedReason))
	e.update(t, cluster, true, func() {
		cluster.Status.Initialization.InfrastructureProvisioned = ic.Status.Initialization.Provisioned
		cluster.Status.FailureDomains = nil
		for _, fd := range ic.Status.FailureDomains {
			cluster.Status.FailureDomains = append(cluster.Status.FailureDomains, clusterv1.FailureDomain{Name: fd.Name, ControlPlane: fd.ControlPlane})
		}
	})
	machine, pm := e.createMachine(t, cluster, name, "host-b")
	e.update(t, machine, false, func() { machine.Spec.Bootstrap.DataSecretName = ptr.To(name + "-bootstrap") })
	vm := &vmv1.VirtualMachine{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: name}}
	g.Eventually(func() error { return e.c.Get(t.Context(), client.ObjectKeyFromObject(vm), vm) }).Should(Succeed())
	e.update(t, vm, true, func() { vm.Status.Host, vm.Status.Phase = "host-b", vmv1.PhaseRunning })
	g.Eventually(e.readyReason(t, pm, func() []metav1.Condition { return pm.Status.Conditions })).Should(Equal(infrav1.ProvisionedReason))
	return pm, vm
}

func TestMachineLifecycleAgainstTheAPIServer(t *testing.T) {
	e := newEnvTest(t, time.Hour)
	g := e.g
	cluster, ic := e.createCluster(t, "guest-1")

	// The PVBridgeCluster: provisioned, its failure domains the hosts of its spec.
	g.Eventually(e.readyReason(t, ic, func() []metav1.Condition { return ic.Status.Conditions })).Should(Equal(infrav1.ProvisionedReason))
	g.Expect(ic.Status.Initialization.Provisioned).To(Equal(ptr.To(true)))
	g.Expect(ic.Status.FailureDomains).To(Equal([]infrav1.FailureDomain{
		{Name: "host-a", ControlPlane: ptr.To(true)}, {Name: "host-b", ControlPlane: ptr.To(true)},
	}))

	// A machine waits for the Cluster's infrastructure, then for its bootstrap data.
	machine, pm := e.createMachine(t, cluster, "guest-1-md-0-x1", "host-b")
	pmConds := func() []metav1.Condition { return pm.Status.Conditions }
	g.Eventually(e.readyReason(t, pm, pmConds)).Should(Equal(infrav1.WaitingForClusterInfrastructureReason))
	g.Expect(pm.Finalizers).To(ConsistOf(infrav1.MachineFinalizer))
	e.update(t, cluster, true, func() {
		cluster.Status.Initialization.InfrastructureProvisioned = ptr.To(true)
		cluster.Status.FailureDomains = []clusterv1.FailureDomain{{Name: "host-a"}, {Name: "host-b"}}
	})
	g.Eventually(e.readyReason(t, pm, pmConds)).Should(Equal(infrav1.WaitingForBootstrapDataReason))

	// A paused Cluster pauses it.
	e.update(t, cluster, false, func() { cluster.Spec.Paused = ptr.To(true) })
	g.Eventually(func() bool {
		_ = e.c.Get(t.Context(), client.ObjectKeyFromObject(pm), pm)
		return meta.IsStatusConditionTrue(pm.Status.Conditions, infrav1.PausedCondition)
	}).Should(BeTrue())
	e.update(t, machine, false, func() { machine.Spec.Bootstrap.DataSecretName = ptr.To("guest-1-md-0-x1-bootstrap") })
	vm := &vmv1.VirtualMachine{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: pm.Name}}
	g.Consistently(func() bool {
		return apierrors.IsNotFound(e.c.Get(t.Context(), client.ObjectKeyFromObject(vm), vm))
	}, "1s").Should(BeTrue(), "a paused machine creates no VirtualMachine")
	e.update(t, cluster, false, func() { cluster.Spec.Paused = nil })

	// With its bootstrap data it gets its VirtualMachine: same name, the cluster's label, owned,
	// on the Machine's failure domain, booting the bootstrap secret.
	g.Eventually(func() error { return e.c.Get(t.Context(), client.ObjectKeyFromObject(vm), vm) }).Should(Succeed())
	g.Expect(vm.Labels).To(HaveKeyWithValue(tenancy.CAPIClusterNameLabel, "guest-1"))
	g.Expect(metav1.IsControlledBy(vm, pm)).To(BeTrue())
	g.Expect(vm.Spec.Host).To(Equal("host-b"))
	g.Expect(vm.Spec.Bootstrap).To(Equal(&vmv1.VirtualMachineBootstrap{DataSecretName: "guest-1-md-0-x1-bootstrap"}))
	g.Eventually(e.readyReason(t, pm, pmConds)).Should(Equal(infrav1.VirtualMachineNotRunningReason))
	g.Expect(pm.Spec.ProviderID).To(BeEmpty())

	// vm-operator runs it: the machine is provisioned.
	e.update(t, vm, true, func() { vm.Status.Host, vm.Status.Phase = "host-b", vmv1.PhaseRunning })
	g.Eventually(e.readyReason(t, pm, pmConds)).Should(Equal(infrav1.ProvisionedReason))
	g.Expect(pm.Spec.ProviderID).To(Equal("pvbridge://" + e.ns + "/guest-1-md-0-x1"))
	g.Expect(pm.Status.Initialization.Provisioned).To(Equal(ptr.To(true)))
	g.Expect(pm.Status.FailureDomain).To(Equal("host-b"))
	g.Expect(pm.Status.Addresses).To(ContainElement(infrav1.MachineAddress{Type: infrav1.MachineInternalDNS, Address: pm.Name}))

	// Deleted while a volume is attached: the VM stays, running, until the volume is gone.
	volume := vmv1.VirtualMachineVolume{Name: "data", PersistentVolumeClaim: vmv1.PersistentVolumeClaimVolumeSource{ClaimName: "data"}}
	e.update(t, vm, false, func() {
		vm.Spec.Volumes = []vmv1.VirtualMachineVolume{volume}
		vm.Finalizers = []string{vmv1.VolumesFinalizer} // vm-operator's, played here
	})
	e.update(t, vm, true, func() { vm.Status.Volumes = []vmv1.VirtualMachineVolumeStatus{{Name: "data", Attached: true}} })
	g.Expect(e.c.Delete(t.Context(), pm)).To(Succeed())
	g.Eventually(e.readyReason(t, pm, pmConds)).Should(Equal(infrav1.WaitingForVolumeDetachReason))
	g.Consistently(func() bool {
		g.Expect(e.c.Get(t.Context(), client.ObjectKeyFromObject(vm), vm)).To(Succeed())
		return vm.DeletionTimestamp.IsZero() && vm.Spec.PowerState == vmv1.PowerStateOn
	}, "1s").Should(BeTrue())

	// Cluster API's drain detached it from spec; the host agent unplugs it from status.
	e.update(t, vm, false, func() { vm.Spec.Volumes = nil })
	g.Consistently(func() bool {
		g.Expect(e.c.Get(t.Context(), client.ObjectKeyFromObject(vm), vm)).To(Succeed())
		return vm.DeletionTimestamp.IsZero()
	}, "500ms").Should(BeTrue(), "a volume still in status.volumes is still plugged")
	e.update(t, vm, true, func() { vm.Status.Volumes = nil })

	// Then the VM is powered off and deleted; the machine waits until it is gone.
	g.Eventually(func() bool {
		g.Expect(e.c.Get(t.Context(), client.ObjectKeyFromObject(vm), vm)).To(Succeed())
		return !vm.DeletionTimestamp.IsZero()
	}).Should(BeTrue())
	g.Expect(vm.Spec.PowerState).To(Equal(vmv1.PowerStateOff))
	g.Consistently(func() error { return e.c.Get(t.Context(), client.ObjectKeyFromObject(pm), pm) }, "500ms").Should(Succeed())
	e.update(t, vm, false, func() { vm.Finalizers = nil })
	g.Eventually(func() bool {
		return apierrors.IsNotFound(e.c.Get(t.Context(), client.ObjectKeyFromObject(pm), pm))
	}).Should(BeTrue(), "the PVBridgeMachine is released once its VM is gone")
}

func TestDeletedMachineWhoseVolumesStayIsPoweredOffAfterTheTimeout(t *testing.T) {
	const timeout = 3 * time.Second
	e := newEnvTest(t, timeout)
	g := e.g
	pm, vm := e.provisionedMachine(t, "guest-md-0-y1")
	e.update(t, vm, false, func() { vm.Finalizers = []string{vmv1.VolumesFinalizer} }) // vm-operator's, played here
	e.update(t, vm, true, func() { vm.Status.Volumes = []vmv1.VirtualMachineVolumeStatus{{Name: "stuck", Attached: true}} })

	g.Expect(e.c.Delete(t.Context(), pm)).To(Succeed())

	// The wait itself (WaitingForVolumeDetach) may be over before a loaded machine polls it, so
	// the test reads what the wait leaves: the VM deleted no earlier than the timeout after the
	// machine (both timestamps are truncated to the second), powered off first.
	g.Eventually(func() bool {
		g.Expect(e.c.Get(t.Context(), client.ObjectKeyFromObject(vm), vm)).To(Succeed())
		return !vm.DeletionTimestamp.IsZero()
	}).Should(BeTrue(), "the VM is deleted once the timeout passed")
	g.Expect(vm.Spec.PowerState).To(Equal(vmv1.PowerStateOff))
	g.Expect(e.c.Get(t.Context(), client.ObjectKeyFromObject(pm), pm)).To(Succeed())
	g.Expect(vm.DeletionTimestamp.Sub(pm.DeletionTimestamp.Time)).To(BeNumerically(">=", timeout-time.Second))

	e.update(t, vm, false, func() { vm.Finalizers = nil })
	g.Eventually(func() bool {
		return apierrors.IsNotFound(e.c.Get(t.Context(), client.ObjectKeyFromObject(pm), pm))
	}).Should(BeTrue())
}

func TestProvisionedMachineWhoseVirtualMachineIsDeletedIsReportedNotRecreated(t *testing.T) {
	e := newEnvTest(t, time.Hour)
	g := e.g
	pm, vm := e.provisionedMachine(t, "guest-md-0-z1")
	ic := &infrav1.PVBridgeCluster{}
	g.Expect(e.c.Get(t.Context(), client.ObjectKey{Namespace: e.ns, Name: "guest"}, ic)).To(Succeed())
	g.Expect(ic.Annotations).To(HaveKeyWithValue(infrav1.BlockMoveAnnotation, infrav1.BlockMoveReason), "clusterctl move is blocked")

	g.Expect(e.c.Delete(t.Context(), vm)).To(Succeed())

	g.Eventually(e.readyReason(t, pm, func() []metav1.Condition { return pm.Status.Conditions })).Should(Equal(infrav1.VirtualMachineDeletedReason))
	g.Consistently(func() bool {
		return apierrors.IsNotFound(e.c.Get(t.Context(), client.ObjectKeyFromObject(vm), vm))
	}, "1s").Should(BeTrue(), "the VM of a provisioned machine is not made again from its old bootstrap data")
	g.Expect(pm.Spec.ProviderID).NotTo(BeEmpty())

	// Cluster API's remediation deletes the machine: nothing holds it.
	g.Expect(e.c.Delete(t.Context(), pm)).To(Succeed())
	g.Eventually(func() bool {
		return apierrors.IsNotFound(e.c.Get(t.Context(), client.ObjectKeyFromObject(pm), pm))
	}).Should(BeTrue())
}

func TestTemplatesAreImmutable(t *testing.T) {
	e := newEnvTest(t, time.Hour)
	g := e.g
	mt := &infrav1.PVBridgeMachineTemplate{
		ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "md-0"},
		Spec:       infrav1.PVBridgeMachineTemplateSpec{Template: infrav1.PVBridgeMachineTemplateResource{Spec: infrav1.PVBridgeMachineSpec{ClassName: "small"}}},
	}
	ct := &infrav1.PVBridgeClusterTemplate{
		ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "default"},
		Spec:       infrav1.PVBridgeClusterTemplateSpec{Template: infrav1.PVBridgeClusterTemplateResource{Spec: infrav1.PVBridgeClusterSpec{}}},
	}
	g.Expect(e.c.Create(t.Context(), mt)).To(Succeed())
	g.Expect(e.c.Create(t.Context(), ct)).To(Succeed())

	mt.Spec.Template.Spec.ClassName = "medium"
	err := e.c.Update(t.Context(), mt)
	g.Expect(apierrors.IsInvalid(err)).To(BeTrue(), "%v", err)
	g.Expect(err.Error()).To(ContainSubstring("immutable"))
	ct.Spec.Template.Spec.FailureDomains = []infrav1.FailureDomain{{Name: "host-a"}}
	err = e.c.Update(t.Context(), ct)
	g.Expect(apierrors.IsInvalid(err)).To(BeTrue(), "%v", err)

	// Its metadata may change (Cluster API's clusterctl move and topology labels do).
	e.update(t, mt, false, func() { mt.Labels = map[string]string{"example.com/team": "a"} })
}
