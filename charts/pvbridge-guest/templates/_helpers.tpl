{{/* The image .name of .Values.images, from .Values.imageRegistry when it is set. */}}
{{- define "pvbridge.image" -}}
{{- $image := index .root.Values.images .name -}}
{{- if .root.Values.imageRegistry -}}
{{- regexReplaceAll "^[^/]+" $image .root.Values.imageRegistry -}}
{{- else -}}
{{- $image -}}
{{- end -}}
{{- end -}}
