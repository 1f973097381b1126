// Package codes maps Go errors to the one wire error-code enum (v1.Code) and
// back, so every reply on every channel carries a code the peer can branch on.
//
// A package makes its error classes carry a code by implementing Coder on
// its sentinel or typed errors; Of finds the first Coder in the chain.
package codes
