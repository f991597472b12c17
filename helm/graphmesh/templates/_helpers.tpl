{{- define "graphmesh.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The release "graphmesh" gives "graphmesh"; any other release name is prefixed to the chart name. */}}
{{- define "graphmesh.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "graphmesh.coordinator" -}}{{ include "graphmesh.fullname" . | trunc 51 }}-coordinator{{- end -}}
{{- define "graphmesh.executor" -}}{{ include "graphmesh.fullname" . | trunc 45 }}-executor{{- end -}}
{{- define "graphmesh.executorHeadless" -}}{{ include "graphmesh.executor" . }}-headless{{- end -}}
{{- /* 37 + "-draft-executor": the StatefulSet's controller-revision-hash label (name-<10>) stays within 63 */}}
{{- define "graphmesh.draft" -}}{{ include "graphmesh.fullname" . | trunc 37 | trimSuffix "-" }}-draft-executor{{- end -}}
{{- define "graphmesh.frontend" -}}{{ include "graphmesh.fullname" . | trunc 54 }}-frontend{{- end -}}
{{- define "graphmesh.kvstore" -}}{{ include "graphmesh.fullname" . | trunc 55 }}-kvstore{{- end -}}
{{- define "graphmesh.valkey" -}}{{ include "graphmesh.fullname" . | trunc 56 }}-valkey{{- end -}}
{{- define "graphmesh.etcd" -}}{{ include "graphmesh.fullname" . | trunc 58 }}-etcd{{- end -}}
{{- define "graphmesh.config" -}}{{ include "graphmesh.fullname" . | trunc 56 }}-config{{- end -}}

{{- define "graphmesh.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "graphmesh.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "graphmesh.tlsSecret" -}}
{{- default (printf "%s-tls" (include "graphmesh.fullname" .)) .Values.tls.existingSecret -}}
{{- end -}}

{{/* Whether tls.roleSecrets names a secret for every role. */}}
{{- define "graphmesh.tlsPerRoleSecrets" -}}
{{- $r := .Values.tls.roleSecrets -}}
{{- if and $r.coordinator $r.executor $r.kvstore }}true{{ end -}}
{{- end -}}

{{/* The TLS secret one component serves and calls with; pass (dict "ctx" $ "component" "executor"), and "role" when
     the component serves another's role (the draft executor: "executor"). A role's own certificate (tls.roleSecrets,
     or the ones the chart issues with tls.issue, one per component) names its mesh role, e.g.
     executor.graphmesh.internal: with tls.ca every hop is mutual TLS and each RPC is checked against the caller's role.
     The front end ("frontend": tls.roleSecrets.frontend, or the one tls.issue makes) names no role: a client. */}}
{{- define "graphmesh.tlsSecretFor" -}}
{{- $tls := .ctx.Values.tls -}}
{{- $role := default .component .role -}}
{{- if index $tls.roleSecrets $role -}}
{{- index $tls.roleSecrets $role -}}
{{- else if $tls.issue -}}
{{- printf "%s-tls-%s" (include "graphmesh.fullname" .ctx) .component -}}
{{- else -}}
{{- include "graphmesh.tlsSecret" .ctx -}}
{{- end -}}
{{- end -}}

{{- define "graphmesh.meshTokenSecret" -}}
{{- default (printf "%s-mesh-token" (include "graphmesh.fullname" .)) .Values.meshToken.existingSecret -}}
{{- end -}}

{{- define "graphmesh.authSecret" -}}
{{- default (printf "%s-auth" (include "graphmesh.fullname" .)) .Values.auth.existingSecret -}}
{{- end -}}

{{/* Labels; pass (dict "ctx" $ "component" "executor"). */}}
{{- define "graphmesh.selectorLabels" -}}
app.kubernetes.io/name: {{ include "graphmesh.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
{{- if .component }}
app.kubernetes.io/component: {{ .component }}
{{- end }}
{{- end -}}

{{- define "graphmesh.labels" -}}
{{ include "graphmesh.selectorLabels" . }}
helm.sh/chart: {{ printf "%s-%s" .ctx.Chart.Name .ctx.Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: graphmesh
{{- with .ctx.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Image reference; pass (dict "ctx" $ "image" .Values.<component>.image). */}}
{{- define "graphmesh.image" -}}
{{- printf "%s%s:%s" .ctx.Values.image.registry .image.repository (default (default .ctx.Chart.AppVersion .ctx.Values.image.tag) .image.tag) -}}
{{- end -}}

{{/* "true" when executors compute on a GPU: gpu.enabled, or a cuda device. Each pod then gets one GPU. */}}
{{- define "graphmesh.executorOnGpu" -}}
{{- or .Values.executor.gpu.enabled (hasPrefix "cuda" .Values.executor.device) -}}
{{- end -}}

{{- define "graphmesh.executorImage" -}}
{{- $gpu := .Values.executor.gpu -}}
{{- if eq (include "graphmesh.executorOnGpu" .) "true" -}}
{{- $tag := default (printf "%s%s" (default (default .Chart.AppVersion .Values.image.tag) .Values.executor.image.tag) $gpu.image.tagSuffix) $gpu.image.tag -}}
{{- printf "%s%s:%s" .Values.image.registry (default .Values.executor.image.repository $gpu.image.repository) $tag -}}
{{- else -}}
{{- include "graphmesh.image" (dict "ctx" . "image" .Values.executor.image) -}}
{{- end -}}
{{- end -}}

{{/* The draft executor's image: draft.image when given, else the executors' (their GPU image on GPUs). */}}
{{- define "graphmesh.draftImage" -}}
{{- if .Values.draft.image.repository -}}
{{- include "graphmesh.image" (dict "ctx" . "image" .Values.draft.image) -}}
{{- else -}}
{{- include "graphmesh.executorImage" . -}}
{{- end -}}
{{- end -}}

{{/* The front end's image: frontend.image where given, else the coordinator's (whose package ships
     graphmesh-frontend). */}}
{{- define "graphmesh.frontendImage" -}}
{{- $c := .Values.coordinator.image -}}
{{- $f := .Values.frontend.image -}}
{{- include "graphmesh.image" (dict "ctx" . "image" (dict "repository" (default $c.repository $f.repository) "tag" (default $c.tag $f.tag))) -}}
{{- end -}}

{{/* The coordinator's --draft-executor: the draft's Service (headless, one pod behind it). */}}
{{- define "graphmesh.draftAddress" -}}
{{- printf "%s:%d" (include "graphmesh.draft" .) (int .Values.draft.port) -}}
{{- end -}}

{{/* The coordinator's --executors list: one address per StatefulSet ordinal, in rank order. */}}
{{- define "graphmesh.executorAddresses" -}}
{{- $sts := include "graphmesh.executor" . -}}
{{- $headless := include "graphmesh.executorHeadless" . -}}
{{- $addrs := list -}}
{{- range $i := until (int .Values.executor.replicas) -}}
{{- $addrs = append $addrs (printf "%s-%d.%s:%d" $sts $i $headless (int $.Values.executor.port)) -}}
{{- end -}}
{{- join "," $addrs -}}
{{- end -}}

{{/* The coordinators' --etcd: etcd.url as given, else one client URL per member of the chart's etcd; "" without. */}}
{{- define "graphmesh.etcdUrls" -}}
{{- $e := .Values.etcd -}}
{{- if $e.url -}}
{{- $e.url -}}
{{- else if $e.enabled -}}
{{- $name := include "graphmesh.etcd" . -}}
{{- $urls := list -}}
{{- range $i := until (int $e.replicas) -}}
{{- $urls = append $urls (printf "http://%s-%d.%s:%d" $name $i $name (int $e.clientPort)) -}}
{{- end -}}
{{- join "," $urls -}}
{{- end -}}
{{- end -}}

{{/* The mesh's name in etcd (--cluster-name of the coordinators and the executors): coordinator.clusterName, else
the release's full name. */}}
{{- define "graphmesh.clusterName" -}}
{{- default (include "graphmesh.fullname" .) .Values.coordinator.clusterName -}}
{{- end -}}

{{/* Every service: the mesh token that identifies the mesh's own services to each other, and TLS when on. */}}
{{- define "graphmesh.securityArgs" -}}
- --mesh-token-file
- /mesh/token
{{- if .Values.tls.enabled }}
{{ include "graphmesh.tlsArgs" . }}
{{- end }}
{{- end -}}

{{/* Render only when tls.enabled. */}}
{{- define "graphmesh.tlsArgs" -}}
- --tls-cert
- /tls/tls.crt
- --tls-key
- /tls/tls.key
- --tls-ca
- /tls/ca.crt
- --health-listen
- {{ printf "0.0.0.0:%d" (int .Values.tls.healthPort) | quote }}
{{- end -}}

{{/* Native gRPC probes (grpc.health.v1, overall service ""); pass (dict "ctx" $ "port" <gRPC port>). */}}
{{- define "graphmesh.probes" -}}
{{- $p := .ctx.Values.probes -}}
{{- $port := ternary (int .ctx.Values.tls.healthPort) (int .port) .ctx.Values.tls.enabled -}}
{{- $live := default "" .liveService -}}
startupProbe:
  grpc:
    port: {{ $port }}
    service: {{ $live | quote }}
  periodSeconds: {{ $p.startup.periodSeconds }}
  failureThreshold: {{ $p.startup.failureThreshold }}
livenessProbe:
  grpc:
    port: {{ $port }}
    service: {{ $live | quote }}
  periodSeconds: {{ $p.liveness.periodSeconds }}
  timeoutSeconds: {{ $p.liveness.timeoutSeconds }}
  failureThreshold: {{ $p.liveness.failureThreshold }}
readinessProbe:
  grpc:
    port: {{ $port }}
    service: ""
  periodSeconds: {{ $p.readiness.periodSeconds }}
  timeoutSeconds: {{ $p.readiness.timeoutSeconds }}
  failureThreshold: {{ $p.readiness.failureThreshold }}
{{- end -}}

{{/* Container ports: the gRPC port, metrics, and the plain-text health port when TLS is on. */}}
{{- define "graphmesh.ports" -}}
- name: grpc
  containerPort: {{ .port }}
  protocol: TCP
- name: metrics
  containerPort: {{ .ctx.Values.metricsPort }}
  protocol: TCP
{{- if .ctx.Values.tls.enabled }}
- name: health
  containerPort: {{ .ctx.Values.tls.healthPort }}
  protocol: TCP
{{- end }}
{{- end -}}

{{/* Env shared by every service: OTEL, pod identity, HOME on the writable /tmp; pass (dict "ctx" $ "component" "x"). */}}
{{- define "graphmesh.env" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: HOME
  value: /tmp
- name: PYTHONDONTWRITEBYTECODE
  value: "1"
- name: OTEL_SERVICE_NAME
  value: {{ printf "graphmesh-%s" .component | quote }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ printf "k8s.pod.name=$(POD_NAME),k8s.namespace.name=$(POD_NAMESPACE),service.instance.id=$(POD_NAME)%s" (ternary (printf ",%s" .ctx.Values.otel.resourceAttributes) "" (ne .ctx.Values.otel.resourceAttributes "")) | quote }}
{{- if .ctx.Values.otel.endpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ .ctx.Values.otel.endpoint | quote }}
- name: OTEL_TRACES_EXPORTER
  value: {{ .ctx.Values.otel.tracesExporter | quote }}
{{- else }}
- name: OTEL_TRACES_EXPORTER
  value: "none"
{{- end }}
# Metrics go to Prometheus (the metrics port) and logs to stderr, never to an OTLP collector.
- name: OTEL_METRICS_EXPORTER
  value: "none"
- name: OTEL_LOGS_EXPORTER
  value: "none"
{{- end -}}

{{/* Volumes every pod has: scratch /tmp, the mesh token and, with TLS, the component's certificate secret;
     pass (dict "ctx" $ "component" "executor"). */}}
{{- define "graphmesh.commonVolumes" -}}
- name: tmp
  emptyDir: {}
- name: mesh-token
  secret:
    secretName: {{ include "graphmesh.meshTokenSecret" .ctx }}
    defaultMode: 0440
{{- if .ctx.Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ include "graphmesh.tlsSecretFor" . }}
    defaultMode: 0440
{{- end }}
{{- end -}}

{{- define "graphmesh.commonMounts" -}}
- name: tmp
  mountPath: /tmp
- name: mesh-token
  mountPath: /mesh
  readOnly: true
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: /tls
  readOnly: true
{{- end }}
{{- end -}}

{{- define "graphmesh.modelVolume" -}}
- name: models
  {{- toYaml (default (dict "emptyDir" dict) .Values.model.volume) | nindent 2 }}
{{- end -}}

{{/* The kvstore's shared tier: its URL ("" for none) and the Secret with its password ("" for none). */}}
{{- define "graphmesh.redisUrl" -}}
{{- $k := .Values.kvstore -}}
{{- if $k.redis.url -}}
{{- $k.redis.url -}}
{{- else if $k.valkey.enabled -}}
{{- printf "redis://%s:%d/0" (include "graphmesh.valkey" .) (int $k.valkey.port) -}}
{{- end -}}
{{- end -}}

{{- define "graphmesh.redisSecret" -}}
{{- $k := .Values.kvstore -}}
{{- if $k.redis.url -}}
{{- $k.redis.existingSecret -}}
{{- else if $k.valkey.enabled -}}
{{- include "graphmesh.valkey" . -}}
{{- end -}}
{{- end -}}

{{- define "graphmesh.redisPasswordKey" -}}
{{- if .Values.kvstore.redis.url -}}{{ .Values.kvstore.redis.passwordKey }}{{- else -}}password{{- end -}}
{{- end -}}
