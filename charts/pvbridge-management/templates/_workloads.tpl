{{- define "pvbridge.workload.guest-csi-tenants" -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  labels:
    app.kubernetes.io/component: controller
    app.kubernetes.io/name: guest-csi-tenants
    app.kubernetes.io/part-of: pvbridge
  name: guest-csi-tenants
  namespace: pvbridge-system
spec:
  replicas: 2
  selector:
    matchLabels:
      app.kubernetes.io/component: controller
      app.kubernetes.io/name: guest-csi-tenants
  template:
    metadata:
      labels:
        app.kubernetes.io/component: controller
        app.kubernetes.io/name: guest-csi-tenants
        app.kubernetes.io/part-of: pvbridge
    spec:
      affinity:
        podAntiAffinity:
          preferredDuringSchedulingIgnoredDuringExecution:
          - podAffinityTerm:
              labelSelector:
                matchLabels:
                  app.kubernetes.io/component: controller
                  app.kubernetes.io/name: guest-csi-tenants
              topologyKey: kubernetes.io/hostname
            weight: 100
      containers:
      - args:
        - --mgmt-server=$(MGMT_SERVER)
        - --capacity-namespace=pvbridge-system
        - --guest-namespace=pvbridge-system
        - --token-ttl=24h
        - --leader-elect=true
        - --leader-election-namespace=pvbridge-system
        - --metrics-bind-address=:8080
        - --health-probe-bind-address=:8081
        - --kube-api-qps=20
        - --kube-api-burst=40
        - --v=2
{{- with index .Values.extraArgs "guest-csi-tenants" }}
{{ toYaml . | indent 8 }}
{{- end }}
        env:
        - name: MGMT_SERVER
          valueFrom:
            configMapKeyRef:
              key: mgmt-server
              name: pvbridge-tenants-{{ list .Values.mgmtServer | toJson | sha256sum | trunc 10 }}
        image: {{ include "pvbridge.image" (dict "root" $ "name" "guest-csi-tenants") }}
        livenessProbe:
          httpGet:
            path: /healthz
            port: health
          initialDelaySeconds: 10
          periodSeconds: 20
        name: guest-csi-tenants
        ports:
        - containerPort: 8080
          name: metrics
        - containerPort: 8081
          name: health
        readinessProbe:
          httpGet:
            path: /readyz
            port: health
          periodSeconds: 10
        resources:
          limits:
            memory: 512Mi
          requests:
            cpu: 20m
            memory: 64Mi
        securityContext:
          allowPrivilegeEscalation: false
          capabilities:
            drop:
            - ALL
          readOnlyRootFilesystem: true
      priorityClassName: system-cluster-critical
      securityContext:
        runAsGroup: 65532
        runAsNonRoot: true
        runAsUser: 65532
        seccompProfile:
          type: RuntimeDefault
      serviceAccountName: guest-csi-tenants
{{- end }}
{{- define "pvbridge.workload.mgmt-csi-controller" -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  labels:
    app.kubernetes.io/component: controller
    app.kubernetes.io/name: mgmt-csi
    app.kubernetes.io/part-of: pvbridge
  name: mgmt-csi-controller
  namespace: pvbridge-system
spec:
  replicas: 2
  selector:
    matchLabels:
      app.kubernetes.io/component: controller
      app.kubernetes.io/name: mgmt-csi
  template:
    metadata:
      labels:
        app.kubernetes.io/component: controller
        app.kubernetes.io/name: mgmt-csi
        app.kubernetes.io/part-of: pvbridge
    spec:
      affinity:
        podAntiAffinity:
          preferredDuringSchedulingIgnoredDuringExecution:
          - podAffinityTerm:
              labelSelector:
                matchLabels:
                  app.kubernetes.io/component: controller
                  app.kubernetes.io/name: mgmt-csi
              topologyKey: kubernetes.io/hostname
            weight: 100
      containers:
      - args:
        - --mode=controller
        - --leader-election
        - --endpoint=unix:///csi/csi.sock
        - --health-address=:9808
        - --metrics-address=:8090
        - --kube-api-qps=50
        - --kube-api-burst=100
        - --v=2
{{- with index .Values.extraArgs "mgmt-csi-controller" }}
{{ toYaml . | indent 8 }}
{{- end }}
        image: {{ include "pvbridge.image" (dict "root" $ "name" "mgmt-csi") }}
        livenessProbe:
          failureThreshold: 5
          httpGet:
            path: /healthz
            port: healthz
          initialDelaySeconds: 10
          periodSeconds: 20
          timeoutSeconds: 3
        name: mgmt-csi
        ports:
        - containerPort: 8090
          name: metrics
        - containerPort: 9808
          name: healthz
        readinessProbe:
          httpGet:
            path: /readyz
            port: healthz
          periodSeconds: 10
          timeoutSeconds: 3
        resources:
          limits:
            memory: 512Mi
          requests:
            cpu: 20m
            memory: 64Mi
        securityContext:
          allowPrivilegeEscalation: false
          capabilities:
            drop:
            - ALL
          readOnlyRootFilesystem: true
        volumeMounts:
        - mountPath: /csi
          name: socket-dir
      - args:
        - --csi-address=/csi/csi.sock
        - --leader-election
        - --http-endpoint=:8080
        - --timeout=30s
        - --retry-interval-max=30s
        - --feature-gates=Topology=true
        - --strict-topology
        - --immediate-topology=false
        - --enable-capacity
        - --capacity-ownerref-level=2
        - --capacity-poll-interval=5s
        - --extra-create-metadata
        - --default-fstype=ext4
        - --kube-api-qps=50
        - --kube-api-burst=100
        - --v=3
        env:
        - name: NAMESPACE
          valueFrom:
            fieldRef:
              fieldPath: metadata.namespace
        - name: POD_NAME
          valueFrom:
            fieldRef:
              fieldPath: metadata.name
        image: {{ include "pvbridge.image" (dict "root" $ "name" "csi-provisioner") }}
        livenessProbe:
          failureThreshold: 3
          httpGet:
            path: /healthz/leader-election
            port: 8080
          periodSeconds: 20
          timeoutSeconds: 10
        name: csi-provisioner
        ports:
        - containerPort: 8080
          name: provisioner
        resources:
          limits:
            memory: 256Mi
          requests:
            cpu: 10m
            memory: 32Mi
        securityContext:
          allowPrivilegeEscalation: false
          capabilities:
            drop:
            - ALL
          readOnlyRootFilesystem: true
        volumeMounts:
        - mountPath: /csi
          name: socket-dir
      - args:
        - --csi-address=/csi/csi.sock
        - --leader-election
        - --http-endpoint=:8081
        - --timeout=30s
        - --retry-interval-max=30s
        - --kube-api-qps=50
        - --kube-api-burst=100
        - --worker-threads=100
        - --v=3
        image: {{ include "pvbridge.image" (dict "root" $ "name" "csi-attacher") }}
        livenessProbe:
          failureThreshold: 3
          httpGet:
            path: /healthz/leader-election
            port: 8081
          periodSeconds: 20
          timeoutSeconds: 10
        name: csi-attacher
        ports:
        - containerPort: 8081
          name: attacher
        resources:
          limits:
            memory: 256Mi
          requests:
            cpu: 10m
            memory: 32Mi
        securityContext:
          allowPrivilegeEscalation: false
          capabilities:
            drop:
            - ALL
          readOnlyRootFilesystem: true
        volumeMounts:
        - mountPath: /csi
          name: socket-dir
      - args:
        - --csi-address=/csi/csi.sock
        - --leader-election
        - --http-endpoint=:8082
        - --timeout=30s
        - --retry-interval-max=30s
        - --handle-volume-inuse-error=false
        - --extra-modify-metadata
        - --kube-api-qps=50
        - --kube-api-burst=100
        - --v=3
        image: {{ include "pvbridge.image" (dict "root" $ "name" "csi-resizer") }}
        livenessProbe:
          failureThreshold: 3
          httpGet:
            path: /healthz/leader-election
            port: 8082
          periodSeconds: 20
          timeoutSeconds: 10
        name: csi-resizer
        ports:
        - containerPort: 8082
          name: resizer
        resources:
          limits:
            memory: 256Mi
          requests:
            cpu: 10m
            memory: 32Mi
        securityContext:
          allowPrivilegeEscalation: false
          capabilities:
            drop:
            - ALL
          readOnlyRootFilesystem: true
        volumeMounts:
        - mountPath: /csi
          name: socket-dir
      - args:
        - --csi-address=/csi/csi.sock
        - --leader-election
        - --http-endpoint=:8083
        - --timeout=30s
        - --retry-interval-max=30s
        - --extra-create-metadata
        - --kube-api-qps=50
        - --kube-api-burst=100
        - --v=3
        image: {{ include "pvbridge.image" (dict "root" $ "name" "csi-snapshotter") }}
        livenessProbe:
          failureThreshold: 3
          httpGet:
            path: /healthz/leader-election
            port: 8083
          periodSeconds: 20
          timeoutSeconds: 10
        name: csi-snapshotter
        ports:
        - containerPort: 8083
          name: snapshotter
        resources:
          limits:
            memory: 256Mi
          requests:
            cpu: 10m
            memory: 32Mi
        securityContext:
          allowPrivilegeEscalation: false
          capabilities:
            drop:
            - ALL
          readOnlyRootFilesystem: true
        volumeMounts:
        - mountPath: /csi
          name: socket-dir
      priorityClassName: system-cluster-critical
      securityContext:
        fsGroup: 65532
        runAsGroup: 65532
        runAsNonRoot: true
        runAsUser: 65532
        seccompProfile:
          type: RuntimeDefault
      serviceAccountName: mgmt-csi-controller
      volumes:
      - emptyDir: {}
        name: socket-dir
{{- end }}
{{- define "pvbridge.workload.snapshot-controller" -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  labels:
    app.kubernetes.io/name: snapshot-controller
    app.kubernetes.io/part-of: pvbridge
  name: snapshot-controller
  namespace: pvbridge-system
spec:
  replicas: 2
  selector:
    matchLabels:
      app.kubernetes.io/name: snapshot-controller
  template:
    metadata:
      labels:
        app.kubernetes.io/name: snapshot-controller
        app.kubernetes.io/part-of: pvbridge
    spec:
      containers:
      - args:
        - --v=3
        - --leader-election=true
        - --leader-election-namespace=$(NAMESPACE)
        - --http-endpoint=:8080
        - --retry-interval-max=30s
        - --kube-api-qps=50
        - --kube-api-burst=100
{{- with index .Values.extraArgs "snapshot-controller" }}
{{ toYaml . | indent 8 }}
{{- end }}
        env:
        - name: NAMESPACE
          valueFrom:
            fieldRef:
              fieldPath: metadata.namespace
        image: {{ include "pvbridge.image" (dict "root" $ "name" "snapshot-controller") }}
        livenessProbe:
          failureThreshold: 3
          httpGet:
            path: /healthz/leader-election
            port: http
          periodSeconds: 20
          timeoutSeconds: 10
        name: snapshot-controller
        ports:
        - containerPort: 8080
          name: http
        resources:
          limits:
            memory: 256Mi
          requests:
            cpu: 10m
            memory: 32Mi
        securityContext:
          allowPrivilegeEscalation: false
          capabilities:
            drop:
            - ALL
          readOnlyRootFilesystem: true
      priorityClassName: system-cluster-critical
      securityContext:
        runAsNonRoot: true
        seccompProfile:
          type: RuntimeDefault
      serviceAccountName: snapshot-controller
{{- end }}
{{- define "pvbridge.workload.vm-operator-controller" -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  labels:
    app.kubernetes.io/component: controller
    app.kubernetes.io/name: vm-operator
    app.kubernetes.io/part-of: pvbridge
  name: vm-operator-controller
  namespace: pvbridge-system
spec:
  replicas: 2
  selector:
    matchLabels:
      app.kubernetes.io/component: controller
      app.kubernetes.io/name: vm-operator
  template:
    metadata:
      labels:
        app.kubernetes.io/component: controller
        app.kubernetes.io/name: vm-operator
        app.kubernetes.io/part-of: pvbridge
    spec:
      affinity:
        podAntiAffinity:
          preferredDuringSchedulingIgnoredDuringExecution:
          - podAffinityTerm:
              labelSelector:
                matchLabels:
                  app.kubernetes.io/component: controller
                  app.kubernetes.io/name: vm-operator
              topologyKey: kubernetes.io/hostname
            weight: 100
      containers:
      - args:
        - --role=controller
        - --leader-elect
        - --metrics-bind-address=:8080
        - --health-probe-bind-address=:8081
        - --kube-api-qps=50
        - --kube-api-burst=100
        - --v=2
{{- with index .Values.extraArgs "vm-operator-controller" }}
{{ toYaml . | indent 8 }}
{{- end }}
        image: {{ include "pvbridge.image" (dict "root" $ "name" "vm-operator") }}
        livenessProbe:
          httpGet:
            path: /healthz
            port: health
          initialDelaySeconds: 10
          periodSeconds: 20
        name: vm-operator
        ports:
        - containerPort: 8080
          name: metrics
        - containerPort: 8081
          name: health
        readinessProbe:
          httpGet:
            path: /readyz
            port: health
          periodSeconds: 10
        resources:
          limits:
            memory: 512Mi
          requests:
            cpu: 20m
            memory: 64Mi
        securityContext:
          allowPrivilegeEscalation: false
          capabilities:
            drop:
            - ALL
          readOnlyRootFilesystem: true
      priorityClassName: system-cluster-critical
      securityContext:
        runAsGroup: 65532
        runAsNonRoot: true
        runAsUser: 65532
        seccompProfile:
          type: RuntimeDefault
      serviceAccountName: vm-operator-controller
{{- end }}
{{- define "pvbridge.workload.mgmt-csi-node" -}}
apiVersion: apps/v1
kind: DaemonSet
metadata:
  labels:
    app.kubernetes.io/component: node
    app.kubernetes.io/name: mgmt-csi
    app.kubernetes.io/part-of: pvbridge
  name: mgmt-csi-node
  namespace: pvbridge-system
spec:
  selector:
    matchLabels:
      app.kubernetes.io/component: node
      app.kubernetes.io/name: mgmt-csi
  template:
    metadata:
      labels:
        app.kubernetes.io/component: node
        app.kubernetes.io/name: mgmt-csi
        app.kubernetes.io/part-of: pvbridge
    spec:
      containers:
      - args:
        - --mode=node
        - --node-id=$(NODE_NAME)
        - --endpoint=unix:///var/lib/kubelet/plugins/pmem.csi.pvbridge.io/csi.sock
        - --kubelet-registration-dir=/var/lib/kubelet/plugins_registry
        - --health-address=:9808
        - --pmem-mode=ndctl
        - --metrics-address=:8090
        - --replica-address=$(HOST_IP):10809
        - --replica-keys-dir=/etc/pvbridge/replica-keys
        - --run-dir=/run/pvbridge/mgmt-csi
        - --daemon-netns=/proc/1/ns/net
        - --daemon-cgroup-parent=pvbridge-mgmt-csi
        - --cgroup-root=/host/sys/fs/cgroup
        - --v=2
{{- with index .Values.extraArgs "mgmt-csi-node" }}
{{ toYaml . | indent 8 }}
{{- end }}
        env:
        - name: NODE_NAME
          valueFrom:
            fieldRef:
              fieldPath: spec.nodeName
        - name: HOST_IP
          valueFrom:
            fieldRef:
              fieldPath: status.hostIP
        image: {{ include "pvbridge.image" (dict "root" $ "name" "mgmt-csi") }}
        livenessProbe:
          failureThreshold: 5
          httpGet:
            path: /healthz
            port: healthz
          initialDelaySeconds: 10
          periodSeconds: 20
          timeoutSeconds: 3
        name: mgmt-csi
        ports:
        - containerPort: 8090
          name: metrics
        - containerPort: 9808
          name: healthz
        readinessProbe:
          httpGet:
            path: /healthz
            port: healthz
          periodSeconds: 10
          timeoutSeconds: 3
        resources:
          limits:
            memory: 512Mi
          requests:
            cpu: 20m
            memory: 64Mi
        securityContext:
          privileged: true
          readOnlyRootFilesystem: true
        volumeMounts:
        - mountPath: /var/lib/kubelet/plugins_registry
          name: registration-dir
        - mountPath: /var/lib/kubelet/pods
          mountPropagation: Bidirectional
          name: pods-dir
        - mountPath: /var/lib/kubelet/plugins
          mountPropagation: Bidirectional
          name: plugins-dir
        - mountPath: /var/lib/pvbridge
          mountPropagation: Bidirectional
          name: pvbridge-dir
        - mountPath: /dev
          name: dev
        - mountPath: /sys
          name: sys
        - mountPath: /run/pvbridge
          mountPropagation: Bidirectional
          name: run-dir
        - mountPath: /etc/pvbridge/replica-keys
          name: replica-keys
          readOnly: true
        - mountPath: /host/sys/fs/cgroup
          name: host-cgroup
      hostPID: true
      nodeSelector:
        vm.pvbridge.io/host: "true"
      priorityClassName: system-node-critical
      serviceAccountName: mgmt-csi-node
      tolerations:
      - operator: Exists
      volumes:
      - hostPath:
          path: /var/lib/kubelet/plugins_registry
          type: Directory
        name: registration-dir
      - hostPath:
          path: /var/lib/kubelet/pods
          type: Directory
        name: pods-dir
      - hostPath:
          path: /var/lib/kubelet/plugins
          type: Directory
        name: plugins-dir
      - hostPath:
          path: /var/lib/pvbridge
          type: DirectoryOrCreate
        name: pvbridge-dir
      - hostPath:
          path: /dev
          type: Directory
        name: dev
      - hostPath:
          path: /sys
          type: Directory
        name: sys
      - hostPath:
          path: /run/pvbridge
          type: DirectoryOrCreate
        name: run-dir
      - name: replica-keys
        secret:
          optional: true
          secretName: mgmt-csi-replica-keys
      - hostPath:
          path: /sys/fs/cgroup
          type: Directory
        name: host-cgroup
  updateStrategy:
    rollingUpdate:
      maxUnavailable: 1
    type: RollingUpdate
{{- end }}
{{- define "pvbridge.workload.vm-operator-host-agent" -}}
apiVersion: apps/v1
kind: DaemonSet
metadata:
  labels:
    app.kubernetes.io/component: host-agent
    app.kubernetes.io/name: vm-operator
    app.kubernetes.io/part-of: pvbridge
  name: vm-operator-host-agent
  namespace: pvbridge-system
spec:
  selector:
    matchLabels:
      app.kubernetes.io/component: host-agent
      app.kubernetes.io/name: vm-operator
  template:
    metadata:
      labels:
        app.kubernetes.io/component: host-agent
        app.kubernetes.io/name: vm-operator
        app.kubernetes.io/part-of: pvbridge
    spec:
      containers:
      - args:
        - --role=host-agent
        - --node-name=$(NODE_NAME)
        - --hypervisor=qemu
        - --qemu-run-dir=/var/lib/pvbridge/qemu
        - --qemu-image-dir=/var/lib/pvbridge/images
        - --qemu-network=user
        - --qemu-netns=/proc/1/ns/net
        - --qemu-cgroup-parent=pvbridge-vms
        - --qemu-cgroup-root=/host/sys/fs/cgroup
        - --csi-endpoint=unix:///var/lib/kubelet/plugins/pmem.csi.pvbridge.io/csi.sock
        - --state-dir=/var/lib/pvbridge/host-agent
        - --unplug-timeout=5m
        - --metrics-bind-address=:8080
        - --health-probe-bind-address=:8081
        - --v=2
{{- with index .Values.extraArgs "vm-operator-host-agent" }}
{{ toYaml . | indent 8 }}
{{- end }}
        env:
        - name: NODE_NAME
          valueFrom:
            fieldRef:
              fieldPath: spec.nodeName
        image: {{ include "pvbridge.image" (dict "root" $ "name" "vm-operator") }}
        livenessProbe:
          httpGet:
            path: /healthz
            port: health
          initialDelaySeconds: 10
          periodSeconds: 20
        name: host-agent
        ports:
        - containerPort: 8080
          name: metrics
        - containerPort: 8081
          name: health
        readinessProbe:
          httpGet:
            path: /readyz
            port: health
          periodSeconds: 10
        resources:
          limits:
            memory: 512Mi
          requests:
            cpu: 20m
            memory: 64Mi
        securityContext:
          privileged: true
          readOnlyRootFilesystem: true
        volumeMounts:
        - mountPath: /var/lib/kubelet/plugins/pmem.csi.pvbridge.io
          name: mgmt-csi-socket
        - mountPath: /var/lib/pvbridge
          mountPropagation: Bidirectional
          name: pvbridge-dir
        - mountPath: /run/pvbridge
          name: run-dir
        - mountPath: /dev
          name: dev
        - mountPath: /host/sys/fs/cgroup
          name: host-cgroup
      hostPID: true
      nodeSelector:
        vm.pvbridge.io/host: "true"
      priorityClassName: system-node-critical
      serviceAccountName: vm-operator-host-agent
      tolerations:
      - operator: Exists
      volumes:
      - hostPath:
          path: /var/lib/kubelet/plugins/pmem.csi.pvbridge.io
          type: DirectoryOrCreate
        name: mgmt-csi-socket
      - hostPath:
          path: /var/lib/pvbridge
          type: DirectoryOrCreate
        name: pvbridge-dir
      - hostPath:
          path: /run/pvbridge
          type: DirectoryOrCreate
        name: run-dir
      - hostPath:
          path: /dev
          type: Directory
        name: dev
      - hostPath:
          path: /sys/fs/cgroup
          type: Directory
        name: host-cgroup
  updateStrategy:
    rollingUpdate:
      maxUnavailable: 1
    type: RollingUpdate
{{- end }}
