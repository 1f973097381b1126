package connector

import (
	"fmt"
	"strconv"

	"github.com/kvsidecar/kvsidecar/internal/unixsock"
)

// LocalSocketPath returns the local API socket of rank tpRank of engine
// engineID in dir: <dir>/kvsidecar-<id>-tp<rank>-api.sock. Like
// tpgroup.SocketPath it depends only on the engine id and the rank (never
// the device): <id> is engineID when it is only [A-Za-z0-9._-] and fits,
// otherwise a sanitized prefix plus "-" and 12 hex digits of its SHA-256.
// Errors (class CODE_INVALID_ARGUMENT): rank outside [0, MaxTPSize)
// (ErrInvalidArgument), dir not absolute or too long, empty engine id.
func LocalSocketPath(dir, engineID string, tpRank int) (string, error) {
	if tpRank < 0 || tpRank >= MaxTPSize {
		return "", fmt.Errorf("%w: tp_rank %d must be in [0, %d)", ErrInvalidArgument, tpRank, MaxTPSize)
	}
	return unixsock.Path(dir, engineID, "-tp"+strconv.Itoa(tpRank)+"-api.sock")
}

// ErrSocketInUse: another live process serves the socket path. It is the
// one error of both kvsidecar sockets (tpgroup.ErrSocketInUse too).
var ErrSocketInUse = unixsock.ErrSocketInUse
