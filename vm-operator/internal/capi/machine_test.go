package capi

import (
	"testing"
	"time"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/events"
	"k8s.io/utils/ptr"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	infrav1 "pvbridge.io/pkg/apis/infrastructure/v1alpha1"
	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
	"pvbridge.io/pkg/tenancy"
)

func TestMachineReconcile(t *testing.T) {
	running := vmv1.VirtualMachineStatus{Host: "host-b", UniqueID: "vm-uid", Phase: vmv1.PhaseRunning, Addresses: []string{"10.0.7.12"}}
	tests := []struct {
		name    string
		prepare func(f *fixtures)
		// vm exists before the reconcile when set.
		vm            func(f *fixtures) *vmv1.VirtualMachine
		wantReason    string // of Ready
		wantVM        bool
		wantFinalizer bool
		wantPaused    bool
		wantWarning   string // the reason of a Warning Event
	}{{
		name:    "a PVBridgeMachine without a Machine owner waits for Cluster API",
		prepare: func(f *fixtures) { f.pm.OwnerReferences = nil; f.pm.Finalizers = nil },
	}, {
		name:          "the finalizer is added first, in its own write",
		prepare:       func(f *fixtures) { f.pm.Finalizers = nil },
		wantFinalizer: true,
	}, {
		name: "it waits for the Cluster's infrastructure",
		prepare: func(f *fixtures) {
			f.cluster.Status.Initialization.InfrastructureProvisioned = nil
		},
		wantReason: infrav1.WaitingForClusterInfrastructureReason, wantFinalizer: true,
	}, {
		name:       "it waits for the bootstrap data",
		prepare:    func(f *fixtures) { f.machine.Spec.Bootstrap.DataSecretName = nil },
		wantReason: infrav1.WaitingForBootstrapDataReason, wantFinalizer: true,
	}, {
		name:       "a failure domain that is not one of the Cluster's hosts is refused",
		prepare:    func(f *fixtures) { f.machine.Spec.FailureDomain = "host-z" },
		wantReason: infrav1.FailureDomainUnknownReason, wantFinalizer: true,
	}, {
		name:       "it creates the VirtualMachine, which does not run yet",
		wantReason: infrav1.VirtualMachineNotRunningReason, wantVM: true, wantFinalizer: true,
	}, {
		name:       "a running VirtualMachine makes the machine provisioned and ready",
		vm:         func(f *fixtures) *vmv1.VirtualMachine { return f.vmOf(running) },
		wantReason: infrav1.ProvisionedReason, wantVM: true, wantFinalizer: true,
	}, {
		name:       "a running VirtualMachine is reported even when its host left the Cluster's failure domains",
		prepare:    func(f *fixtures) { f.cluster.Status.FailureDomains = f.cluster.Status.FailureDomains[:1] },
		vm:         func(f *fixtures) *vmv1.VirtualMachine { return f.vmOf(running) },
		wantReason: infrav1.ProvisionedReason, wantVM: true, wantFinalizer: true,
	}, {
		name:       "the deleted VirtualMachine of a provisioned machine is reported, not re-created",
		prepare:    func(f *fixtures) { f.pm.Spec.ProviderID = infrav1.ProviderID(ns, machineName) },
		wantReason: infrav1.VirtualMachineDeletedReason, wantFinalizer: true, wantWarning: infrav1.VirtualMachineDeletedReason,
	}, {
		name: "a VirtualMachine of the name that is not the machine's is left alone",
		vm: func(f *fixtures) *vmv1.VirtualMachine {
			vm := f.vmOf(running)
			vm.OwnerReferences = nil
			return vm
		},
		wantReason: infrav1.VirtualMachineConflictReason, wantFinalizer: true,
	}, {
		name:          "a paused Cluster pauses the machine",
		prepare:       func(f *fixtures) { f.cluster.Spec.Paused = ptr.To(true) },
		wantFinalizer: true, wantPaused: true,
	}, {
		name: "the paused annotation pauses the machine",
		prepare: func(f *fixtures) {
			f.pm.Annotations = map[string]string{clusterv1.PausedAnnotation: ""}
		},
		wantFinalizer: true, wantPaused: true,
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			f := newFixtures()
			if tt.prepare != nil {
				tt.prepare(f)
			}
			objs := f.objects()
			if tt.vm != nil {
				objs = append(objs, tt.vm(f))
			}
			c := newClient(t, objs...)
			recorder := events.NewFakeRecorder(10)
			r := &MachineReconciler{Client: c, Recorder: recorder}

			res, err := r.Reconcile(t.Context(), ctrl.Request{NamespacedName: client.ObjectKeyFromObject(f.pm)})

			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(res).To(Equal(ctrl.Result{}))
			if tt.wantWarning != "" {
				g.Expect(recorder.Events).To(Receive(HavePrefix("Warning " + tt.wantWarning)))
			}
			pm := get(t, c, &infrav1.PVBridgeMachine{ObjectMeta: f.pm.ObjectMeta})
			g.Expect(pm.Finalizers).To(Equal(map[bool][]string{true: {infrav1.MachineFinalizer}}[tt.wantFinalizer]))
			ready := meta.FindStatusCondition(pm.Status.Conditions, infrav1.ReadyCondition)
			if tt.wantReason == "" {
				g.Expect(ready).To(BeNil())
			} else {
				g.Expect(ready).NotTo(BeNil())
				g.Expect(ready.Reason).To(Equal(tt.wantReason))
				g.Expect(ready.Status).To(Equal(map[bool]metav1.ConditionStatus{true: metav1.ConditionTrue, false: metav1.ConditionFalse}[tt.wantReason == infrav1.ProvisionedReason]))
				g.Expect(meta.IsStatusConditionFalse(pm.Status.Conditions, infrav1.PausedCondition)).To(BeTrue())
			}
			if tt.wantPaused {
				g.Expect(meta.IsStatusConditionTrue(pm.Status.Conditions, infrav1.PausedCondition)).To(BeTrue())
			}

			vm := &vmv1.VirtualMachine{}
			err = c.Get(t.Context(), client.ObjectKeyFromObject(pm), vm)
			if !tt.wantVM {
				if tt.vm == nil {
					g.Expect(apierrors.IsNotFound(err)).To(BeTrue(), "no VirtualMachine is created")
				}
				g.Expect(pm.Spec.ProviderID).To(Equal(f.pm.Spec.ProviderID))
				g.Expect(pm.Status.Initialization.Provisioned).To(BeNil())
				return
			}
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(vm.Labels).To(HaveKeyWithValue(tenancy.CAPIClusterNameLabel, clusterName))
			g.Expect(vm.Labels).To(HaveKeyWithValue(infrav1.MachineLabel, machineName))
			g.Expect(metav1.IsControlledBy(vm, pm)).To(BeTrue())
			g.Expect(vm.Spec.Host).To(Equal("host-b"), "the Machine's failure domain is the VM's host")
			g.Expect(vm.Spec.Bootstrap).To(Equal(&vmv1.VirtualMachineBootstrap{DataSecretName: secretName}))
			g.Expect(vm.Spec.PowerState).To(Equal(vmv1.PowerStateOn))
			g.Expect(vm.Spec.ClassName).To(Equal("small"))
			g.Expect(vm.Spec.Image).To(Equal("node-v1.37.2"))
			if tt.wantReason != infrav1.ProvisionedReason {
				g.Expect(pm.Spec.ProviderID).To(BeEmpty())
				g.Expect(pm.Status.Initialization.Provisioned).To(BeNil())
				return
			}
			g.Expect(pm.Spec.ProviderID).To(Equal("pvbridge://" + ns + "/" + machineName))
			g.Expect(pm.Status.Initialization.Provisioned).To(Equal(ptr.To(true)))
			g.Expect(pm.Status.FailureDomain).To(Equal("host-b"))
			g.Expect(pm.Status.Addresses).To(ConsistOf(
				infrav1.MachineAddress{Type: infrav1.MachineHostName, Address: machineName},
				infrav1.MachineAddress{Type: infrav1.MachineInternalDNS, Address: machineName},
				infrav1.MachineAddress{Type: infrav1.MachineInternalIP, Address: "10.0.7.12"}, // its guest's
			))
			g.Expect(meta.IsStatusConditionTrue(pm.Status.Conditions, infrav1.VirtualMachineProvisionedCondition)).To(BeTrue())
		})
	}
}

