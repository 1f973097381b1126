package e2e

import (
	"bufio"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvsidecar/kvsidecar/internal/testutil"
)

// TestServeShutdownSignals: SIGHUP drains serve like SIGTERM, and a stderr
// whose reader went away (a closed pipe, as when the supervisor's log
// collector dies) does not kill it on the shutdown log lines: it exits 0
// with its local socket removed.
//
// fault-matrix: shutdown-signals
func TestServeShutdownSignals(t *testing.T) {
	tests := []struct {
		name        string
		sig         syscall.Signal
		closeStderr bool
	}{
		{"SIGHUP", syscall.SIGHUP, false},
		{"SIGTERM with stderr a closed pipe", syscall.SIGTERM, true},
		{"SIGHUP with stderr a closed pipe", syscall.SIGHUP, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			env := NewEnv(t)
			tf := env.TLS(t, "s")
			cmd := exec.Command(Binary(t), "serve", "--engine-id", "e", "--tp-size", "1", "--tls-cert", tf.Cert, "--tls-key", tf.Key,
				"--tls-ca", tf.CA, "--socket-dir", env.SocketDir)
			stderr, err := cmd.StderrPipe()
			require.NoError(t, err)
			require.NoError(t, cmd.Start())
			// One goroutine reads stderr until it ends (the process exits, or
			// the test closes the read end) and then reaps the process.
			lines, done := make(chan map[string]any, 256), make(chan error, 1)
			go func() {
				sc := bufio.NewScanner(stderr)
				for sc.Scan() {
					var m map[string]any
					if json.Unmarshal(sc.Bytes(), &m) == nil {
						select {
						case lines <- m:
						default:
						}
					}
				}
				done <- cmd.Wait()
			}()
			t.Cleanup(func() {
				if cmd.ProcessState == nil {
					_ = cmd.Process.Kill()
				}
			})
			var socket string
			timeout := time.After(testutil.Scaled(StartTimeout))
			for socket == "" {
				select {
				case m := <-lines:
					if m["msg"] == "serving" {
						socket, _ = m["socket"].(string)
					}
				case err := <-done:
					require.FailNow(t, "serve exited before serving", "%v", err)
				case <-timeout:
					require.FailNow(t, "no serving line")
				}
			}
			if tc.closeStderr {
				require.NoError(t, stderr.(*os.File).Close())
			}
			require.NoError(t, cmd.Process.Signal(tc.sig))
			select {
			case err := <-done:
				var ee *exec.ExitError
				if errors.As(err, &ee) {
					require.FailNow(t, "serve did not exit 0", "%v (%v)", ee, ee.ProcessState)
				}
				require.NoError(t, err)
			case <-time.After(testutil.Scaled(ExitTimeout)):
				require.FailNow(t, "serve did not exit")
			}
			_, err = os.Stat(socket)
			require.ErrorIs(t, err, os.ErrNotExist, "the local socket is removed")
		})
	}
}
