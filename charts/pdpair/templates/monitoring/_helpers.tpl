{{/* Helpers of templates/monitoring/ (all prefixed "pdpair.monitoring."). */}}

{{/* Labels of every monitoring object: the chart's labels, the component, and monitoring.labels. */}}
{{- define "pdpair.monitoring.labels" -}}
{{ include "pdpair.labels" . }}
app.kubernetes.io/component: monitoring
{{- with .Values.monitoring.labels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
A Prometheus duration of one unit ("500ms", "15s", "1m", "2h"; values.schema.json allows only these) in
milliseconds, so scrapeTimeout <= interval can be checked at install time rather than by a Prometheus that
rejects its generated config later.
*/}}
{{- define "pdpair.monitoring.durationMs" -}}
{{- $n := regexFind "^[0-9]+" . | atoi -}}
{{- $unit := regexFind "(ms|s|m|h)$" . -}}
{{- mul $n (get (dict "ms" 1 "s" 1000 "m" 60000 "h" 3600000) $unit) -}}
{{- end }}

{{/* Fails unless scrapeTimeout <= interval. Argument: (list "<values path>" <the values map>). */}}
{{- define "pdpair.monitoring.checkTimeout" -}}
{{- $path := index . 0 }}
{{- $cfg := index . 1 }}
{{- $interval := include "pdpair.monitoring.durationMs" $cfg.interval | atoi }}
{{- $timeout := include "pdpair.monitoring.durationMs" $cfg.scrapeTimeout | atoi }}
{{- if gt $timeout $interval }}
{{- fail (printf "%s.scrapeTimeout (%s) must not exceed %s.interval (%s)" $path $cfg.scrapeTimeout $path $cfg.interval) }}
{{- end }}
{{- end }}

{{/* The labels of one alert: severity plus prometheusRule.additionalLabels. Argument: (list $alertValues $root). */}}
{{- define "pdpair.monitoring.alertLabels" -}}
severity: {{ (index . 0).severity }}
{{- with (index . 1).Values.monitoring.prometheusRule.additionalLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* runbook_url of an alert. Argument: (list "AlertName" $root). */}}
{{- define "pdpair.monitoring.runbook" -}}
{{- printf "%s%s" (index . 1).Values.monitoring.prometheusRule.runbookBaseUrl (lower (index . 0)) }}
{{- end }}
