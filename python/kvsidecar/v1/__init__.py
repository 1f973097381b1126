"""Generated protobuf modules of kvsidecar's wire protocol (package kvsidecar.v1).

Every ``*_pb2`` module here is produced by ``make generate`` (protoc
``--python_out``) from ``proto/kvsidecar/v1/*.proto``, the same files the Go
code is generated from; ``make verify`` fails when they drift. Do not edit
them by hand.
"""
