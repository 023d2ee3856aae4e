// Package charts makes pvbridge's Helm charts from its kustomize overlays, and checks that a
// chart renders the objects its overlay builds. The overlays stay the source: a chart is the
// overlay's output (kubectl kustomize), its CRDs in crds/ and every other object in templates/
// (one file per kind), with the values an admin sets templated in (values.yaml):
//   - images: each image by name; imageRegistry, when set, replaces the registry of every one
//     (a mirror that keeps the paths);
//   - extraArgs: more arguments for the main container of a workload, by workload name (a
//     repeated flag's last value wins, so they also override the shipped ones);
//   - workloads: per workload, replicas (Deployments), resources by container, nodeSelector,
//     tolerations, affinity and priorityClassName, each replacing the shipped one; and
//     imagePullSecrets for every pod. Each workload's object is its overlay's text in a named
//     template, parsed (fromYaml), given these values and printed (toYaml): no value is spliced
//     into YAML text, and the defaults print the overlay's object;
//   - snapshotController: false leaves out the CSI snapshot-controller (a cluster that runs
//     one already: two would race); helm install --skip-crds leaves out the CRDs;
//   - defaultClasses: false makes none of the classes the overlay marks its kind's default
//     (is-default-class) a default, where the cluster has its own;
//   - test: the management chart's helm test (its class and nodes);
//   - the overlay's own settings: the management apiserver URL (mgmtServer) of the management
//     chart; the guest cluster's name and UID (clusterName, clusterUID) of the guest chart.
//
// values.schema.json types every value and refuses what no install can run with: a value it does
// not know (a typo), and the overlay's placeholders (the management server at .invalid, the
// all-zero Cluster UID), which kustomize's users replace in their copy and helm's set.
// NOTES.txt says what an install needs next: the namespace's Pod Security level for the
// privileged node pods, and what the management chart's hosts need.
//
// The overlay's generated ConfigMap name (kustomize's hash of its data) becomes a hash of the
// value in the chart, so that a changed value rolls the pods that read it, as with kustomize.
package charts

import (
	"bytes"
	"encoding/json"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strings"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"sigs.k8s.io/yaml"

	"pvbridge.io/e2e/images"
)

// Chart is one chart and the overlay it is made from.
type Chart struct {
	// Name is the chart's name and directory under charts/; Overlay the overlay's under
	// manifests/overlays/.
	Name, Overlay, Description string
	// Settings are the overlay's ConfigMap literals templated as values: the literal's line
	// in the overlay's output, and the value's name.
	Settings []Setting
	// HashedConfigMap is the name (without kustomize's suffix) of a ConfigMap whose name
	// kustomize hashes; HashOf the values its name is made from in the chart.
	HashedConfigMap string
	HashOf          []string
	// Notes is the chart's NOTES.txt, a template.
	Notes string
	// Test, when set, is the chart's `helm test` (templates/tests/volume.yaml), a template; it
	// runs image TestImage (values: images.volume-test) with the values TestValues (test:).
	Test, TestImage string
	TestValues      map[string]any
}

// privilegedNote begins each chart's NOTES.txt: both install privileged node pods.
const privilegedNote = `pvbridge {{ .Chart.AppVersion }} is installed in namespace {{ .Release.Namespace }}.

Its node pods are privileged (they mount volumes, and on management hosts carve PMEM and run the
VMs). Where Pod Security Admission enforces a stricter level by default, they are refused until
the namespace allows them:
  kubectl label namespace {{ .Release.Namespace }} pod-security.kubernetes.io/enforce=privileged

Helm installs the CRDs in crds/ but never upgrades them: before upgrading the release,
  kubectl apply --server-side -f <the new chart>/crds

`

