{{/* Names ---------------------------------------------------------------------------------------- */}}
{{- define "omrl.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "omrl.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Object name of a component: omrl.component (dict "root" $ "component" "envs") */}}
{{- define "omrl.component" -}}
{{- printf "%s-%s" (include "omrl.fullname" .root) .component -}}
{{- end -}}

{{/* Labels ------------------------------------------------------------------------------------------ */}}
{{- define "omrl.selectorLabels" -}}
app.kubernetes.io/name: {{ include "omrl.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "omrl.labels" -}}
{{ include "omrl.selectorLabels" . }}
app.kubernetes.io/part-of: openmanus-rl
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
openmanus-rl/run: {{ .root.Values.config.run | default "default" | quote }}
{{- end -}}

{{/* Pods of one component of this release, in the release's namespace, for NetworkPolicy peers.
     Pod labels are trusted: whoever may create pods in this namespace can claim them (docs/operations.md). */}}
{{- define "omrl.peer" -}}
- podSelector:
    matchLabels:
      {{- include "omrl.selectorLabels" . | nindent 6 }}
  namespaceSelector:
    matchLabels:
      kubernetes.io/metadata.name: {{ .root.Release.Namespace }}
{{- end -}}

{{/* Who may scrape the metrics ports: pods of the monitoring namespace, plus networkPolicy.metricsFrom */}}
{{- define "omrl.np.metricsFrom" -}}
{{- $np := .Values.networkPolicy -}}
{{- if $np.monitoringNamespace }}
- namespaceSelector:
    matchLabels:
      kubernetes.io/metadata.name: {{ $np.monitoringNamespace }}
{{- end }}
{{- with $np.metricsFrom }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Environment of every service container: the services bind 127.0.0.1 unless told otherwise (in a pod
     their callers come over the pod IP), and log in the chart's format (services/common/logs.py). Idle
     OpenMP threads spin briefly, then sleep (cpu_budget.OPENMP_IDLE); each service sizes its pools by the
     container's CPU limit (cpu_budget.py) */}}
{{- define "omrl.serviceEnv" -}}
- name: OMRL_BIND_HOST
  value: 0.0.0.0
- name: GOMP_SPINCOUNT
  value: "10000"
- name: OMRL_LOG_FORMAT
  value: {{ .Values.logFormat | quote }}
{{- end -}}

{{/* Weight-push token: the learner sends it with every push, the rollout servers require it */}}
{{- define "omrl.weightToken.secretName" -}}
{{- .Values.weightPush.existingSecret | default (include "omrl.component" (dict "root" . "component" "weight-token")) -}}
{{- end -}}

{{/* The nccl weight push (config.learner.weight_push nccl): "true" or "" */}}
{{- define "omrl.weightDist.enabled" -}}
{{- if eq ((.Values.config.learner | default dict).weight_push | default "grpc") "nccl" }}true{{ end -}}
{{- end -}}

{{/* Rendezvous store port the learner's rank 0 hosts for the nccl weight push */}}
{{- define "omrl.weightDist.port" -}}
{{- $learner := .Values.config.learner | default dict -}}
{{- /* weight_dist_port: its old name, still accepted */ -}}
{{- $learner.weight_nccl_port | default $learner.weight_dist_port | default 29600 -}}
{{- end -}}

{{/* Service in front of the learner's pod 0 (rank 0 hosts the rendezvous store) */}}
{{- define "omrl.weightDist.service" -}}
{{- printf "%s-weights" (include "omrl.component" (dict "root" . "component" "learner")) -}}
{{- end -}}

{{/* NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME of learner and rollout pods (nccl weight push) */}}
{{- define "omrl.weightDist.env" -}}
{{- if and (eq (include "omrl.weightDist.enabled" .) "true") .Values.weightPush.socketIfname -}}
- name: NCCL_SOCKET_IFNAME
  value: {{ .Values.weightPush.socketIfname | quote }}
- name: GLOO_SOCKET_IFNAME
  value: {{ .Values.weightPush.socketIfname | quote }}
{{- end -}}
{{- end -}}

{{- define "omrl.weightToken.env" -}}
- name: OMRL_WEIGHT_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "omrl.weightToken.secretName" . }}
      key: {{ .Values.weightPush.existingSecretKey }}
{{- end -}}

{{/* Sandbox server of the python toolset (sandbox.enabled, templates/sandbox.yaml) -------------------- */}}
{{- define "omrl.sandbox.name" -}}
{{- include "omrl.component" (dict "root" . "component" "sandbox") -}}
{{- end -}}

{{- define "omrl.sandbox.url" -}}
{{- printf "http://%s:%d" (include "omrl.sandbox.name" .) (int .Values.sandbox.port) -}}
{{- end -}}

{{- define "omrl.sandbox.secretName" -}}
{{- .Values.sandbox.auth.existingSecret | default (printf "%s-token" (include "omrl.sandbox.name" .)) -}}
{{- end -}}

{{/* The bearer token, as OMRL_SANDBOX_TOKEN (the server requires it; the toolset's default token_env sends it) */}}
{{- define "omrl.sandbox.tokenEnv" -}}
- name: OMRL_SANDBOX_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "omrl.sandbox.secretName" . }}
      key: {{ .Values.sandbox.auth.existingSecretKey }}
{{- end -}}

