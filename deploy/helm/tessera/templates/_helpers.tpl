{{/* Chart name, truncated to a DNS label. */}}
{{- define "tessera.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Release-qualified name of every object. */}}
{{- define "tessera.fullname" -}}
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

{{- define "tessera.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tessera.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "tessera.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "tessera.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "tessera.serviceAccountName" -}}
{{- default (include "tessera.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{/* The driver name, checked: DeviceClass names and the policy are built from it.
     nvidiaCompatibleNames makes it gpu.nvidia.com (a driverName other than the
     default or that name is a contradiction, refused). */}}
{{- define "tessera.driverName" -}}
{{- $d := required "driverName is required" .Values.driverName -}}
{{- if .Values.nvidiaCompatibleNames -}}
{{- if not (has $d (list "gpu.tessera.dev" "gpu.nvidia.com")) -}}
{{- fail (printf "nvidiaCompatibleNames: true makes the driver name gpu.nvidia.com; unset driverName (it is %q) or turn nvidiaCompatibleNames off" $d) -}}
{{- end -}}
{{- $d = "gpu.nvidia.com" -}}
{{- end -}}
{{- if not (regexMatch "^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)+$" $d) -}}
{{- fail (printf "driverName %q is not a DNS subdomain with at least one dot (e.g. gpu.example.com)" $d) -}}
{{- end -}}
{{- $d -}}
{{- end -}}

{{/* The DeviceClass domain: the driver name without a leading "gpu.". */}}
{{- define "tessera.domain" -}}
{{- include "tessera.driverName" . | trimPrefix "gpu." -}}
{{- end -}}

{{/* The whole-GPU class's extended resource name, or nothing
     (deviceClasses.extendedResources.gpu). */}}
{{- define "tessera.gpuExtendedResource" -}}
{{- $r := .Values.deviceClasses.extendedResources.gpu | default "" -}}
{{- if eq $r "auto" -}}
{{- if semverCompare ">=1.36.0-0" .Capabilities.KubeVersion.Version -}}
{{- printf "%s/gpu" (include "tessera.domain" .) -}}
{{- end -}}
{{- else if $r -}}
{{- if not (regexMatch "^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$" $r) -}}
{{- fail (printf "deviceClasses.extendedResources.gpu: %q is not an extended resource name such as nvidia.com/gpu" $r) -}}
{{- end -}}
{{- if or (hasPrefix "kubernetes.io/" $r) (contains ".kubernetes.io/" $r) (hasPrefix "requests." $r) -}}
{{- fail (printf "deviceClasses.extendedResources.gpu: %q is in a domain Kubernetes reserves; use your own, e.g. nvidia.com/gpu" $r) -}}
{{- end -}}
{{- $r -}}
{{- end -}}
{{- end -}}

{{- define "tessera.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* A host path without a trailing slash ("/" stays "/"). */}}
{{- define "tessera.clean" -}}
{{- $p := clean . -}}
{{- if not (hasPrefix "/" $p) -}}
{{- fail (printf "%q is not an absolute path" .) -}}
{{- end -}}
{{- $p -}}
{{- end -}}

{{- define "tessera.driverRoot" -}}
{{- include "tessera.clean" .Values.driverRoot -}}
{{- end -}}

{{- define "tessera.devRoot" -}}
{{- include "tessera.clean" (default .Values.driverRoot .Values.devRoot) -}}
{{- end -}}

{{/* The NVML library as the pod sees it. */}}
{{- define "tessera.nvmlLibrary" -}}
{{- if hasPrefix "/" .Values.nvmlLibrary -}}
{{- .Values.nvmlLibrary -}}
{{- else -}}
{{- clean (printf "%s/%s" (include "tessera.driverRoot" .) .Values.nvmlLibrary) -}}
{{- end -}}
{{- end -}}

{{/* metrics.bindAddress:metrics.port, an IPv6 address in brackets. */}}
{{- define "tessera.metricsAddress" -}}
{{- $host := .Values.metrics.bindAddress | toString | trimPrefix "[" | trimSuffix "]" -}}
{{- if contains ":" $host -}}
{{- printf "[%s]:%v" $host .Values.metrics.port -}}
{{- else -}}
{{- printf "%s:%v" $host .Values.metrics.port -}}
{{- end -}}
{{- end -}}

{{/* "true" when metrics.bindAddress answers on the node's loopback only. */}}
{{- define "tessera.metricsLoopback" -}}
{{- $host := .Values.metrics.bindAddress | toString | trimPrefix "[" | trimSuffix "]" -}}
{{- if or (hasPrefix "127." $host) (eq $host "::1") -}}true{{- end -}}
{{- end -}}

{{/* metrics.service.bindAddress:metrics.service.port, an IPv6 address in brackets. */}}
{{- define "tessera.secureMetricsAddress" -}}
{{- $host := .Values.metrics.service.bindAddress | toString | trimPrefix "[" | trimSuffix "]" -}}
{{- if contains ":" $host -}}
{{- printf "[%s]:%v" $host .Values.metrics.service.port -}}
{{- else -}}
{{- printf "%s:%v" $host .Values.metrics.service.port -}}
{{- end -}}
{{- end -}}

{{/* compatibilityGroups, checked: auto or off. */}}
{{- define "tessera.compatibilityGroups" -}}
{{- $v := .Values.compatibilityGroups | toString -}}
{{- if not (has $v (list "auto" "off")) -}}
{{- fail (printf "compatibilityGroups is %q: expected auto (publish them where the API server keeps them) or off (the scheduler's DRADeviceCompatibilityGroups gate is off)" $v) -}}
{{- end -}}
{{- $v -}}
{{- end -}}
