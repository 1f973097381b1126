package tpgroup

import (
	"fmt"
	"strconv"

	"github.com/kvsidecar/kvsidecar/internal/unixsock"
)

// SocketPath returns the socket path of rank tpRank of engine engineID in
// dir: <dir>/kvsidecar-<id>-tp<rank>.sock. It depends on nothing else — in
// particular not on the device ordinal — so every member computes every
// other member's path. <id> is engineID when it consists only of
// [A-Za-z0-9._-] and fits; otherwise the disallowed bytes are replaced with
// '_', the result is shortened to fit sun_path (107 bytes plus NUL), and
// "-" plus the first 12 hex digits of SHA-256(engineID) is appended, so
// distinct engine ids map to distinct paths (the rule of the local API's
// socket too). It fails with ErrInvalidConfig when the arguments break the
// Member rules, and with an error of class CODE_INVALID_ARGUMENT when dir is
// relative or too long to leave room for any name.
func SocketPath(dir, engineID string, tpRank int) (string, error) {
	if tpRank < 0 || tpRank >= MaxTPSize {
		return "", fmt.Errorf("%w: TPRank=%d: must be in [0, %d)", ErrInvalidConfig, tpRank, MaxTPSize)
	}
	if err := (Member{EngineID: engineID, TPSize: tpRank + 1, TPRank: tpRank}).validate(); err != nil {
		return "", err
	}
	return unixsock.Path(dir, engineID, "-tp"+strconv.Itoa(tpRank)+".sock")
}
