{{/* Names: <release>-radixmesh-<component>, or <release>-<component> when the release is named radixmesh... */}}
{{- define "radixmesh.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "radixmesh.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: radixmesh
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* Selector labels of one component: call with (dict "root" $ "component" "router") */}}
{{- define "radixmesh.selector" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "radixmesh.image" -}}
{{- printf "%s:%s" .Values.image.repository .Values.image.tag -}}
{{- end -}}

{{- define "radixmesh.apiKeySecret" -}}
{{- .Values.apiKey.existingSecret | default (printf "%s-api-key" (include "radixmesh.fullname" .)) -}}
{{- end -}}

{{- define "radixmesh.hasApiKey" -}}
{{- if or .Values.apiKey.value .Values.apiKey.existingSecret }}true{{ end -}}
{{- end -}}

{{- define "radixmesh.internalTokenSecret" -}}
{{- .Values.internalAuth.existingSecret | default (printf "%s-internal-token" (include "radixmesh.fullname" .)) -}}
{{- end -}}

{{/* The internal token of every radixmesh container, as an env list item. */}}
{{- define "radixmesh.internalTokenEnv" -}}
- name: RADIXMESH_INTERNAL_TOKEN
  valueFrom:
    secretKeyRef: {name: {{ include "radixmesh.internalTokenSecret" . }}, key: {{ .Values.internalAuth.secretKey }}}
{{- end -}}

{{/* Mutual TLS: the flags, the Secret's mount and its volume (list items; nothing without internalAuth.tls). */}}
{{- define "radixmesh.tlsArgs" -}}
{{- with .Values.internalAuth.tls }}
{{- if .existingSecret }}
- --tls-cert
- {{ printf "%s/tls.crt" .mountPath | quote }}
- --tls-key
- {{ printf "%s/tls.key" .mountPath | quote }}
- --tls-ca
- {{ printf "%s/ca.crt" .mountPath | quote }}
{{- with .serverName }}
- --tls-server-name
- {{ . | quote }}
{{- end }}
{{- end }}
{{- end }}
{{- end -}}

{{- define "radixmesh.tlsMountItems" -}}
{{- if .Values.internalAuth.tls.existingSecret }}
- {name: internal-tls, mountPath: {{ .Values.internalAuth.tls.mountPath | quote }}, readOnly: true}
{{- end }}
{{- end -}}

{{- define "radixmesh.tlsVolumeItems" -}}
{{- if .Values.internalAuth.tls.existingSecret }}
- name: internal-tls
  secret: {secretName: {{ .Values.internalAuth.tls.existingSecret | quote }}, defaultMode: 0440}
{{- end }}
{{- end -}}

{{- define "radixmesh.tokenizerUrl" -}}
{{- printf "%s-tokenizer:50051" (include "radixmesh.fullname" .) -}}
{{- end -}}

{{- define "radixmesh.kvstoreUrl" -}}
{{- printf "%s-kvstore:50051" (include "radixmesh.fullname" .) -}}
{{- end -}}

{{/* The worker roles this release runs: [worker] colocated, [prefill decode] with PD. */}}
{{- define "radixmesh.workerRoles" -}}
{{- if eq .Values.workers.mode "pd" }}prefill decode{{ else if eq .Values.workers.mode "colocated" }}worker{{ else -}}
{{- fail (printf "workers.mode must be colocated or pd, got %q" .Values.workers.mode) -}}
{{- end -}}
{{- end -}}

{{- define "radixmesh.routerPolicy" -}}
{{- .Values.router.policy | default (ternary "kv_index" "cache_aware" .Values.kvstore.enabled) -}}
{{- end -}}

{{/* Flags every radixmesh service takes: metrics, traces, log level, drain time, mutual TLS. */}}
{{- define "radixmesh.commonArgs" -}}
{{- if .Values.metrics.enabled }}
- --enable-metrics
- --metrics-port
- {{ .Values.metrics.port | quote }}
{{- end }}
{{- if .Values.tracing.enabled }}
- --enable-trace
{{- with .Values.tracing.otlpEndpoint }}
- --otlp-traces-endpoint
- {{ . | quote }}
{{- end }}
{{- with .Values.tracing.sampleRatio }}
- --trace-sample-ratio
- {{ . | quote }}
{{- end }}
{{- end }}
- --log-level
- {{ .Values.logLevel | quote }}
- --shutdown-grace-s
- {{ .Values.shutdownGraceS | quote }}
{{- include "radixmesh.tlsArgs" . }}
{{- end -}}