// managementTest is the management chart's `helm test`: a claim of class test.storageClass and
// a pod on a host of test.nodeSelector that writes a file to it, syncs it and reads it back.
// Both go once the test passes (the claim's volume with them); a failed test leaves them for a
// look (kubectl -n pvbridge-system describe pod pvbridge-test), and the next run replaces them.
const managementTest = `{{- $hook := dict "helm.sh/hook" "test" "helm.sh/hook-delete-policy" "before-hook-creation,hook-succeeded" -}}
apiVersion: v1
kind: PersistentVolumeClaim
metadata:
  name: {{ .Release.Name }}-test
  namespace: {{ .Release.Namespace }}
  annotations:
    {{- toYaml (merge (dict "helm.sh/hook-weight" "-1") $hook) | nindent 4 }}
spec:
  accessModes: [ReadWriteOnce]
  storageClassName: {{ .Values.test.storageClass }}
  resources:
    requests:
      storage: 16Mi
---
apiVersion: v1
kind: Pod
metadata:
  name: {{ .Release.Name }}-test
  namespace: {{ .Release.Namespace }}
  annotations:
    {{- toYaml $hook | nindent 4 }}
spec:
  restartPolicy: Never
  automountServiceAccountToken: false
  {{- with .Values.test.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext:
    runAsNonRoot: true
    runAsUser: 65532
    runAsGroup: 65532
    fsGroup: 65532
    seccompProfile:
      type: RuntimeDefault
  containers:
    - name: test
      image: {{ include "pvbridge.image" (dict "root" $ "name" "volume-test") }}
      imagePullPolicy: IfNotPresent
      command:
        - sh
        - -c
        - echo pvbridge > /data/test && sync && grep -qx pvbridge /data/test && echo "a volume of class {{ .Values.test.storageClass }} was made, mounted, written and read"
      securityContext:
        allowPrivilegeEscalation: false
        capabilities:
          drop: [ALL]
      volumeMounts:
        - name: data
          mountPath: /data
  volumes:
    - name: data
      persistentVolumeClaim:
        claimName: {{ .Release.Name }}-test
`

// Setting is a ConfigMap literal as a value: its JSON schema, and an example that the schema
// takes (the overlay's placeholder it may refuse).
type Setting struct {
	Key, Value, Doc string
	Schema          map[string]any
	Example         string
}

// Charts are the charts of the two installs.
var Charts = []Chart{
	{
		Name: "pvbridge-management", Overlay: "management",
		Description: "pvbridge in the management cluster: mgmt-csi, vm-operator, the tenants controller, the tenancy admission policy and the CSI snapshot controller",
		Settings: []Setting{{Key: "mgmt-server", Value: "mgmtServer",
			Doc: "Required: the management apiserver's https:// URL as guest clusters reach it, written into every guest's kubeconfig.",
			Schema: map[string]any{
				"type": "string", "pattern": `^https://[^/\s]+(/\S*)?$`,
				"not":         map[string]any{"pattern": `\.invalid(:[0-9]+)?(/|$)`},
				"description": "the management apiserver's https:// URL as guest clusters reach it (not the placeholder at .invalid)",
			},
			Example: "https://mgmt.example.com:6443"}},
		Notes: privilegedNote + `Then label every PMEM host, and wait until each has a PmemNode with Ready=True:
  kubectl label node <host> vm.pvbridge.io/host=true
  kubectl get pmemnodes
and check that a volume is made, mounted, written and read on a host:
  helm test {{ .Release.Name }} --namespace {{ .Release.Namespace }}
`,
		Test: managementTest, TestImage: "docker.io/library/busybox:1.37.0",
		TestValues:      map[string]any{"storageClass": "pmem", "nodeSelector": map[string]any{"vm.pvbridge.io/host": "true"}},
		HashedConfigMap: "pvbridge-tenants", HashOf: []string{"mgmtServer"},
	},
	{
		Name: "pvbridge-guest", Overlay: "guest",
		Description: "pvbridge in a guest cluster: guest-csi and the CSI snapshot controller",
		Settings: []Setting{
			{Key: "cluster-name", Value: "clusterName", Doc: "The guest cluster's name: its Cluster's in the management cluster.",
				Schema:  map[string]any{"type": "string", "pattern": `^[a-z0-9]([-a-z0-9]*[a-z0-9])?$`, "maxLength": 63},
				Example: "alpha"},
			{Key: "cluster-uid", Value: "clusterUID", Doc: "The UID of the guest cluster's Cluster in the management cluster: its identity.",
				Schema: map[string]any{
					"type": "string", "pattern": `^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$`,
					"not":         map[string]any{"const": "00000000-0000-0000-0000-000000000000"},
					"description": "the UID of the guest's Cluster (kubectl -n <namespace> get cluster <name> -o jsonpath='{.metadata.uid}'), not the placeholder",
				},
				Example: "86d2c1e0-5a3b-4c1d-9e8f-0123456789ab"},
		},
		Notes: privilegedNote,
	},
}

