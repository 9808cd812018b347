{{/*
The values every generated template uses (scripts/gen_chart.py writes the others from
manifests/; this file and NOTES.txt are written by hand).
*/}}

{{/* The namespace of every namespaced object (and of the Namespace the chart creates). */}}
{{- define "fuse-device-plugin.namespace" -}}
{{ .Values.namespace.name }}
{{- end }}

{{/* The image of every container: the project's, at the chart's appVersion by default. */}}
{{- define "fuse-device-plugin.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{/*
Helm's standard labels, on each object's own labels only: never on a selector (immutable
in a DaemonSet) nor on a pod template (an upgrade that changes nothing else would then
restart every pod).
*/}}
{{- define "fuse-device-plugin.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}