func TestMachineWithoutFailureDomainLeavesPlacementToVMOperator(t *testing.T) {
	g := NewWithT(t)
	f := newFixtures()
	f.machine.Spec.FailureDomain = ""
	f.pm.Spec.Resources = &infrav1.MachineResources{CPU: ptr.To(resource.MustParse("2")), Memory: ptr.To(resource.MustParse("4Gi"))}
	c := newClient(t, f.objects()...)
	r := &MachineReconciler{Client: c}

	_, err := r.Reconcile(t.Context(), ctrl.Request{NamespacedName: client.ObjectKeyFromObject(f.pm)})

	g.Expect(err).NotTo(HaveOccurred())
	vm := get(t, c, &vmv1.VirtualMachine{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: machineName}})
	g.Expect(vm.Spec.Host).To(BeEmpty())
	g.Expect(vm.Spec.Resources.CPU.String()).To(Equal("2"))
	g.Expect(vm.Spec.Resources.Memory.String()).To(Equal("4Gi"))
}

func TestWatchFilterPicksTheInstancesObjects(t *testing.T) {
	for _, tt := range []struct {
		name   string
		filter WatchFilter
		label  string // the machine's and cluster's watch-filter label; "" none
		want   bool   // reconciled: the VirtualMachine created
	}{
		{name: "no filter reconciles an unlabelled machine", want: true},
		{name: "no filter reconciles a labelled machine", label: "blue", want: true},
		{name: "a filter reconciles its own", filter: "blue", label: "blue", want: true},
		{name: "a filter leaves another instance's machine", filter: "blue", label: "green"},
		{name: "a filter leaves an unlabelled machine", filter: "blue"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			f := newFixtures()
			if tt.label != "" {
				f.pm.Labels[clusterv1.WatchLabel] = tt.label
				f.ic.Labels[clusterv1.WatchLabel] = tt.label
			}
			c := newClient(t, f.objects()...)
			_, err := (&MachineReconciler{Client: c, Filter: tt.filter}).Reconcile(t.Context(), ctrl.Request{NamespacedName: client.ObjectKeyFromObject(f.pm)})
			g.Expect(err).NotTo(HaveOccurred())
			err = c.Get(t.Context(), client.ObjectKeyFromObject(f.pm), &vmv1.VirtualMachine{})
			g.Expect(err == nil).To(Equal(tt.want), "VirtualMachine created: %v", err)

			_, err = (&ClusterReconciler{Client: c, Filter: tt.filter}).Reconcile(t.Context(), ctrl.Request{NamespacedName: client.ObjectKeyFromObject(f.ic)})
			g.Expect(err).NotTo(HaveOccurred())
			ic := get(t, c, &infrav1.PVBridgeCluster{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: clusterName}})
			g.Expect(ic.Status.Conditions != nil).To(Equal(tt.want), "PVBridgeCluster reconciled")
		})
	}
}