{{/* The python toolsets of the run config that run on the sandbox server: those naming no `endpoint` get the
     server's URL and its options (the limits the model is told are the ones the server enforces); of their own
     options only the client side's (max_concurrent, remote_timeout_s) are kept, any other is refused.
     omrl.sandbox.pointTools (dict "root" $ "tools" $cfg.env.tools) changes the tools in place. */}}
{{- define "omrl.sandbox.pointTools" -}}
{{- $root := .root -}}
{{- range $name, $tool := .tools -}}
{{- $own := $tool.options | default dict -}}
{{- if and (eq (toString ($tool.type | default "")) "python") (not $own.endpoint) -}}
{{- range $key, $_ := $own -}}
{{- if not (has $key (list "max_concurrent" "remote_timeout_s")) -}}
{{- fail (printf "config.env.tools.%s.options.%s: this toolset runs on the sandbox server (sandbox.enabled), which takes its settings from sandbox.options; a toolset keeps only max_concurrent and remote_timeout_s (or names an endpoint of its own)" $name $key) -}}
{{- end -}}
{{- end -}}
{{- $server := deepCopy ($root.Values.sandbox.options | default dict) -}}
{{- $_ := set $tool "options" (merge (dict "endpoint" (include "omrl.sandbox.url" $root)) $own $server) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Images: <image.repository>/<component>:<tag>-<flavor> (flavor cpu unless the component sets cuda);
     omrl.image (dict "root" $ "key" "rollout" "component" "rollout" ["flavor" "cuda"]), or with "values" in place
     of "key" for values that are not a top-level key (a reward server's) */}}
{{- define "omrl.image" -}}
{{- $values := .values -}}
{{- if .key }}{{ $values = index .root.Values .key }}{{ end -}}
{{- $own := $values.image | default dict -}}
{{- $tag := $own.tag | default .root.Values.image.tag | default .root.Chart.AppVersion -}}
{{- $flavor := .flavor | default $values.flavor | default "cpu" -}}
{{- if $flavor -}}{{- $tag = printf "%s-%s" $tag $flavor -}}{{- end -}}
{{- $repo := $own.repository | default (printf "%s/%s" .root.Values.image.repository .component) -}}
{{- printf "%s:%s" $repo $tag -}}
{{- end -}}

{{/* Redis ------------------------------------------------------------------------------------------- */}}
{{- define "omrl.redis.host" -}}
{{- if .Values.redis.enabled -}}
{{- include "omrl.component" (dict "root" . "component" "redis") -}}
{{- else -}}
{{- required "externalRedis.host is required when redis.enabled is false" .Values.externalRedis.host -}}
{{- end -}}
{{- end -}}

{{- define "omrl.redis.port" -}}
{{- if .Values.redis.enabled -}}6379{{- else -}}{{- .Values.externalRedis.port -}}{{- end -}}
{{- end -}}

{{- define "omrl.redis.db" -}}
{{- if .Values.redis.enabled -}}0{{- else -}}{{- .Values.externalRedis.db -}}{{- end -}}
{{- end -}}

{{- define "omrl.redis.secretName" -}}
{{- if .Values.redis.enabled -}}
{{- .Values.redis.auth.existingSecret | default (include "omrl.component" (dict "root" . "component" "redis")) -}}
{{- else -}}
{{- .Values.externalRedis.existingSecret -}}
{{- end -}}
{{- end -}}

{{- define "omrl.redis.secretKey" -}}
{{- if .Values.redis.enabled -}}{{- .Values.redis.auth.existingSecretKey -}}{{- else -}}{{- .Values.externalRedis.existingSecretKey -}}{{- end -}}
{{- end -}}

{{/* No password in the URL: the services read it from the env var REDIS_PASSWORD (omrl.redis.env) */}}
{{- define "omrl.redis.url" -}}
{{- $scheme := ternary "rediss" "redis" (and (not .Values.redis.enabled) .Values.externalRedis.tls) -}}
{{- printf "%s://%s:%s/%s" $scheme (include "omrl.redis.host" .) (include "omrl.redis.port" .) (include "omrl.redis.db" .) -}}
{{- end -}}

{{- define "omrl.redis.env" -}}
{{- if ne (include "omrl.redis.secretName" .) "" -}}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "omrl.redis.secretName" . }}
      key: {{ include "omrl.redis.secretKey" . }}
{{- end }}
{{- end -}}

{{/* Run config: .Values.config plus what this deployment decides (addresses, Redis, paths) ---------- */}}
{{- define "omrl.runConfig" -}}
{{- $cfg := deepCopy .Values.config -}}
{{- $envs := include "omrl.component" (dict "root" . "component" "envs") -}}
{{- $reward := include "omrl.component" (dict "root" . "component" "reward") -}}
{{- $rollout := include "omrl.component" (dict "root" . "component" "rollout") -}}
{{- $_ := set $cfg "output_dir" "/data/runs" -}}
{{- $_ = set $cfg "env" (merge (dict "address" (printf "%s:%d" $envs (int .Values.envs.port))) ($cfg.env | default dict)) -}}
{{- $_ = set $cfg "reward" (merge (dict "address" (printf "%s:%d" $reward (int .Values.reward.port))) ($cfg.reward | default dict)) -}}
{{- if .Values.reward.servers -}}
{{- /* the reward servers' summed totals: the `remote` component */ -}}
{{- $components := $cfg.reward.components | default dict -}}
{{- if hasKey $components "remote" -}}
{{- fail "config.reward.components.remote comes from reward.servers: set its weight and deadline with reward.serversWeight and reward.serversTimeoutSeconds" -}}
{{- end -}}
{{- $addresses := dict -}}
{{- range $name, $_ := .Values.reward.servers -}}
{{- $_ := set $addresses $name (include "omrl.rewardServer.address" (dict "root" $ "name" $name)) -}}
{{- end -}}
{{- $params := dict "servers" $addresses "timeout_s" .Values.reward.serversTimeoutSeconds -}}
{{- $_ = set $components "remote" (dict "weight" .Values.reward.serversWeight "params" $params) -}}
{{- $_ = set $cfg.reward "components" $components -}}
{{- end -}}
{{- $_ = set $cfg "rollout" (merge (dict "addresses" (list (printf "%s:%d" $rollout (int .Values.rollout.port)))) ($cfg.rollout | default dict)) -}}
{{- $_ = set $cfg "stream" (merge (dict "redis_url" (include "omrl.redis.url" .)) ($cfg.stream | default dict)) -}}
{{- $_ = set $cfg "learner" (merge (dict "checkpoint_dir" (printf "/data/checkpoints/%s" ($cfg.run | default "default"))) ($cfg.learner | default dict)) -}}
{{- $_ = set $cfg "env" (merge $cfg.env (dict "data_dir" "/datasets/generated")) -}}
{{- if and .Values.sandbox.enabled $cfg.env.tools -}}
{{- include "omrl.sandbox.pointTools" (dict "root" . "tools" $cfg.env.tools) -}}
{{- end -}}
{{- if eq (include "omrl.weightDist.enabled" .) "true" -}}
{{- /* unless given, under its name or its old one (weight_dist_host, still accepted) */ -}}
{{- if not (or $cfg.learner.weight_nccl_host $cfg.learner.weight_dist_host) -}}
{{- $_ = unset $cfg.learner "weight_dist_host" -}}
{{- $_ = set $cfg.learner "weight_nccl_host" (include "omrl.weightDist.service" .) -}}
{{- end -}}
{{- end -}}
{{- /* one number for the GPUs of a rollout pod and its engine's tensor-parallel size */ -}}
{{- $podGpus := int .Values.rollout.gpus -}}
{{- $tp := index $cfg.rollout "gpus" -}}
{{- if kindIs "invalid" $tp -}}
{{- if gt $podGpus 0 }}{{ $_ = set $cfg.rollout "gpus" $podGpus }}{{ end -}}
{{- else if and (gt $podGpus 0) (ne (int $tp) $podGpus) -}}
{{- fail (printf "rollout.gpus (%d GPUs per rollout pod) and config.rollout.gpus (%d, vLLM's tensor-parallel size) disagree: set rollout.gpus only, config.rollout.gpus follows it" $podGpus (int $tp)) -}}
{{- else if and (eq $podGpus 0) (gt (int $tp) 1) -}}
{{- fail (printf "config.rollout.gpus (%d) needs rollout.gpus = %d: tensor parallelism runs on GPU pods" (int $tp) (int $tp)) -}}
{{- end -}}
{{- /* relative paths would land on the pods' read-only root */ -}}
{{- range $field := list "data_dir" "dataset" -}}
{{- $path := index $cfg.env $field | default "" -}}
{{- if and $path (not (hasPrefix "/" $path)) -}}
{{- fail (printf "config.env.%s (%s) must be an absolute path: the pods' root filesystem is read-only (datasets are mounted at /datasets)" $field $path) -}}
{{- end -}}
{{- end -}}
{{- toYaml $cfg -}}
{{- end -}}

{{/* Reward servers (reward.servers, templates/reward-servers.yaml): object name and address of server `name` */}}
{{- define "omrl.rewardServer.name" -}}
{{- include "omrl.component" (dict "root" .root "component" (printf "reward-%s" .name)) -}}
{{- end -}}

{{- define "omrl.rewardServer.address" -}}
{{- printf "%s:%d" (include "omrl.rewardServer.name" .) (int .root.Values.reward.port) -}}
{{- end -}}

{{/* The run config of reward server `name`: the run's, its reward section the server's own components, scored
     within the deadline the `remote` component gives it: omrl.rewardServer.config (dict "root" $ "name" $name) */}}
{{- define "omrl.rewardServer.config" -}}
{{- $cfg := include "omrl.runConfig" .root | fromYaml -}}
{{- $server := index .root.Values.reward.servers .name -}}
{{- $address := include "omrl.rewardServer.address" . -}}
{{- $timeout := .root.Values.reward.serversTimeoutSeconds -}}
{{- $_ := set $cfg "reward" (dict "address" $address "components" $server.components "timeout_s" $timeout) -}}
{{- toYaml $cfg -}}
{{- end -}}

{{/* Arguments every service gets: the run config */}}
{{- define "omrl.configArgs" -}}
- --config=/etc/openmanus-rl/config.yaml
{{- end -}}

{{/* Pods ---------------------------------------------------------------------------------------------- */}}
{{- define "omrl.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .Values.security.runAsUser }}
runAsGroup: {{ .Values.security.runAsGroup }}
fsGroup: {{ .Values.security.fsGroup }}
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/* omrl.containerSecurityContext (dict "readOnlyRootFilesystem" true) */}}
{{- define "omrl.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: {{ .readOnlyRootFilesystem }}
capabilities:
  drop: [ALL]
{{- end -}}

{{/* The shared probe helper (gRPC services, the sandbox server): startup, readiness and liveness with the timings
     (values `probes`, whose `startup` a component may replace with its own budget), each with its own check (a
     probe handler: grpc, httpGet):
     omrl.probes (dict "probes" $timings "startup" $check "readiness" $check "liveness" $check) */}}
{{- define "omrl.probes" -}}
{{- range $kind := list "startup" "readiness" "liveness" }}
{{ $kind }}Probe:
  {{- toYaml (index $ $kind) | nindent 2 }}
  periodSeconds: {{ (index $.probes $kind).periodSeconds }}
  failureThreshold: {{ (index $.probes $kind).failureThreshold }}
  timeoutSeconds: {{ $.probes.timeoutSeconds }}
{{- end }}
{{- end -}}

{{/* gRPC health probes (Kubernetes-native); the startup probe covers model loading */}}
{{/* readiness: the whole server (a rollout server waiting for weights is not ready); startup and
liveness: "omrl.live", SERVING while the process answers (see services/common/grpc_server.py) */}}
{{- define "omrl.grpcProbes" -}}
{{- $live := dict "grpc" (dict "port" .port "service" "omrl.live") -}}
{{- $ready := dict "grpc" (dict "port" .port) -}}
{{- include "omrl.probes" (dict "probes" .probes "startup" $live "readiness" $ready "liveness" $live) | trim -}}
{{- end -}}

{{/* The extended resource a component's GPUs are requested as: omrl.gpuResource (dict "root" $ "values" $v) */}}
{{- define "omrl.gpuResource" -}}
{{- .values.gpuResourceName | default .root.Values.gpu.resourceName -}}
{{- end -}}

{{/* Resources with the component's GPUs added as limits of its GPU resource:
     omrl.resources (dict "root" $ "values" $v "gpus" N) */}}
{{- define "omrl.resources" -}}
{{- $res := deepCopy (.values.resources | default dict) -}}
{{- if gt (int .gpus) 0 -}}
{{- $limits := $res.limits | default dict -}}
{{- $_ := set $limits (include "omrl.gpuResource" .) (int .gpus) -}}
{{- $_ = set $res "limits" $limits -}}
{{- end -}}
{{- toYaml $res -}}
{{- end -}}

{{/* Scheduling fields shared by every pod of a component: omrl.scheduling (dict "root" $ "values" $v ["gpus" N]).
     Only pods that request GPUs get gpu.tolerations, gpu.nodeSelector and gpu.runtimeClassName. */}}
{{- define "omrl.scheduling" -}}
{{- $gpu := gt (int (.gpus | default 0)) 0 -}}
{{- with .root.Values.image.pullSecrets }}
imagePullSecrets:
  {{- range . }}
  - name: {{ . }}
  {{- end }}
{{- end }}
{{- $selector := deepCopy (.values.nodeSelector | default .root.Values.nodeSelector | default dict) -}}
{{- if $gpu }}{{ $selector = merge (deepCopy (.root.Values.gpu.nodeSelector | default dict)) $selector }}{{ end -}}
{{- with $selector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- $tolerations := concat (.root.Values.tolerations | default list) (.values.tolerations | default list) -}}
{{- if $gpu }}{{ $tolerations = concat $tolerations (.root.Values.gpu.tolerations | default list) }}{{ end -}}
{{- with $tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with (.values.runtimeClassName | default (ternary .root.Values.gpu.runtimeClassName "" $gpu)) }}
runtimeClassName: {{ . }}
{{- end }}
{{- with .values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .root.Values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- end -}}

{{/* Writable paths under a read-only root: /tmp (and HOME) and /cache (downloads, compile caches) */}}
{{- define "omrl.scratchVolumes" -}}
- name: config
  configMap:
    name: {{ include "omrl.component" (dict "root" . "component" "config") }}
- name: tmp
  emptyDir:
    sizeLimit: {{ .Values.scratch.tmpSizeLimit }}
{{- end -}}

{{- define "omrl.scratchMounts" -}}
- name: config
  mountPath: /etc/openmanus-rl
  readOnly: true
- name: tmp
  mountPath: /tmp
{{- end -}}

{{/* omrl.modelVolumes (dict "root" $ "shm" "1Gi" ["volume" $source]): caches, shared memory, the model volume
     (`volume`, else modelVolume) */}}
{{- define "omrl.modelVolumes" -}}
- name: cache
  emptyDir:
    sizeLimit: {{ .root.Values.scratch.cacheSizeLimit }}
- name: shm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .shm }}
{{- with .volume | default .root.Values.modelVolume }}
- name: models
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "omrl.modelMounts" -}}
- name: cache
  mountPath: /cache
