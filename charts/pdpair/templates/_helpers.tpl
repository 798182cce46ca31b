{{/*
Helpers shared by every template. All names start with "pdpair." so they never clash with a parent chart's.
*/}}

{{/* The chart name, or nameOverride. 63 characters: the longest DNS label and label value. */}}
{{- define "pdpair.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The base of every resource name: "<release>-<chart>", or just "<release>" when the release name already
contains the chart name. Truncated to 63 - 9 = 54 characters: the longest suffix a template appends is
"-operator" (9 characters), and names must stay DNS labels (63). trimSuffix drops a "-" left by the cut.
*/}}
{{- define "pdpair.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 54 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 54 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 54 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Name of the operator's Deployment, Service, (Cluster)Role and bindings. */}}
{{- define "pdpair.operator.fullname" -}}
{{- printf "%s-operator" (include "pdpair.fullname" .) }}
{{- end }}

{{/* The namespace of namespaced resources. */}}
{{- define "pdpair.namespace" -}}
{{- default .Release.Namespace .Values.namespaceOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* chart label value: "<name>-<version>", with "+" (invalid in label values) replaced. */}}
{{- define "pdpair.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Selector labels: only name and instance, which never change over upgrades (a Deployment's selector is immutable).
*/}}
{{- define "pdpair.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdpair.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Labels of every resource: the selector labels plus version, chart, manager and the user's commonLabels. */}}
{{- define "pdpair.labels" -}}
helm.sh/chart: {{ include "pdpair.chart" . }}
{{ include "pdpair.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | replace "+" "_" | trunc 63 | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: pdpair
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Operator component labels and selector labels. */}}
{{- define "pdpair.operator.labels" -}}
{{ include "pdpair.labels" . }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "pdpair.operator.selectorLabels" -}}
{{ include "pdpair.selectorLabels" . }}
app.kubernetes.io/component: operator
{{- end }}

{{/* The operator's ServiceAccount name. */}}
{{- define "pdpair.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "pdpair.operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false (the operator needs an existing ServiceAccount)" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The operator image reference: repository@digest, or repository:tag (tag defaults to appVersion). */}}
{{- define "pdpair.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/*
operator.portPool checked beyond what values.schema.json can say (FIRST <= LAST, both 1024..65535),
so a bad pool fails at install time instead of at operator start. Renders the pool on success.
*/}}
{{- define "pdpair.portPool" -}}
{{- $pool := .Values.operator.portPool }}
{{- $bounds := splitList "-" $pool }}
{{- $first := index $bounds 0 | atoi }}
{{- $last := index $bounds 1 | atoi }}
{{- if or (lt $first 1024) (gt $last 65535) (gt $first $last) }}
{{- fail (printf "operator.portPool %q: need FIRST-LAST with 1024 <= FIRST <= LAST <= 65535" $pool) }}
{{- end }}
{{- with .Values.operator.nodeEphemeralPortRange }}
{{- $eph := splitList "-" . }}
{{- if and (le $first (index $eph 1 | atoi)) (ge $last (index $eph 0 | atoi)) }}
{{- fail (printf "operator.portPool %q overlaps the nodes' ephemeral port range %q (operator.nodeEphemeralPortRange): the kernel gives those ports to outgoing connections, so leased ports could be taken; move the pool below it" $pool .) }}
{{- end }}
{{- end }}
{{- $pool }}
{{- end }}