// Namespace is the namespace of both overlays, and so of the releases.
const Namespace = "pvbridge-system"

// Files are a chart's files by path relative to its directory.
type Files map[string][]byte

// Make makes chart c from what kubectl kustomize builds of its overlay below root.
// Its version and appVersion are pvbridge's (images.Version).
func (c Chart) Make(kubectl, root string) (Files, error) {
	out, err := kustomize(kubectl, root, c.Overlay)
	if err != nil {
		return nil, err
	}
	version, err := images.Version(root)
	if err != nil {
		return nil, err
	}
	files := Files{}
	templates := map[string][]string{}
	var workloads []workload
	var defines []string
	refs := map[string]string{}
	settings := map[string]string{}
	for _, doc := range documents(out) {
		var meta object
		if err := yaml.Unmarshal([]byte(doc), &meta); err != nil {
			return nil, err
		}
		switch meta.Kind {
		case "CustomResourceDefinition":
			files["crds/"+meta.Metadata.Name+".yaml"] = []byte(doc + "\n")
			continue
		case "Namespace":
			// The release's: helm install --namespace pvbridge-system --create-namespace.
			files["templates/namespace.yaml"] = []byte(fmt.Sprintf(namespaceCheck, meta.Metadata.Name))
			continue
		}
		doc, err = c.template(doc, meta.Kind, meta.Metadata.Name, refs, settings)
		if err != nil {
			return nil, fmt.Errorf("%s %s: %w", meta.Kind, meta.Metadata.Name, err)
		}
		if meta.Kind == "Deployment" || meta.Kind == "DaemonSet" {
			workloads = append(workloads, meta.workload())
			defines = append(defines, fmt.Sprintf("{{- define %q -}}\n%s\n{{- end }}", "pvbridge.workload."+meta.Metadata.Name, doc))
			doc = fmt.Sprintf(workloadTemplate, meta.Metadata.Name)
		}
		if strings.HasPrefix(meta.Metadata.Name, snapshotController) {
			doc = "{{- if .Values.snapshotController }}\n" + doc + "\n{{- end }}"
		}
		file := "templates/" + strings.ToLower(meta.Kind) + ".yaml"
		templates[file] = append(templates[file], doc)
	}
	for file, docs := range templates {
		files[file] = []byte(strings.Join(docs, "\n---\n") + "\n")
	}
	for _, s := range c.Settings {
		if _, ok := settings[s.Value]; !ok {
			return nil, fmt.Errorf("the overlay's output has no %s", s.Key)
		}
	}
	files["Chart.yaml"] = []byte(fmt.Sprintf(`# Generated from manifests/overlays/%s by make generate (e2e/charts); DO NOT EDIT.
apiVersion: v2
name: %s
description: %q
type: application
version: %s
appVersion: %s
`, c.Overlay, c.Name, c.Description, strings.TrimPrefix(version, "v"), version))
	if c.Test != "" {
		files["templates/tests/volume.yaml"] = []byte(c.Test)
		refs["volume-test"] = c.TestImage
	}
	_, defaults := settings[defaultClasses]
	files["values.yaml"] = c.values(refs, settings, defaults)
	files["README.md"] = c.readme(version, files["values.yaml"], workloads)
	schema, err := c.schema(workloads, defaults)
	if err != nil {
		return nil, err
	}
	files["values.schema.json"] = schema
	files["templates/NOTES.txt"] = []byte(c.Notes)
	files["templates/_helpers.tpl"] = []byte(helpers)
	files["templates/_workloads.tpl"] = []byte(strings.Join(defines, "\n") + "\n")
	return files, nil
}

// snapshotController names the CSI snapshot-controller's objects (its Deployment, service
// account and RBAC), which the value snapshotController leaves out.
const snapshotController = "snapshot-controller"

// workload is a Deployment or DaemonSet of the overlay, and its containers' names.
type workload struct {
	Name, Kind string
	Containers []string
}

