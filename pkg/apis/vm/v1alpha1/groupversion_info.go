// Package v1alpha1 holds the vm.pvbridge.io/v1alpha1 API: the VirtualMachine that is a guest
// cluster's node, as the management cluster sees it.
//
// +kubebuilder:object:generate=true
// +groupName=vm.pvbridge.io
package v1alpha1

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
)

// GroupVersion is the group and version of this API.
var GroupVersion = schema.GroupVersion{Group: "vm.pvbridge.io", Version: "v1alpha1"}

var (
	// SchemeBuilder registers this API's types; it uses apimachinery only, so that importing the
	// API does not pull in a client library.
	SchemeBuilder = runtime.NewSchemeBuilder(addKnownTypes)
	// AddToScheme adds this API's types to a scheme.
	AddToScheme = SchemeBuilder.AddToScheme
)

func addKnownTypes(s *runtime.Scheme) error {
	s.AddKnownTypes(GroupVersion, &VirtualMachine{}, &VirtualMachineList{}, &VirtualMachineClass{}, &VirtualMachineClassList{})
	metav1.AddToGroupVersion(s, GroupVersion)
	return nil
}
