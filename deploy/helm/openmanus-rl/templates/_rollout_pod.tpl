{{/* Pod template of the rollout servers, for their Deployment or the rollout Job of the learner's JobSet:
     omrl.rollout.podTemplate (dict "root" $ "restartPolicy" "OnFailure") */}}
{{- define "omrl.rollout.podTemplate" -}}
{{- $root := .root -}}
{{- $v := $root.Values.rollout -}}
{{- $ctx := dict "root" $root "component" "rollout" -}}
metadata:
  labels:
    {{- include "omrl.labels" $ctx | nindent 4 }}
  annotations:
    {{- include "omrl.podAnnotations" (dict "root" $root "values" $v "metricsPort" $v.metricsPort) | nindent 4 }}
spec:
  {{- with .restartPolicy }}
  restartPolicy: {{ . }}
  {{- end }}
  serviceAccountName: {{ include "omrl.fullname" $root }}
  automountServiceAccountToken: false
  # engine shutdown: in-flight generations finish, the server unregisters itself from Redis
  terminationGracePeriodSeconds: 60
  securityContext:
    {{- include "omrl.podSecurityContext" $root | nindent 4 }}
  {{- with include "omrl.scheduling" (dict "root" $root "values" $v "gpus" $v.gpus) }}{{ . | nindent 2 }}{{- end }}
  containers:
    - name: rollout
      image: {{ include "omrl.image" (dict "root" $root "key" "rollout" "component" "rollout") }}
      imagePullPolicy: {{ $root.Values.image.pullPolicy }}
      command: [python, -m, services.rollout]
      args:
        {{- include "omrl.configArgs" $root | nindent 8 }}
        - --port={{ $v.port }}
        - --metrics-port={{ $v.metricsPort }}
        # the learner pushes weights to this pod directly, at the address it registers in Redis
        - --advertise=$(POD_IP):{{ $v.port }}
        {{- with $v.extraArgs }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      env:
        - name: POD_IP
          valueFrom:
            fieldRef:
              fieldPath: status.podIP
        {{- with include "omrl.redis.env" $root }}{{ . | nindent 8 }}{{- end }}
        - name: HOME
          value: /tmp
        {{- include "omrl.serviceEnv" $root | nindent 8 }}
        {{- include "omrl.weightToken.env" $root | nindent 8 }}
        {{- with include "omrl.weightDist.env" $root }}{{ . | nindent 8 }}{{- end }}
        - name: HF_HOME
          value: /cache/hf
        - name: VLLM_CACHE_ROOT
          value: /cache/vllm
        - name: TRITON_CACHE_DIR
          value: /cache/triton
        {{- with $v.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      ports:
        - name: grpc
          containerPort: {{ $v.port }}
        - name: metrics
          containerPort: {{ $v.metricsPort }}
      {{- $probes := deepCopy $root.Values.probes }}
      {{- $_ := set $probes "startup" $v.startupProbe }}
      {{- include "omrl.grpcProbes" (dict "port" $v.port "probes" $probes) | nindent 6 }}
      resources:
        {{- include "omrl.resources" (dict "root" $root "values" $v "gpus" $v.gpus) | nindent 8 }}
      securityContext:
        {{- include "omrl.containerSecurityContext" (dict "readOnlyRootFilesystem" $v.readOnlyRootFilesystem) | nindent 8 }}
      volumeMounts:
        {{- include "omrl.scratchMounts" $root | nindent 8 }}
        {{- include "omrl.modelMounts" $root | nindent 8 }}
        {{- include "omrl.datasetMount" $root | nindent 8 }}
  volumes:
    {{- include "omrl.scratchVolumes" $root | nindent 4 }}
    {{- include "omrl.modelVolumes" (dict "root" $root "shm" $v.shmSizeLimit) | nindent 4 }}
    {{- include "omrl.datasetVolume" $root | nindent 4 }}
{{- end -}}
