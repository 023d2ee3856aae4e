{{- define "pvbridge.workload.guest-csi-controller" -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  labels:
    app.kubernetes.io/component: controller
    app.kubernetes.io/name: guest-csi
    app.kubernetes.io/part-of: pvbridge
  name: guest-csi-controller
  namespace: pvbridge-system
spec:
  replicas: 1
  selector:
    matchLabels:
      app.kubernetes.io/component: controller
      app.kubernetes.io/name: guest-csi
  template:
    metadata:
      labels:
        app.kubernetes.io/component: controller
        app.kubernetes.io/name: guest-csi
        app.kubernetes.io/part-of: pvbridge
    spec:
      containers:
      - args:
        - --mode=controller
        - --endpoint=unix:///csi/csi.sock
        - --health-address=:9808
        - --metrics-address=:8090
        - --cluster-name=$(CLUSTER_NAME)
        - --cluster-uid=$(CLUSTER_UID)
        - --mgmt-kubeconfig=/etc/pvbridge/mgmt/kubeconfig
        - --mgmt-capacity-namespace=pvbridge-system
        - --default-mgmt-storage-class=pmem
        - --default-mgmt-snapshot-class=pmem
        - --kube-api-qps=50
        - --kube-api-burst=100
        - --v=2
{{- with index .Values.extraArgs "guest-csi-controller" }}
{{ toYaml . | indent 8 }}
{{- end }}
        env:
        - name: CLUSTER_NAME
          valueFrom:
            configMapKeyRef:
              key: cluster-name
              name: pvbridge-cluster
        - name: CLUSTER_UID
          valueFrom:
            configMapKeyRef:
              key: cluster-uid
              name: pvbridge-cluster
        image: {{ include "pvbridge.image" (dict "root" $ "name" "guest-csi") }}
        livenessProbe:
          failureThreshold: 5
          httpGet:
            path: /healthz
            port: healthz
          initialDelaySeconds: 10
          periodSeconds: 20
          timeoutSeconds: 3
        name: guest-csi
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
        - mountPath: /etc/pvbridge/mgmt
          name: mgmt-credentials
          readOnly: true
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
      serviceAccountName: guest-csi-controller
      volumes:
      - emptyDir: {}
        name: socket-dir
      - name: mgmt-credentials
        secret:
          items:
          - key: kubeconfig
            path: kubeconfig
          secretName: pvbridge-mgmt-credentials
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
{{- define "pvbridge.workload.guest-csi-node" -}}
apiVersion: apps/v1
kind: DaemonSet
metadata:
  labels:
    app.kubernetes.io/component: node
    app.kubernetes.io/name: guest-csi
    app.kubernetes.io/part-of: pvbridge
  name: guest-csi-node
  namespace: pvbridge-system
spec:
  selector:
    matchLabels:
      app.kubernetes.io/component: node
      app.kubernetes.io/name: guest-csi
  template:
    metadata:
      labels:
        app.kubernetes.io/component: node
        app.kubernetes.io/name: guest-csi
        app.kubernetes.io/part-of: pvbridge
    spec:
      containers:
      - args:
        - --mode=node
        - --node-id=$(NODE_NAME)
        - --endpoint=unix:///var/lib/kubelet/plugins/guest.csi.pvbridge.io/csi.sock
        - --health-address=:9808
        - --metrics-address=:8090
        - --kubelet-registration-dir=/var/lib/kubelet/plugins_registry
        - --v=2
{{- with index .Values.extraArgs "guest-csi-node" }}
{{ toYaml . | indent 8 }}
{{- end }}
        env:
        - name: NODE_NAME
          valueFrom:
            fieldRef:
              fieldPath: spec.nodeName
        image: {{ include "pvbridge.image" (dict "root" $ "name" "guest-csi") }}
        livenessProbe:
          failureThreshold: 5
          httpGet:
            path: /healthz
            port: healthz
          initialDelaySeconds: 10
          periodSeconds: 20
          timeoutSeconds: 3
        name: guest-csi
        ports:
        - containerPort: 8090
          name: metrics
        - containerPort: 9808
          name: healthz
        resources:
          limits:
            memory: 256Mi
          requests:
            cpu: 10m
            memory: 32Mi
        securityContext:
          privileged: true
          readOnlyRootFilesystem: true
        volumeMounts:
        - mountPath: /var/lib/kubelet/plugins
          mountPropagation: Bidirectional
          name: plugins-dir
        - mountPath: /var/lib/kubelet/plugins_registry
          name: registration-dir
        - mountPath: /var/lib/kubelet/pods
          mountPropagation: Bidirectional
          name: pods-dir
        - mountPath: /dev
          name: dev
        - mountPath: /sys
          name: sys
      priorityClassName: system-node-critical
      serviceAccountName: guest-csi-node
      tolerations:
      - operator: Exists
      volumes:
      - hostPath:
          path: /var/lib/kubelet/plugins
          type: Directory
        name: plugins-dir
      - hostPath:
          path: /var/lib/kubelet/plugins_registry
          type: Directory
        name: registration-dir
      - hostPath:
          path: /var/lib/kubelet/pods
          type: Directory
        name: pods-dir
      - hostPath:
          path: /dev
          type: Directory
        name: dev
      - hostPath:
          path: /sys
          type: Directory
        name: sys
  updateStrategy:
    rollingUpdate:
      maxUnavailable: 1
    type: RollingUpdate
{{- end }}