// workloadTemplate prints workload %[1]s: its object (the named template of its overlay's text),
// with its values of .Values.workloads and .Values.imagePullSecrets set in.
const workloadTemplate = `{{ $obj := include "pvbridge.workload.%[1]s" . | fromYaml }}
{{- $w := index .Values.workloads %[1]q | default dict }}
{{- $pod := $obj.spec.template.spec }}
{{- if hasKey $w "replicas" }}{{ $_ := set $obj.spec "replicas" $w.replicas }}{{ end }}
{{- range $key := list "nodeSelector" "tolerations" "affinity" "priorityClassName" }}
{{- if hasKey $w $key }}{{ $_ := set $pod $key (index $w $key) }}{{ end }}
{{- end }}
{{- with .Values.imagePullSecrets }}{{ $_ := set $pod "imagePullSecrets" . }}{{ end }}
{{- range $c := concat ($pod.initContainers | default list) $pod.containers }}
{{- with index ($w.resources | default dict) $c.name }}{{ $_ := set $c "resources" . }}{{ end }}
{{- end }}
{{- toYaml $obj }}`

// object is what Make reads of an object of the overlay: its kind and name, and a workload's
// containers.
type object struct {
	Kind     string `json:"kind"`
	Metadata struct {
		Name string `json:"name"`
	} `json:"metadata"`
	Spec struct {
		Template struct {
			Spec struct {
				InitContainers []struct {
					Name string `json:"name"`
				} `json:"initContainers"`
				Containers []struct {
					Name string `json:"name"`
				} `json:"containers"`
			} `json:"spec"`
		} `json:"template"`
	} `json:"spec"`
}

// workload is o as a Deployment's or DaemonSet's name, kind and containers.
func (o object) workload() workload {
	w := workload{Name: o.Metadata.Name, Kind: o.Kind}
	for _, c := range append(o.Spec.Template.Spec.InitContainers, o.Spec.Template.Spec.Containers...) {
		w.Containers = append(w.Containers, c.Name)
	}
	return w
}

// namespaceCheck fails an install into another namespace than the overlay's (%s): its objects
// name it (RBAC subjects, flags), so they would not be where the release is.
const namespaceCheck = `{{- if ne .Release.Namespace %[1]q }}
{{- fail "install pvbridge into namespace %[1]s: helm install --namespace %[1]s --create-namespace" }}
{{- end }}
`

// helpers are the chart's named templates.
const helpers = `{{/* The image .name of .Values.images, from .Values.imageRegistry when it is set. */}}
{{- define "pvbridge.image" -}}
{{- $image := index .root.Values.images .name -}}
{{- if .root.Values.imageRegistry -}}
{{- regexReplaceAll "^[^/]+" $image .root.Values.imageRegistry -}}
{{- else -}}
{{- $image -}}
{{- end -}}
{{- end -}}
`

var (
	imageLine = regexp.MustCompile(`(?m)^(\s*(?:- )?image: )(\S+)$`)
	argsLine  = regexp.MustCompile(`(?m)^(\s*)- args:$`)
	// defaultLine marks a class its kind's default (StorageClass, VolumeSnapshotClass,
	// VolumeGroupSnapshotClass).
	defaultLine = regexp.MustCompile(`(?m)^(\s*[a-z.]*kubernetes\.io/is-default-class: )"true"$`)
)

// defaultClasses is the value that keeps the chart's default classes default.
const defaultClasses = "defaultClasses"

// template templates the values into doc, the text of one object of the overlay's output, and
// records the images and settings it found.
func (c Chart) template(doc, kind, name string, refs, settings map[string]string) (string, error) {
	doc = imageLine.ReplaceAllStringFunc(doc, func(line string) string {
		m := imageLine.FindStringSubmatch(line)
		key := imageKey(m[2])
		refs[key] = m[2]
		return m[1] + fmt.Sprintf(`{{ include "pvbridge.image" (dict "root" $ "name" %q) }}`, key)
	})
	if kind == "Deployment" || kind == "DaemonSet" {
		var err error
		if doc, err = extraArgs(doc, name); err != nil {
			return "", err
		}
	}
	if defaultLine.MatchString(doc) {
		settings[defaultClasses] = "true"
		doc = defaultLine.ReplaceAllString(doc, "${1}{{ .Values."+defaultClasses+" | toString | quote }}")
	}
	if kind == "ConfigMap" {
		for _, s := range c.Settings {
			prefix := "  " + s.Key + ": "
			i := strings.Index(doc, "\n"+prefix)
			if i < 0 {
				continue
			}
			line, _, _ := strings.Cut(doc[i+1:], "\n")
			settings[s.Value] = strings.TrimPrefix(line, prefix)
			doc = strings.Replace(doc, line, prefix+fmt.Sprintf("{{ .Values.%s | quote }}", s.Value), 1)
		}
	}
	return c.replaceHashedName(doc, c.hashTemplate()), nil
}

