package containers_test

import (
	"context"
	"fmt"
	"path"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"pvbridge.io/e2e/images"
)

// TestImagesRunTheirPrograms runs every image the manifests name on host-a: in each, the
// entrypoint and every program the image carries start in a real container (asked for --help
// or --version) with all they load, as the node plugins will run them.
func TestImagesRunTheirPrograms(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	tags, err := images.Tags(filepath.Join(lab.Binaries().Repo, "manifests", "components", "images", "kustomization.yaml"))
	g.Expect(err).NotTo(HaveOccurred())
	refs := map[string]string{} // name -> reference
	for _, i := range images.Catalogue {
		refs[i.Name] = i.Name + ":" + tags[i.Name]
	}
	c := in.Mgmt.Client()
	for _, i := range images.Catalogue {
		pod := &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: path.Base(i.Name)},
			Spec: corev1.PodSpec{
				NodeName: "host-a", RestartPolicy: corev1.RestartPolicyNever,
				Containers: []corev1.Container{{Name: "entrypoint", Image: refs[i.Name], Args: []string{"--help"}}},
			},
		}
		for n, p := range i.Programs {
			if !path.IsAbs(p) { // not data or modules
				pod.Spec.Containers = append(pod.Spec.Containers, corev1.Container{
					Name: fmt.Sprintf("program-%d", n), Image: refs[i.Name], Command: []string{p, "--version"},
				})
			}
		}
		for j := range pod.Spec.Containers {
			pod.Spec.Containers[j].ImagePullPolicy = corev1.PullNever
		}
		_, err := c.CoreV1().Pods("default").Create(ctx, pod, metav1.CreateOptions{})
		g.Expect(err).NotTo(HaveOccurred())
	}

	// A program that does not start ends with the runtime's StartError or the shell's 127; one
	// that misses a library says so before it exits.
	missing := regexp.MustCompile(`error while loading shared libraries|not found|No such file`)
	for _, i := range images.Catalogue {
		name := path.Base(i.Name)
		t.Run(name, func(t *testing.T) {
			g := NewWithT(t)
			var pod *corev1.Pod
			// The pods start together and their containers one after the other: under CI's load
			// a container takes 3-5 s to start, and guest-csi's pod has a dozen (ci13: 4 minutes).
			g.Eventually(func(g Gomega) {
				pod, err = c.CoreV1().Pods("default").Get(ctx, name, metav1.GetOptions{})
				g.Expect(err).NotTo(HaveOccurred())
				g.Expect(pod.Status.Phase).To(BeElementOf(corev1.PodSucceeded, corev1.PodFailed), "containers: %s", containerStates(pod))
			}).WithContext(ctx).WithTimeout(10 * time.Minute).Should(Succeed())
			for _, cs := range pod.Status.ContainerStatuses {
				what := cs.Name
				for _, ct := range pod.Spec.Containers {
					if ct.Name == cs.Name && len(ct.Command) > 0 {
						what = ct.Command[0]
					}
				}
				g.Expect(cs.State.Terminated).NotTo(BeNil(), what)
				term := cs.State.Terminated
				g.Expect(term.Reason).NotTo(Equal("StartError"), "%s: %s", what, term.Message)
				g.Expect(term.ExitCode).NotTo(Equal(int32(127)), what)
				logs, err := c.CoreV1().Pods("default").GetLogs(name, &corev1.PodLogOptions{Container: cs.Name}).DoRaw(context.WithoutCancel(ctx))
				g.Expect(err).NotTo(HaveOccurred())
				g.Expect(string(logs)).NotTo(MatchRegexp(missing.String()), what)
				g.Expect(logs).NotTo(BeEmpty(), "%s printed nothing", what)
			}
		})
	}
}

// containerStates says where each container of pod is: waiting (and why), running, or terminated.
func containerStates(pod *corev1.Pod) string {
	var states []string
	for _, cs := range pod.Status.ContainerStatuses {
		switch st := cs.State; {
		case st.Waiting != nil:
			states = append(states, cs.Name+" waiting ("+st.Waiting.Reason+")")
		case st.Running != nil:
			states = append(states, cs.Name+" running")
		case st.Terminated != nil:
			states = append(states, cs.Name+" terminated ("+st.Terminated.Reason+")")
		}
	}
	return strings.Join(states, ", ")
}