func TestMachineDeletion(t *testing.T) {
	const timeout = 5 * time.Minute
	deletedAt := time.Date(2026, 11, 27, 12, 0, 0, 0, time.UTC)
	volume := vmv1.VirtualMachineVolume{Name: "data", PersistentVolumeClaim: vmv1.PersistentVolumeClaimVolumeSource{ClaimName: "data"}}
	tests := []struct {
		name    string
		prepare func(f *fixtures, vm *vmv1.VirtualMachine)
		// noVM: the VirtualMachine is gone already.
		noVM bool
		// hostLost: the VM's host (host-b) is tainted out of service.
		hostLost bool
		// elapsed since the PVBridgeMachine's deletion.
		elapsed        time.Duration
		wantReason     string
		wantRequeue    time.Duration
		wantVMDeleted  bool
		wantPoweredOff bool
		wantReleased   bool
		wantEvent      string
	}{{
		name:        "volumes still in the VM's spec: it waits, VM untouched",
		prepare:     func(_ *fixtures, vm *vmv1.VirtualMachine) { vm.Spec.Volumes = []vmv1.VirtualMachineVolume{volume} },
		elapsed:     time.Minute,
		wantReason:  infrav1.WaitingForVolumeDetachReason,
		wantRequeue: 4 * time.Minute,
	}, {
		name: "volumes still in the VM's status (being unplugged): it waits",
		prepare: func(_ *fixtures, vm *vmv1.VirtualMachine) {
			vm.Status.Volumes = []vmv1.VirtualMachineVolumeStatus{{Name: "data", Attached: true, DiskSerial: "pvb1"}}
		},
		elapsed:     4*time.Minute + 30*time.Second,
		wantReason:  infrav1.WaitingForVolumeDetachReason,
		wantRequeue: 30 * time.Second,
	}, {
		name:          "no volumes: the VM is powered off and deleted, the machine waits for it to go",
		wantReason:    infrav1.DeletingReason,
		wantVMDeleted: true, wantPoweredOff: true,
	}, {
		name:          "the timeout passed with volumes: the VM is powered off and deleted anyway",
		prepare:       func(_ *fixtures, vm *vmv1.VirtualMachine) { vm.Spec.Volumes = []vmv1.VirtualMachineVolume{volume} },
		elapsed:       timeout,
		wantReason:    infrav1.DeletingReason,
		wantVMDeleted: true, wantPoweredOff: true,
		wantEvent: infrav1.VolumeDetachTimedOutReason,
	}, {
		name: "volumes in the VM while the Cluster is deleted: no wait (no guest will detach them), powered off and deleted",
		prepare: func(f *fixtures, vm *vmv1.VirtualMachine) {
			vm.Spec.Volumes = []vmv1.VirtualMachineVolume{volume}
			f.cluster.DeletionTimestamp = &metav1.Time{Time: deletedAt}
			f.cluster.Finalizers = []string{"cluster.cluster.x-k8s.io"}
		},
		elapsed:       time.Second,
		wantReason:    infrav1.DeletingReason,
		wantVMDeleted: true, wantPoweredOff: true,
	}, {
		name: "volumes in the VM on a lost host: no wait (its agent will never unplug them), powered off and deleted",
		prepare: func(_ *fixtures, vm *vmv1.VirtualMachine) {
			vm.Spec.Volumes = []vmv1.VirtualMachineVolume{volume}
			vm.Status.Volumes = []vmv1.VirtualMachineVolumeStatus{{Name: "data", Attached: true, DiskSerial: "pvb1"}}
		},
		hostLost:      true,
		elapsed:       time.Second,
		wantReason:    infrav1.DeletingReason,
		wantVMDeleted: true, wantPoweredOff: true,
		wantEvent: "HostLost",
	}, {
		name:         "the VM is gone: the finalizer is removed",
		noVM:         true,
		wantReleased: true,
	}, {
		name:         "a VM of the name that is not the machine's is not deleted",
		prepare:      func(_ *fixtures, vm *vmv1.VirtualMachine) { vm.OwnerReferences = nil },
		wantReleased: true,
	}, {
		name:    "a paused Cluster pauses the deletion",
		prepare: func(f *fixtures, _ *vmv1.VirtualMachine) { f.cluster.Spec.Paused = ptr.To(true) },
	}, {
		name: "a deleted machine whose Machine is gone still deletes its VM",
		prepare: func(f *fixtures, _ *vmv1.VirtualMachine) {
			f.pm.OwnerReferences = nil
		},
		wantReason:    infrav1.DeletingReason,
		wantVMDeleted: true, wantPoweredOff: true,
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			f := newFixtures()
			f.pm.DeletionTimestamp = &metav1.Time{Time: deletedAt}
			vm := f.vmOf(vmv1.VirtualMachineStatus{Host: "host-b", Phase: vmv1.PhaseRunning})
			// vm-operator's finalizer keeps a deleted VM until its disks are unplugged.
			vm.Finalizers = []string{vmv1.VolumesFinalizer}
			if tt.prepare != nil {
				tt.prepare(f, vm)
			}
			node := host("host-b", true)
			if tt.hostLost {
				node.Spec.Taints = []corev1.Taint{{Key: corev1.TaintNodeOutOfService, Value: "nodeshutdown", Effect: corev1.TaintEffectNoExecute}}
			}
			objs := append(f.objects(), node)
			if !tt.noVM {
				objs = append(objs, vm)
			}
			c := newClient(t, objs...)
			rec := events.NewFakeRecorder(10)
			r := &MachineReconciler{Client: c, Recorder: rec, VolumeDetachTimeout: timeout,
				now: func() time.Time { return deletedAt.Add(tt.elapsed) }}

			res, err := r.Reconcile(t.Context(), ctrl.Request{NamespacedName: client.ObjectKeyFromObject(f.pm)})

			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(res.RequeueAfter).To(Equal(tt.wantRequeue))
			pm := &infrav1.PVBridgeMachine{}
			err = c.Get(t.Context(), client.ObjectKeyFromObject(f.pm), pm)
			if tt.wantReleased {
				g.Expect(apierrors.IsNotFound(err)).To(BeTrue(), "the finalizer is removed, so the PVBridgeMachine is gone")
			} else {
				g.Expect(err).NotTo(HaveOccurred())
				g.Expect(pm.Finalizers).To(ConsistOf(infrav1.MachineFinalizer))
				if tt.wantReason != "" {
					ready := meta.FindStatusCondition(pm.Status.Conditions, infrav1.ReadyCondition)
					g.Expect(ready).NotTo(BeNil())
					g.Expect(ready.Reason).To(Equal(tt.wantReason))
				}
			}
			if tt.noVM {
				return
			}
			got := get(t, c, &vmv1.VirtualMachine{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: machineName}})
			g.Expect(got.DeletionTimestamp.IsZero()).To(Equal(!tt.wantVMDeleted))
			wantPower := vmv1.PowerStateOn
			if tt.wantPoweredOff {
				wantPower = vmv1.PowerStateOff
			}
			g.Expect(got.Spec.PowerState).To(Equal(wantPower))
			if tt.wantEvent != "" {
				g.Expect(rec.Events).To(Receive(ContainSubstring(tt.wantEvent)))
			}
		})
	}
}

