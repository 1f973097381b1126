// Package vmmtest holds the conformance suite every vmm.Backend passes: the
// host backend in package vmm's tests and vmm/cuda's on a GPU.
package vmmtest