{{/* The stream lane (radixmesh/services/common/stream_lane.py) of a service the routers stream to (workers, tokenizer):
a fixed port, and the pod's own address, so a router that reaches the service through its Service name dials the pod
that granted the lane. Needs the POD_IP environment variable. */}}
{{- define "radixmesh.laneArgs" -}}
- --stream-lane-port
- "50052"
- --stream-lane-host
- $(POD_IP)
{{- end -}}

{{/* Container ports: the service's own, plus metrics. Call with (dict "root" $ "port" 50051 "name" "grpc") */}}
{{- define "radixmesh.ports" -}}
- name: {{ .name }}
  containerPort: {{ .port }}
  protocol: TCP
{{- if .root.Values.metrics.enabled }}
- name: metrics
  containerPort: {{ .root.Values.metrics.port }}
  protocol: TCP
{{- end }}
{{- end -}}

{{/* Probes of a gRPC service on grpc.health.v1 (NOT_SERVING while it drains); startup allows `seconds` to load.
The kubelet's gRPC probe cannot speak TLS: with internalAuth.tls the image's health probe runs instead, with the
pod's certificate. Call with (dict "root" $ "seconds" 300). */}}
{{- define "radixmesh.grpcProbes" -}}
{{- $how := "grpc: {port: 50051}" }}
{{- if .root.Values.internalAuth.tls.existingSecret }}
{{- $probe := list "python" "-m" "radixmesh.services.common.healthcheck" "--quiet" "--port" "50051" }}
{{- $how = printf "exec: {command: %s}" (concat $probe (include "radixmesh.tlsArgs" .root | fromYamlArray) | toJson) }}
{{- end -}}
startupProbe:
  {{ $how }}
  periodSeconds: 5
  timeoutSeconds: 5
  failureThreshold: {{ div .seconds 5 }}
readinessProbe:
  {{ $how }}
  periodSeconds: 5
  timeoutSeconds: 5
  failureThreshold: 2
livenessProbe:
  {{ $how }}
  periodSeconds: 10
  timeoutSeconds: 10
  failureThreshold: 6
{{- end -}}

{{/* Pod-level settings shared by every component. */}}
{{- define "radixmesh.podCommon" -}}
{{- with .Values.imagePullSecrets }}
imagePullSecrets: {{- toYaml . | nindent 2 }}
{{- end }}
securityContext: {{- toYaml .Values.podSecurityContext | nindent 2 }}
terminationGracePeriodSeconds: {{ add .Values.shutdownGraceS 15 }}
{{- with .Values.affinity }}
affinity: {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "radixmesh.scheduling" -}}
{{- with .nodeSelector }}
nodeSelector: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations: {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* A PodDisruptionBudget: (dict "root" $ "component" "router" "pdb" .Values.router.pdb) */}}
{{- define "radixmesh.pdb" -}}
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "radixmesh.fullname" .root }}-{{ .component }}
  labels:
    {{- include "radixmesh.labels" .root | nindent 4 }}
    app.kubernetes.io/component: {{ .component }}
spec:
  {{- if hasKey .pdb "minAvailable" }}
  minAvailable: {{ .pdb.minAvailable }}
  {{- else }}
  maxUnavailable: {{ .pdb.maxUnavailable | default 1 }}
  {{- end }}
  selector:
    matchLabels:
      {{- include "radixmesh.selector" (dict "root" .root "component" .component) | nindent 6 }}
{{- end -}}

{{/* A Service scraped by the ServiceMonitor carries these labels: radixmesh.io/service is its `service` label. */}}
{{- define "radixmesh.scrapeLabels" -}}
{{- if .root.Values.metrics.enabled }}
radixmesh.io/scrape: "true"
radixmesh.io/service: {{ .service }}
{{- end }}
{{- end -}}

{{/* The model volume (model.persistentVolumeClaim or model.hostPath) as list items: its mount, read-only at
model.mountPath, and the volume itself; nothing when the model is in the image. */}}
{{- define "radixmesh.modelMountItems" -}}
{{- if or .Values.model.persistentVolumeClaim .Values.model.hostPath }}
- {name: model, mountPath: {{ .Values.model.mountPath | quote }}, readOnly: true}
{{- end }}
{{- end -}}

{{- define "radixmesh.modelVolumeItems" -}}
{{- if .Values.model.persistentVolumeClaim }}
- name: model
  persistentVolumeClaim: {claimName: {{ .Values.model.persistentVolumeClaim | quote }}, readOnly: true}
{{- else if .Values.model.hostPath }}
- name: model
  hostPath: {path: {{ .Values.model.hostPath | quote }}, type: Directory}
{{- end }}
{{- end -}}
