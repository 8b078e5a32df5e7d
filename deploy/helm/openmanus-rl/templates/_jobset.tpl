{{/* Spec of the JobSet (learner.workload: JobSet): replicated job `learner` (the Indexed Job of
     omrl.learner.jobSpec) and `rollout` (the rollout servers as a Job whose pods restart in place).
     omrl.learner.jobSetSpec (dict "root" $ "name" "<JobSet name>" "subdomain" "<headless Service>") */}}
{{- define "omrl.learner.jobSetSpec" -}}
{{- $root := .root -}}
{{- $v := $root.Values.learner -}}
{{- $rollout := $root.Values.rollout -}}
# the learner Job retries its pods itself (learner.backoffLimit); its final failure fails the JobSet
failurePolicy:
  maxRestarts: 0
# the rollout servers never complete: the JobSet is done when the learner is
successPolicy:
  operator: All
  targetReplicatedJobs: [learner]
network:
  enableDNSHostnames: true
  subdomain: {{ .subdomain }}
  publishNotReadyAddresses: true
{{- if not (kindIs "invalid" $v.ttlSecondsAfterFinished) }}
ttlSecondsAfterFinished: {{ $v.ttlSecondsAfterFinished }}
{{- end }}
replicatedJobs:
  - name: learner
    replicas: 1
    template:
      spec:
        {{- include "omrl.learner.jobSpec" (dict "root" $root "masterAddr" (printf "%s-learner-0-0.%s" .name .subdomain)) | nindent 8 }}
  - name: rollout
    replicas: 1
    template:
      spec:
        completions: {{ $rollout.replicas }}
        parallelism: {{ $rollout.replicas }}
        completionMode: Indexed
        # a crashed engine restarts in place (restartPolicy OnFailure); past this many restarts the JobSet fails
        backoffLimit: 20
        template:
          {{- include "omrl.rollout.podTemplate" (dict "root" $root "restartPolicy" "OnFailure") | nindent 10 }}
{{- end -}}