- name: shm
  mountPath: /dev/shm
{{- if .Values.modelVolume }}
- name: models
  mountPath: /models
  readOnly: true
{{- end }}
{{- end -}}

{{/* Task datasets at /datasets (config.env.data_dir and env.dataset live there) */}}
{{- define "omrl.datasetVolume" -}}
- name: datasets
  {{- with .Values.datasets.volume }}
  {{- toYaml . | nindent 2 }}
  {{- else }}
  emptyDir: {}
  {{- end }}
{{- end -}}

{{- define "omrl.datasetMount" -}}
- name: datasets
  mountPath: /datasets
  {{- if .Values.datasets.readOnly }}
  readOnly: true
  {{- end }}
{{- end -}}

{{/* Kueue labels of a workload submitted to the queue (none without kueue.queueName) */}}
{{/* Workload kind of the jobs the job API launches: jobsApi.jobWorkload, else learner.workload. */}}
{{- define "omrl.jobsApi.workload" -}}
{{- .Values.jobsApi.jobWorkload | default .Values.learner.workload -}}
{{- end -}}

{{- define "omrl.kueueLabels" -}}
{{- with .Values.kueue.queueName }}
kueue.x-k8s.io/queue-name: {{ . }}
{{- with $.Values.kueue.priorityClass }}
kueue.x-k8s.io/priority-class: {{ . }}
{{- end }}
{{- end }}
{{- end -}}

{{- define "omrl.podAnnotations" -}}
checksum/config: {{ include "omrl.runConfig" .root | sha256sum }}
{{- if .metricsPort }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .metricsPort | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- with .values.podAnnotations }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* NetworkPolicy egress rules */}}
{{- define "omrl.np.dns" -}}
- ports:
    - port: 53
      protocol: UDP
    - port: 53
      protocol: TCP
{{- end -}}
{{- define "omrl.np.redisEgress" -}}
{{- if .Values.redis.enabled }}
- to:
    {{- include "omrl.peer" (dict "root" . "component" "redis") | nindent 4 }}
  ports:
    - port: 6379
{{- else }}
- ports:
    - port: {{ .Values.externalRedis.port }}
{{- end }}
{{- end -}}