// replaceHashedName replaces the suffix of the hashed ConfigMap's name in text with suffix.
func (c Chart) replaceHashedName(text, suffix string) string {
	if c.HashedConfigMap == "" {
		return text
	}
	hashed := regexp.MustCompile(regexp.QuoteMeta(c.HashedConfigMap) + `-[a-z0-9]{10}\b`)
	return hashed.ReplaceAllLiteralString(text, c.HashedConfigMap+"-"+suffix)
}

// hashTemplate is the chart's suffix of the hashed ConfigMap's name.
func (c Chart) hashTemplate() string {
	var values []string
	for _, v := range c.HashOf {
		values = append(values, ".Values."+v)
	}
	return fmt.Sprintf("{{ list %s | toJson | sha256sum | trunc 10 }}", strings.Join(values, " "))
}

// imageKey names an image in values.yaml: the last element of its path.
func imageKey(image string) string {
	name, _, _ := strings.Cut(image, ":")
	return name[strings.LastIndexByte(name, '/')+1:]
}

// extraArgs appends the workload's extraArgs value to the arguments of its first container.
func extraArgs(doc, workload string) (string, error) {
	loc := argsLine.FindStringSubmatchIndex(doc)
	if loc == nil {
		return "", fmt.Errorf("no container with args")
	}
	indent := doc[loc[2]:loc[3]] + "  "
	end := loc[1] + 1 // the first line of the list
	for end < len(doc) && strings.HasPrefix(doc[end:], indent+"- ") {
		end += strings.IndexByte(doc[end:], '\n') + 1
	}
	with := fmt.Sprintf("{{- with index .Values.extraArgs %q }}\n{{ toYaml . | indent %d }}\n{{- end }}\n", workload, len(indent))
	return doc[:end] + with + doc[end:], nil
}

// values is the chart's values.yaml.
func (c Chart) values(refs, settings map[string]string, defaults bool) []byte {
	var b bytes.Buffer
	fmt.Fprintf(&b, "# Generated from manifests/overlays/%s by make generate (e2e/charts); DO NOT EDIT.\n", c.Overlay)
	for _, s := range c.Settings {
		fmt.Fprintf(&b, "\n# %s\n%s: %s\n", s.Doc, s.Value, settings[s.Value])
	}
	b.WriteString("\n# Replaces the registry of every image below when set: a mirror that keeps the images' paths\n# (mirror.example.com/pvbridge/mgmt-csi for ghcr.io/pvbridge/mgmt-csi).\nimageRegistry: \"\"\n")
	b.WriteString("\n# The images, by name.\nimages:\n")
	for _, k := range slices.Sorted(maps.Keys(refs)) {
		fmt.Fprintf(&b, "  %s: %s\n", k, refs[k])
	}
	b.WriteString("\n# More arguments of the main container of a workload, by workload name; a flag given again\n# overrides the shipped value (e.g. mgmt-csi-node: [--pmem-mode=lvm]).\nextraArgs: {}\n")
	b.WriteString(`
# Per workload, by name: replicas (Deployments), resources by container name, nodeSelector,
# tolerations, affinity and priorityClassName, each replacing the shipped one (values.schema.json
# names the workloads and their containers), e.g.
#   workloads:
#     mgmt-csi-node:
#       nodeSelector: {vm.pvbridge.io/host: "true", example.com/pmem: "true"}
#       resources: {mgmt-csi: {requests: {cpu: 50m}, limits: {memory: 1Gi}}}
workloads: {}

# Secrets every pod pulls its images with (a private mirror), e.g. [{name: mirror-credentials}].
imagePullSecrets: []

# The CSI snapshot-controller; false where the cluster runs one already (two would race). The
# snapshot CRDs are in crds/: helm install --skip-crds leaves them out.
snapshotController: true
`)
	if defaults {
		b.WriteString("\n# The chart's classes marked their kind's default (is-default-class) stay so; false where the\n# cluster has defaults of its own (two defaults of one kind are ambiguous).\n" + defaultClasses + ": true\n")
	}
	if c.Test != "" {
		test, err := yaml.Marshal(map[string]any{"test": c.TestValues})
		if err != nil {
			panic(err) // maps of strings
		}
		b.WriteString("\n# helm test: a claim of storageClass, written and read by a pod (image volume-test) on a node\n# of nodeSelector.\n")
		b.Write(test)
	}
	return b.Bytes()
}

