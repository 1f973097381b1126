// Package unixsock is the one helper behind kvsidecar's unix sockets, the
// local API's (localapi) and the TP group's (vmm/tpgroup): the socket path
// of a rank, the directory check, the probe of a socket file left at the
// path, and the listen itself.
//
// A socket is created by bind(2) with the mode the process umask leaves; it
// is chmod-ed to 0600 right after, and no library call changes the
// process-wide umask. What keeps another user out in between is the
// directory: Listen refuses one that is not a directory owned by this user
// with nothing for group or others (ErrUnsafeDir), so nobody else can reach,
// plant or replace a socket in it.
//
//	path, err := unixsock.Path(dir, "prefill-a", "-tp0.sock")
//	err = unixsock.PrepareDir(dir)          // mkdir 0700 if missing, then the check
//	ln, err := unixsock.Listen(ctx, path)   // ErrSocketInUse if a live process serves it
//	defer ln.Close()                        // removes the socket file
package unixsock
