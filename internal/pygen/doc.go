// Command pygen writes the Python client's copies of Go constants, so that
// the Python side restates no limit and no error reason by hand (STYLE rule
// 24): python/kvsidecar/limits.py (the largest TP size, descriptors per
// sendmsg, frame limits, the socket path limit, ...) from the Go constants
// themselves, and python/kvsidecar/reasons.py from every codes.Reason
// constant of internal/codes/reason.go, with its comment and its code.
//
// `make generate` runs it from the repository root; `make verify` fails
// when its output differs from the files checked in, and so does its test.
//
//	go run ./internal/pygen -out python/kvsidecar
package main