// readme is the chart's README.md: what it installs, the install command with its required
// values, what helm does not do, the workloads and containers its values name, and its
// values.yaml.
func (c Chart) readme(version string, values []byte, workloads []workload) []byte {
	var b bytes.Buffer
	fmt.Fprintf(&b, "<!-- Generated from manifests/overlays/%s by make generate (e2e/charts); DO NOT EDIT. -->\n", c.Overlay)
	fmt.Fprintf(&b, "# %s %s\n\n%s.\n\nThe chart is made from the kustomize overlay `manifests/overlays/%s` and renders the same\nobjects (`make verify` checks it); docs/deployment.md is the whole procedure.\n\n",
		c.Name, version, c.Description, c.Overlay)
	b.WriteString("## Install\n\n```\n")
	fmt.Fprintf(&b, "helm install pvbridge charts/%s --namespace %s --create-namespace", c.Name, Namespace)
	for _, st := range c.Settings {
		fmt.Fprintf(&b, " \\\n  --set %s=%s", st.Value, st.Example)
	}
	b.WriteString("\n```\n\n")
	for _, st := range c.Settings {
		fmt.Fprintf(&b, "- `%s`: %s\n", st.Value, st.Doc)
	}
	fmt.Fprintf(&b, `- It installs into namespace %[1]s only (its objects name it), and refuses another.
- Its node pods are privileged: where Pod Security Admission enforces a stricter level by
  default, label the namespace `+"`pod-security.kubernetes.io/enforce=privileged`"+`.
- helm installs the CRDs in `+"`crds/`"+` but never upgrades them: before `+"`helm upgrade`"+`, run
  `+"`kubectl apply --server-side -f <the new chart>/crds`"+`. `+"`--skip-crds`"+` leaves them out.
- `+"`values.schema.json`"+` types every value and refuses an unknown one and the placeholders.
%[2]s
## Workloads

The names `+"`workloads`"+` and `+"`extraArgs`"+` take, and their containers (`+"`workloads.<name>.resources`"+`
is by container):

| workload | kind | containers |
|---|---|---|
`, Namespace, c.testNote())
	for _, w := range workloads {
		fmt.Fprintf(&b, "| `%s` | %s | %s |\n", w.Name, w.Kind, strings.Join(w.Containers, ", "))
	}
	b.WriteString("\n## Values\n\n```yaml\n")
	b.Write(values)
	b.WriteString("```\n")
	return b.Bytes()
}

// testNote is the README's line on the chart's helm test, if it has one.
func (c Chart) testNote() string {
	if c.Test == "" {
		return ""
	}
	return "- `helm test pvbridge --namespace " + Namespace + "` checks the install: a claim of class `test.storageClass`\n" +
		"  (a 16 MiB volume) and a pod (image `volume-test`) on a node of `test.nodeSelector` that writes and\n" +
		"  reads it; both go once it passed. Run it after an install or upgrade.\n"
}

