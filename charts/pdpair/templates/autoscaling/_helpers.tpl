{{/* Helpers of templates/autoscaling/ (all prefixed "pdpair.autoscaling."). */}}

{{/*
The prometheus-adapter config: {rules: [...]}, one rule per metric, each a Pods metric (the series' `namespace` and
`pod` labels name the object; Prometheus adds them to every scraped pod series). `<<.Series>>`, `<<.LabelMatchers>>`
and `<<.GroupBy>>` are the adapter's own template fields, filled per request (helm leaves `<< >>` alone).
- gauges keep their name; the aggregate over a pod's series (TP ranks, peers, a data-parallel engine's engines) is
  sum, except vllm:kv_cache_usage_perc: max, the fullest engine, as the router reads it;
- counters (…_total) become …_per_second: sum(rate(...[rateWindow])).
A request can narrow a metric to some of its series with the API's metricLabelSelector, e.g. `outcome=error` or
`rank=0`: the adapter adds it to <<.LabelMatchers>>. Not `peer`: its values (host:portBase) are no valid selector
values, so through this API an edge's series count only in its pod's sum.
*/}}
{{- define "pdpair.autoscaling.prometheusAdapterConfig" -}}
{{- $cfg := .Values.autoscaling.prometheusAdapterRules }}
{{- $resources := dict "overrides" (dict "namespace" (dict "resource" "namespace") "pod" (dict "resource" "pod")) }}
{{- $rules := list }}
{{- /* (series, aggregation): gauges */}}
{{- range $g := list (list "vllm:num_requests_waiting" "sum") (list "vllm:num_requests_running" "sum") (list "vllm:kv_cache_usage_perc" "max") (list "pdpair_transport_inflight" "sum") (list "pdpair_transport_slots" "sum") (list "pdpair_signal_deficit" "sum") }}
{{- $series := index $g 0 }}
{{- $rules = append $rules (dict
    "seriesQuery" (printf "%s{namespace!=\"\",pod!=\"\"}" $series)
    "resources" $resources
    "name" (dict "matches" (printf "^%s$" $series) "as" $series)
    "metricsQuery" (printf "%s(<<.Series>>{<<.LabelMatchers>>}) by (<<.GroupBy>>)" (index $g 1))) }}
{{- end }}
{{- /* counters: rate per second */}}
{{- range $series := list "pdpair_kv_transfers_total" "pdpair_kv_transfer_bytes_total" "pdpair_transport_requeues_total" }}
{{- $rules = append $rules (dict
    "seriesQuery" (printf "%s{namespace!=\"\",pod!=\"\"}" $series)
    "resources" $resources
    "name" (dict "matches" "^(.*)_total$" "as" "${1}_per_second")
    "metricsQuery" (printf "sum(rate(<<.Series>>{<<.LabelMatchers>>}[%s])) by (<<.GroupBy>>)" $cfg.rateWindow)) }}
{{- end }}
{{- toYaml (dict "rules" (concat $rules $cfg.extraRules)) }}
{{- end }}
