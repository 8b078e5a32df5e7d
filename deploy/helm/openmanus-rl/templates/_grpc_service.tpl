{{/* Workload and Service of a CPU-only gRPC service (envs, reward):
     omrl.grpcService (dict "root" $ "component" "envs" "module" "services.envs" ["peers" true] ["datasets" true]
     ["env" $envVarsYaml])
     With "peers", a StatefulSet: each replica has a stable name on a headless Service, and every
     replica is given the others' direct addresses, as an episode lives on the replica that created it
     and calls reaching another replica are forwarded to it (services/envs/replicas.py). */}}
{{- define "omrl.grpcService" -}}
{{- $root := .root -}}
{{- $v := index $root.Values .component -}}
{{- $ctx := dict "root" $root "component" .component -}}
{{- $name := include "omrl.component" $ctx -}}
{{- $peers := printf "%s-peers" $name -}}
apiVersion: apps/v1
kind: {{ ternary "StatefulSet" "Deployment" (default false .peers) }}
metadata:
  name: {{ $name }}
  labels:
    {{- include "omrl.labels" $ctx | nindent 4 }}
spec:
  replicas: {{ $v.replicas }}
  {{- if .peers }}
  serviceName: {{ $peers }}
  podManagementPolicy: Parallel
  {{- end }}
  selector:
    matchLabels:
      {{- include "omrl.selectorLabels" $ctx | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "omrl.labels" $ctx | nindent 8 }}
      annotations:
        {{- include "omrl.podAnnotations" (dict "root" $root "values" $v "metricsPort" $v.metricsPort) | nindent 8 }}
    spec:
      serviceAccountName: {{ include "omrl.fullname" $root }}
      automountServiceAccountToken: false
      securityContext:
        {{- include "omrl.podSecurityContext" $root | nindent 8 }}
      {{- with include "omrl.scheduling" (dict "root" $root "values" $v) }}{{ . | nindent 6 }}{{- end }}
      containers:
        - name: {{ .component }}
          image: {{ include "omrl.image" (dict "root" $root "key" .component "component" .component) }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          command: [python, -m, {{ .module }}]
          args:
            {{- include "omrl.configArgs" $root | nindent 12 }}
            - --port={{ $v.port }}
            - --metrics-port={{ $v.metricsPort }}
            {{- if and .peers (gt (int $v.replicas) 1) }}
            - --replica-id=$(POD_NAME)
            - --advertise=$(POD_NAME).{{ $peers }}:{{ $v.port }}
            {{- range $i := until (int $v.replicas) }}
            - --peer={{ $name }}-{{ $i }}={{ $name }}-{{ $i }}.{{ $peers }}:{{ $v.port }}
            {{- end }}
            {{- end }}
            {{- with $v.extraArgs }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          env:
            - name: POD_NAME
              valueFrom:
                fieldRef:
                  fieldPath: metadata.name
            - name: HOME
              value: /tmp
            {{- include "omrl.serviceEnv" .root | nindent 12 }}
            {{- with .env }}
            {{- . | nindent 12 }}
            {{- end }}
            {{- with $v.extraEnv }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          ports:
            - name: grpc
              containerPort: {{ $v.port }}
            - name: metrics
              containerPort: {{ $v.metricsPort }}
          {{- include "omrl.grpcProbes" (dict "port" $v.port "probes" $root.Values.probes) | nindent 10 }}
          resources:
            {{- include "omrl.resources" (dict "root" $root "values" $v "gpus" 0) | nindent 12 }}
          securityContext:
            {{- include "omrl.containerSecurityContext" (dict "readOnlyRootFilesystem" $v.readOnlyRootFilesystem) | nindent 12 }}
          volumeMounts:
            {{- include "omrl.scratchMounts" $root | nindent 12 }}
            {{- if .datasets }}
            {{- include "omrl.datasetMount" $root | nindent 12 }}
            {{- end }}
      volumes:
        {{- include "omrl.scratchVolumes" $root | nindent 8 }}
        {{- if .datasets }}
        {{- include "omrl.datasetVolume" $root | nindent 8 }}
        {{- end }}
---
{{- if .peers }}
# Headless: the replicas' stable direct addresses, for forwarding calls to an episode's owner.
apiVersion: v1
kind: Service
metadata:
  name: {{ $peers }}
  labels:
    {{- include "omrl.labels" $ctx | nindent 4 }}
    openmanus-rl/peers: "true"
spec:
  clusterIP: None
  publishNotReadyAddresses: true
  selector:
    {{- include "omrl.selectorLabels" $ctx | nindent 4 }}
  ports:
    - name: grpc
      port: {{ $v.port }}
      targetPort: grpc
---
{{- end }}
apiVersion: v1
kind: Service
metadata:
  name: {{ $name }}
  labels:
    {{- include "omrl.labels" $ctx | nindent 4 }}
spec:
  selector:
    {{- include "omrl.selectorLabels" $ctx | nindent 4 }}
  ports:
    - name: grpc
      port: {{ $v.port }}
      targetPort: grpc
      appProtocol: grpc
    - name: metrics
      port: {{ $v.metricsPort }}
      targetPort: metrics
{{- end -}}