// schema is the chart's values.schema.json.
func (c Chart) schema(workloads []workload, defaults bool) ([]byte, error) {
	perWorkload := map[string]any{}
	for _, w := range workloads {
		resources := map[string]any{}
		for _, name := range w.Containers {
			resources[name] = map[string]any{"type": "object", "description": "the resources of container " + name}
		}
		props := map[string]any{
			"resources": map[string]any{"type": "object", "properties": resources, "additionalProperties": false,
				"description": "resources by container name"},
			"nodeSelector":      map[string]any{"type": "object", "additionalProperties": map[string]any{"type": "string"}},
			"tolerations":       map[string]any{"type": "array", "items": map[string]any{"type": "object"}},
			"affinity":          map[string]any{"type": "object"},
			"priorityClassName": map[string]any{"type": "string"},
		}
		if w.Kind == "Deployment" {
			props["replicas"] = map[string]any{"type": "integer", "minimum": 0}
		}
		perWorkload[w.Name] = map[string]any{"type": "object", "properties": props, "additionalProperties": false}
	}
	properties := map[string]any{
		"imageRegistry": map[string]any{"type": "string", "description": "a mirror's registry for every image"},
		"images": map[string]any{
			"type": "object", "additionalProperties": map[string]any{"type": "string", "minLength": 1},
			"description": "each image by name",
		},
		"extraArgs": map[string]any{
			"type": "object", "additionalProperties": map[string]any{"type": "array", "items": map[string]any{"type": "string"}},
			"description": "more arguments of a workload's main container, by workload name",
		},
		"workloads": map[string]any{
			"type": "object", "properties": perWorkload, "additionalProperties": false,
			"description": "per workload: replicas, resources by container, nodeSelector, tolerations, affinity, priorityClassName",
		},
		"imagePullSecrets": map[string]any{
			"type": "array", "description": "the secrets every pod pulls its images with",
			"items": map[string]any{"type": "object", "properties": map[string]any{"name": map[string]any{"type": "string", "minLength": 1}},
				"required": []string{"name"}, "additionalProperties": false},
		},
		"snapshotController": map[string]any{"type": "boolean", "description": "install the CSI snapshot-controller"},
	}
	if defaults {
		properties[defaultClasses] = map[string]any{"type": "boolean", "description": "keep the chart's default classes default"}
	}
	if c.Test != "" {
		properties["test"] = map[string]any{
			"type": "object", "additionalProperties": false, "required": []string{"storageClass"},
			"description": "helm test: the class of its claim, the nodes of its pod",
			"properties": map[string]any{
				"storageClass": map[string]any{"type": "string", "minLength": 1},
				"nodeSelector": map[string]any{"type": "object", "additionalProperties": map[string]any{"type": "string"}},
			},
		}
	}
	required := []string{"images"}
	for _, s := range c.Settings {
		properties[s.Value] = s.Schema
		required = append(required, s.Value)
	}
	out, err := json.MarshalIndent(map[string]any{
		"$schema":              "https://json-schema.org/draft-07/schema#",
		"type":                 "object",
		"properties":           properties,
		"required":             required,
		"additionalProperties": false,
	}, "", "  ")
	return append(out, '\n'), err
}

// kustomize is kubectl kustomize of the overlay.
func kustomize(kubectl, root, overlay string) (string, error) {
	out, err := output(kubectl, "kustomize", filepath.Join(root, "manifests", "overlays", overlay))
	return string(out), err
}

// documents splits a stream of YAML documents.
func documents(stream string) []string {
	var docs []string
	for _, d := range strings.Split("\n"+stream, "\n---\n") {
		if d = strings.TrimLeft(d, "\n"); strings.TrimSpace(d) != "" {
			docs = append(docs, d)
		}
	}
	return docs
}

// output runs a command and returns its standard output, or an error with its standard error.
func output(name string, args ...string) ([]byte, error) {
	var stderr bytes.Buffer
	cmd := exec.Command(name, args...)
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("%s %s: %w: %s", filepath.Base(name), strings.Join(args, " "), err, stderr.Bytes())
	}
	return out, nil
}

