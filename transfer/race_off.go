//go:build !race

package transfer

// noEarlyStreams is false in normal builds: idempotent requests travel in
// 0-RTT (see race_on.go for race-detector builds).
const noEarlyStreams = false
