{{/* Spec of the learner's Indexed Job, alone or inside the JobSet:
     omrl.learner.jobSpec (dict "root" $ "masterAddr" "<pod 0's DNS name>" ["subdomain" "<headless Service>"]
     ["ttl" true]). Pod i runs torchrun node i; they meet at pod 0. */}}
{{- define "omrl.learner.jobSpec" -}}
{{- $root := .root -}}
{{- $v := $root.Values.learner -}}
{{- $ctx := dict "root" $root "component" "learner" -}}
{{- $nproc := int ($root.Values.config.learner.nproc | default 1) -}}
{{- $distributed := or (gt (int $v.nodes) 1) (gt $nproc 1) -}}
completions: {{ $v.nodes }}
parallelism: {{ $v.nodes }}
completionMode: Indexed
backoffLimit: {{ $v.backoffLimit }}
{{- if not (kindIs "invalid" $v.activeDeadlineSeconds) }}
# a hung collective or a stuck run ends here
activeDeadlineSeconds: {{ int $v.activeDeadlineSeconds }}
{{- end }}
{{- if and .ttl (not (kindIs "invalid" $v.ttlSecondsAfterFinished)) }}
ttlSecondsAfterFinished: {{ $v.ttlSecondsAfterFinished }}
{{- end }}
template:
  metadata:
    labels:
      {{- include "omrl.labels" $ctx | nindent 6 }}
    annotations:
      {{- include "omrl.podAnnotations" (dict "root" $root "values" $v "metricsPort" $v.metricsPort) | nindent 6 }}
  spec:
    # torchrun restarts the whole group; a failed pod is replaced by the Job, resuming from the checkpoint
    restartPolicy: Never
    {{- with .subdomain }}
    subdomain: {{ . }}
    {{- end }}
    serviceAccountName: {{ include "omrl.fullname" $root }}
    automountServiceAccountToken: false
    securityContext:
      {{- include "omrl.podSecurityContext" $root | nindent 6 }}
    {{- with include "omrl.scheduling" (dict "root" $root "values" $v "gpus" $v.gpus) }}{{ . | nindent 4 }}{{- end }}
    containers:
      - name: learner
        image: {{ include "omrl.image" (dict "root" $root "key" "learner" "component" "learner") }}
        imagePullPolicy: {{ $root.Values.image.pullPolicy }}
        {{- if $distributed }}
        command:
          - torchrun
          - --nnodes={{ $v.nodes }}
          - --nproc_per_node={{ $nproc }}
          - --node_rank=$(JOB_COMPLETION_INDEX)
          - --master_addr={{ .masterAddr }}
          - --master_port={{ $v.rendezvousPort }}
          - -m
          - services.learner
        {{- else }}
        command: [python, -m, services.learner]
        {{- end }}
        args:
          {{- include "omrl.configArgs" $root | nindent 10 }}
          - --metrics-port={{ $v.metricsPort }}
          {{- with $v.extraArgs }}
          {{- toYaml . | nindent 10 }}
          {{- end }}
        env:
          {{- with include "omrl.redis.env" $root }}{{ . | nindent 10 }}{{- end }}
          - name: HOME
            value: /tmp
          {{- include "omrl.serviceEnv" $root | nindent 10 }}
          {{- include "omrl.weightToken.env" $root | nindent 10 }}
          {{- with include "omrl.weightDist.env" $root }}{{ . | nindent 10 }}{{- end }}
          - name: HF_HOME
            value: /cache/hf
          - name: TRITON_CACHE_DIR
            value: /cache/triton
          {{- with $v.extraEnv }}
          {{- toYaml . | nindent 10 }}
          {{- end }}
        ports:
          - name: metrics
            containerPort: {{ $v.metricsPort }}
          - name: rendezvous
            containerPort: {{ $v.rendezvousPort }}
          {{- if eq (include "omrl.weightDist.enabled" $root) "true" }}
          # rank 0's rendezvous store of the nccl weight push (NCCL/gloo then connect on ephemeral ports)
          - name: weight-sync
            containerPort: {{ include "omrl.weightDist.port" $root }}
          {{- end }}
        {{- if eq (int $v.nodes) 1 }}
        # rank 0 (in this pod) serves /metrics once the model is loaded and the run state is read
        startupProbe:
          httpGet:
            path: /metrics
            port: metrics
          periodSeconds: {{ $v.probes.startupPeriodSeconds }}
          failureThreshold: {{ $v.probes.startupFailureThreshold }}
          timeoutSeconds: {{ $v.probes.timeoutSeconds }}
        livenessProbe:
          httpGet:
            path: /metrics
            port: metrics
          periodSeconds: {{ $v.probes.livenessPeriodSeconds }}
          failureThreshold: {{ $v.probes.livenessFailureThreshold }}
          timeoutSeconds: {{ $v.probes.timeoutSeconds }}
        {{- end }}
        resources:
          {{- include "omrl.resources" (dict "root" $root "values" $v "gpus" $v.gpus) | nindent 10 }}
        securityContext:
          {{- include "omrl.containerSecurityContext" (dict "readOnlyRootFilesystem" $v.readOnlyRootFilesystem) | nindent 10 }}
        volumeMounts:
          {{- include "omrl.scratchMounts" $root | nindent 10 }}
          {{- include "omrl.modelMounts" $root | nindent 10 }}
          - name: data
            mountPath: /data
    volumes:
      {{- include "omrl.scratchVolumes" $root | nindent 6 }}
      {{- include "omrl.modelVolumes" (dict "root" $root "shm" $v.shmSizeLimit) | nindent 6 }}
      - name: data
        {{- if $v.persistence.volume }}
        {{- toYaml $v.persistence.volume | nindent 8 }}
        {{- else if $v.persistence.enabled }}
        persistentVolumeClaim:
          claimName: {{ $v.persistence.existingClaim | default (printf "%s-data" (include "omrl.component" $ctx)) }}
        {{- else }}
        emptyDir: {}
        {{- end }}
{{- end -}}
