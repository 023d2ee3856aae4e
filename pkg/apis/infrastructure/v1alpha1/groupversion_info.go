// Package v1alpha1 holds the infrastructure.cluster.x-k8s.io/v1alpha1 API of pvbridge's Cluster
// API infrastructure provider: PVBridgeCluster (InfraCluster), PVBridgeMachine (InfraMachine)
// and PVBridgeMachineTemplate (InfraMachineTemplate) of Cluster API's v1beta2 contract. A
// PVBridgeMachine is realized as a vm.pvbridge.io VirtualMachine of the same name.
//
// The package imports apimachinery only: the few Cluster API shapes the contract asks for
// (an API endpoint, a failure domain, a machine address) are declared here with the same JSON.
//
// +kubebuilder:object:generate=true
// +groupName=infrastructure.cluster.x-k8s.io
package v1alpha1

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
)

// GroupVersion is the group and version of this API.
var GroupVersion = schema.GroupVersion{Group: "infrastructure.cluster.x-k8s.io", Version: "v1alpha1"}

var (
	// SchemeBuilder registers this API's types.
	SchemeBuilder = runtime.NewSchemeBuilder(addKnownTypes)
	// AddToScheme adds this API's types to a scheme.
	AddToScheme = SchemeBuilder.AddToScheme
)

func addKnownTypes(s *runtime.Scheme) error {
	s.AddKnownTypes(GroupVersion,
		&PVBridgeCluster{}, &PVBridgeClusterList{},
		&PVBridgeMachine{}, &PVBridgeMachineList{},
		&PVBridgeMachineTemplate{}, &PVBridgeMachineTemplateList{},
		&PVBridgeClusterTemplate{}, &PVBridgeClusterTemplateList{},
	)
	metav1.AddToGroupVersion(s, GroupVersion)
	return nil
}
