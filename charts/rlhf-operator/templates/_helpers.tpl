{{/* Name of the release's objects. */}}
{{- define "rlhf-operator.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "rlhf-operator.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "rlhf-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "rlhf-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "rlhf-operator.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The selector labels as `k=v,k=v` (RLHF_OPERATOR_POD_SELECTOR: the operator names its own
pods in each job's NetworkPolicy). */}}
{{- define "rlhf-operator.selectorString" -}}
{{- $pairs := list -}}
{{- range $k, $v := (include "rlhf-operator.selectorLabels" . | fromYaml) -}}
{{- $pairs = append $pairs (printf "%s=%s" $k $v) -}}
{{- end -}}
{{- join "," $pairs -}}
{{- end -}}

{{/* The default trainer image (RLHF_OPERATOR_TRAINER_IMAGE): "" with trainerImage.variant=none. */}}
{{- define "rlhf-operator.trainerImage" -}}
{{- $t := .Values.trainerImage -}}
{{- if ne $t.variant "none" -}}
{{- printf "%s:%s" (get $t $t.variant).repository ($t.tag | default .Chart.AppVersion) -}}
{{- end -}}
{{- end -}}

{{/* "true" when the status-writers ValidatingAdmissionPolicy is rendered: asked for, and the API
server serves admissionregistration.k8s.io/v1 ValidatingAdmissionPolicy (GA in Kubernetes 1.30).
Both the API list and the version are asked: `helm template` lists every API its own client
knows whatever --kube-version says, and a live install reports both from the server. */}}
{{- define "rlhf-operator.statusPolicy" -}}
{{- if and .Values.rbac.create .Values.rbac.statusWritersPolicy (.Capabilities.APIVersions.Has "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy") (semverCompare ">=1.30.0-0" .Capabilities.KubeVersion.Version) -}}
true
{{- end -}}
{{- end -}}

{{- define "rlhf-operator.statusPolicyName" -}}
{{- include "rlhf-operator.fullname" . }}-job-status-writers
{{- end -}}