func TestMachineDeletionEndsWhenTheVMIsGone(t *testing.T) {
	g := NewWithT(t)
	f := newFixtures()
	f.pm.DeletionTimestamp = &metav1.Time{Time: time.Now()}
	vm := f.vmOf(vmv1.VirtualMachineStatus{Host: "host-b", Phase: vmv1.PhaseRunning})
	vm.Finalizers = []string{vmv1.VolumesFinalizer}
	c := newClient(t, append(f.objects(), vm)...)
	r := &MachineReconciler{Client: c, VolumeDetachTimeout: time.Minute}
	req := ctrl.Request{NamespacedName: client.ObjectKeyFromObject(f.pm)}

	_, err := r.Reconcile(t.Context(), req)
	g.Expect(err).NotTo(HaveOccurred())
	_, err = r.Reconcile(t.Context(), req) // deleting it again is harmless
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(get(t, c, f.pm).Finalizers).To(ConsistOf(infrav1.MachineFinalizer), "kept while the VM exists")

	// vm-operator unplugged the disks and released the VM.
	vm = get(t, c, vm)
	vm.Finalizers = nil
	g.Expect(c.Update(t.Context(), vm)).To(Succeed())
	_, err = r.Reconcile(t.Context(), req)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(apierrors.IsNotFound(c.Get(t.Context(), req.NamespacedName, &infrav1.PVBridgeMachine{}))).To(BeTrue())
}

func TestFinalizerPatchKeepsAFinalizerAddedMeanwhile(t *testing.T) {
	g := NewWithT(t)
	f := newFixtures()
	c := newClient(t, f.objects()...)
	pm := get(t, c, &infrav1.PVBridgeMachine{ObjectMeta: f.pm.ObjectMeta})
	base := pm.DeepCopy()

	// Another controller adds its finalizer after the provider read the machine.
	other := pm.DeepCopy()
	other.Finalizers = append(other.Finalizers, "example.com/other")
	g.Expect(c.Update(t.Context(), other)).To(Succeed())

	pm.Finalizers = nil
	err := patchObject(t.Context(), c, base, pm)

	g.Expect(apierrors.IsConflict(err)).To(BeTrue(), "a stale finalizer list is not written: %v", err)
	g.Expect(get(t, c, &infrav1.PVBridgeMachine{ObjectMeta: f.pm.ObjectMeta}).Finalizers).To(ConsistOf(infrav1.MachineFinalizer, "example.com/other"))
}