// Check renders the chart in dir with helm (its default values and CRDs) and fails unless it
// makes the objects of its overlay, the hashed ConfigMap's name aside, and helm lint passes it.
func (c Chart) Check(helm, kubectl, root, dir string) error {
	var examples []string
	for _, s := range c.Settings {
		examples = append(examples, "--set", s.Value+"="+s.Example)
	}
	if out, err := exec.Command(helm, append([]string{"lint", "--strict", "--namespace", Namespace, dir}, examples...)...).CombinedOutput(); err != nil {
		return fmt.Errorf("helm lint %s: %w\n%s", dir, err, out)
	}
	if err := c.checkSchema(helm, dir); err != nil {
		return err
	}
	if err := c.checkNoDefaults(helm, dir); err != nil {
		return err
	}
	// The overlay's own values, its placeholders included, which the schema refuses.
	// Without the tests, which are no objects of the overlay.
	rendered, err := output(helm, "template", "pvbridge", dir, "--include-crds", "--skip-tests", "--namespace", Namespace, "--skip-schema-validation")
	if err != nil {
		return err
	}
	built, err := kustomize(kubectl, root, c.Overlay)
	if err != nil {
		return err
	}
	want, err := c.objects(built)
	if err != nil {
		return fmt.Errorf("the overlay %s: %w", c.Overlay, err)
	}
	got, err := c.objects(string(rendered))
	if err != nil {
		return fmt.Errorf("chart %s: %w", c.Name, err)
	}
	var diffs []string
	for _, k := range slices.Sorted(maps.Keys(want)) {
		switch g, ok := got[k]; {
		case !ok && strings.Contains(k, " Namespace /"+Namespace):
			// helm install --create-namespace makes it.
		case !ok:
			diffs = append(diffs, k+": missing from the chart")
		case !reflect.DeepEqual(g, want[k]):
			diffs = append(diffs, k+": differs")
		}
	}
	for k := range got {
		if _, ok := want[k]; !ok {
			diffs = append(diffs, k+": not in the overlay")
		}
	}
	if len(diffs) > 0 {
		slices.Sort(diffs)
		return fmt.Errorf("chart %s does not make the objects of overlay %s:\n  %s", c.Name, c.Overlay, strings.Join(diffs, "\n  "))
	}
	return nil
}

// checkNoDefaults fails unless defaultClasses=false leaves no class of the chart its kind's default.
func (c Chart) checkNoDefaults(helm, dir string) error {
	out, err := output(helm, "template", "pvbridge", dir, "--namespace", Namespace, "--skip-schema-validation", "--set", defaultClasses+"=false")
	if err != nil {
		return err
	}
	if defaultLine.Match(out) {
		return fmt.Errorf("chart %s with %s=false still marks a class default", c.Name, defaultClasses)
	}
	return nil
}

// checkSchema fails unless the chart in dir refuses each setting's placeholder (its default)
// where the schema says so, and takes the settings' examples.
func (c Chart) checkSchema(helm, dir string) error {
	var examples []string
	for _, s := range c.Settings {
		examples = append(examples, "--set", s.Value+"="+s.Example)
	}
	template := []string{"template", "pvbridge", dir, "--namespace", Namespace}
	if _, err := output(helm, append(template, examples...)...); err != nil {
		return fmt.Errorf("chart %s refuses the examples of its settings: %w", c.Name, err)
	}
	for i, s := range c.Settings {
		if _, refuses := s.Schema["not"]; !refuses {
			continue
		}
		// The others' examples, this one's default.
		args := append(slices.Clone(template), slices.Delete(slices.Clone(examples), 2*i, 2*i+2)...)
		_, err := output(helm, args...)
		if err == nil {
			return fmt.Errorf("chart %s takes the placeholder of %s", c.Name, s.Value)
		}
		if !strings.Contains(err.Error(), s.Value) {
			return fmt.Errorf("chart %s refuses the placeholder of %s with an error that does not name it: %w", c.Name, s.Value, err)
		}
	}
	return nil
}

// objects are the objects of a stream by kind, namespace and name, with the hashed ConfigMap's
// name suffix replaced by "hash".
func (c Chart) objects(stream string) (map[string]any, error) {
	objects := map[string]any{}
	for _, doc := range documents(c.replaceHashedName(stream, "hash")) {
		var o unstructured.Unstructured
		if err := yaml.Unmarshal([]byte(doc), &o.Object); err != nil {
			return nil, err
		}
		if o.GetKind() == "" {
			continue // only comments
		}
		objects[fmt.Sprintf("%s %s %s/%s", o.GetAPIVersion(), o.GetKind(), o.GetNamespace(), o.GetName())] = o.Object
	}
	return objects, nil
}

// Write replaces dir with files.
func (f Files) Write(dir string) error {
	if err := os.RemoveAll(dir); err != nil {
		return err
	}
	for name, data := range f {
		path := filepath.Join(dir, name)
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			return err
		}
		if err := os.WriteFile(path, data, 0o644); err != nil {
			return err
		}
	}
	return nil
}
