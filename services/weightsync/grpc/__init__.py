"""The `grpc` weight push (the default): each bucket's bytes in the UpdateWeights stream itself, with its
`set-sha256:` digest, the set checksum in the commit. `send`: the learner's pusher, registered as `grpc`;
`receive`: the rollout server's receiver, which checks each bucket and parks it in a spool file.

(This package is `services.weightsync.grpc`; `import grpc` in any module still means the grpcio library.)"""
