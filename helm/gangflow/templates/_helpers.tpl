{{/*
Names, labels and small computations shared by the templates.
*/}}

{{- define "gangflow.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "gangflow.fullname" -}}
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

{{- define "gangflow.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Common labels; pass (dict "ctx" $ "component" "name"). */}}
{{- define "gangflow.labels" -}}
helm.sh/chart: {{ include "gangflow.chart" .ctx }}
app.kubernetes.io/name: {{ include "gangflow.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: gangflow
{{- with .component }}
app.kubernetes.io/component: {{ . }}
{{- end }}
{{- with .ctx.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Labels every training pod carries (contract with the Kubernetes backend). */}}
{{- define "gangflow.trainingSelector" -}}
app.kubernetes.io/name: gangflow
app.kubernetes.io/component: training
{{- end -}}

{{/* Selector of the MLflow pods. */}}
{{- define "gangflow.mlflow.selector" -}}
app.kubernetes.io/name: {{ include "gangflow.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: mlflow
{{- end -}}

{{- define "gangflow.mlflow.fullname" -}}
{{- printf "%s-mlflow" (include "gangflow.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "gangflow.mlflow.serviceAccountName" -}}
{{- default (include "gangflow.mlflow.fullname" .) .Values.mlflow.serviceAccount.name -}}
{{- end -}}

{{/* The team list as JSON: [{name, namespace}] with namespace "" resolved to the release namespace. */}}
{{- define "gangflow.teams" -}}
{{- $teams := list -}}
{{- range .Values.kueue.teams -}}
{{- $teams = append $teams (dict "name" .name "namespace" (default $.Release.Namespace .namespace)) -}}
{{- end -}}
{{- toJson $teams -}}
{{- end -}}

{{/* Which gang scheduler the backend uses: volcano when volcano.enabled, else kueue. */}}
{{- define "gangflow.scheduler" -}}
{{- if .Values.volcano.enabled -}}volcano{{- else -}}kueue{{- end -}}
{{- end -}}

{{/* Image reference pinned by digest; pass the image values (repository, digest). */}}
{{- define "gangflow.imageRef" -}}
{{- printf "%s@%s" .repository .digest -}}
{{- end -}}

{{/* In-cluster tracking URI of the chart's MLflow, or the override. */}}
{{- define "gangflow.mlflow.trackingUri" -}}
{{- if .Values.mlflow.trackingUri -}}
{{- .Values.mlflow.trackingUri -}}
{{- else if .Values.mlflow.enabled -}}
{{- printf "http://%s.%s.svc.cluster.local:%d" (include "gangflow.mlflow.fullname" .) .Release.Namespace (int .Values.mlflow.port) -}}
{{- end -}}
{{- end -}}

{{/*
A non-negative Kubernetes quantity ("500m", "16Gi", "1e3", 4) as a float in base units (cores, bytes, devices).
Fails with the offending value when it cannot be parsed.
*/}}
{{- define "gangflow.quantity" -}}
{{- $q := toString . -}}
{{- $num := regexFind "^[0-9]+(\\.[0-9]+)?([eE][+-]?[0-9]+)?" $q -}}
{{- $suffix := trimPrefix $num $q -}}
{{- $mult := dict "" 1.0 "n" 0.000000001 "u" 0.000001 "m" 0.001 "k" 1000.0 "M" 1000000.0 "G" 1000000000.0 "T" 1000000000000.0 "P" 1000000000000000.0 "E" 1000000000000000000.0 "Ki" 1024.0 "Mi" 1048576.0 "Gi" 1073741824.0 "Ti" 1099511627776.0 "Pi" 1125899906842624.0 "Ei" 1152921504606846976.0 -}}
{{- if or (not $num) (not (hasKey $mult $suffix)) -}}
{{- fail (printf "gangflow: %q is not a non-negative Kubernetes quantity (examples: 4, 500m, 16Gi)" $q) -}}
{{- end -}}
{{- mulf (float64 $num) (get $mult $suffix) -}}
{{- end -}}

{{/* Pod Security admission labels of a team namespace (podSecurity.level, enforced, audited, warned). */}}
{{- define "gangflow.podSecurityLabels" -}}
pod-security.kubernetes.io/enforce: {{ .Values.podSecurity.level }}
pod-security.kubernetes.io/enforce-version: latest
pod-security.kubernetes.io/audit: {{ .Values.podSecurity.level }}
pod-security.kubernetes.io/warn: {{ .Values.podSecurity.level }}
{{- end -}}

{{/*
Name of the MultiKueue AdmissionCheck and of the MultiKueueConfig it points to: the ClusterQueue's name
with "-multikueue", a DNS-1123 label (an AdmissionCheck's parameters.name allows no dots).
*/}}
{{- define "gangflow.multiKueue.name" -}}
{{- printf "%s-multikueue" (.Values.kueue.clusterQueue.name | replace "." "-") | trunc 63 | trimSuffix "-" -}}
{{- end -}}
