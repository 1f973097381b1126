package fdpass

import (
	"errors"
	"fmt"
	"net"
	"os"
	"sync"

	"golang.org/x/sys/unix"
)

// MaxFilesPerMsg is how many descriptors one sendmsg carries. The kernel's
// limit per SCM_RIGHTS message is SCM_MAX_FD = 253 (include/net/scm.h); a
// frame with more files is sent in several writes.
const MaxFilesPerMsg = 250

// MaxQueued bounds the descriptors a Conn holds for frames not yet taken; a
// peer that sends more is cut off (ErrTooManyFiles) and the extra ones
// closed.
const MaxQueued = 1 << 16

var (
	// ErrRightsTruncated: the kernel dropped descriptors because a control
	// message did not fit (MSG_CTRUNC). The stream can no longer be trusted.
	ErrRightsTruncated = errors.New("fdpass: control message truncated, descriptors lost")
	// ErrTooManyFiles: more descriptors queued than MaxQueued, or a frame
	// with more files than data bytes to carry them.
	ErrTooManyFiles = errors.New("fdpass: too many file descriptors")
	// ErrMissingFiles: a frame declared more descriptors than arrived.
	ErrMissingFiles = errors.New("fdpass: file descriptors missing")
)

// Conn is a unix stream connection that passes descriptors. Read and
// TakeFiles belong to one reader goroutine; WriteWithFiles to one writer.
type Conn struct {
	c   *net.UnixConn
	oob []byte

	mu     sync.Mutex
	queue  []int
	closed bool
}

// New wraps c. The Conn owns c from now on.
func New(c *net.UnixConn) *Conn {
	return &Conn{c: c, oob: make([]byte, unix.CmsgSpace(4*(MaxFilesPerMsg+3)))}
}

// Unix returns the wrapped connection (for deadlines).
func (c *Conn) Unix() *net.UnixConn { return c.c }

// Read reads stream bytes into p and queues every descriptor that came with
// them. Errors: the connection's, ErrRightsTruncated, ErrTooManyFiles.
func (c *Conn) Read(p []byte) (int, error) {
	n, oobn, flags, _, err := c.c.ReadMsgUnix(p, c.oob)
	n, oobn = max(n, 0), max(oobn, 0) // -1 on some errors
	if oobn > 0 {
		if qerr := c.queueRights(c.oob[:oobn]); qerr != nil {
			return n, qerr
		}
	}
	if flags&unix.MSG_CTRUNC != 0 {
		return n, ErrRightsTruncated
	}
	return n, err
}

func (c *Conn) queueRights(oob []byte) error {
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return fmt.Errorf("fdpass: control message: %w", err)
	}
	var fds []int
	for i := range msgs {
		if msgs[i].Header.Level != unix.SOL_SOCKET || msgs[i].Header.Type != unix.SCM_RIGHTS {
			continue
		}
		got, err := unix.ParseUnixRights(&msgs[i])
		if err != nil {
			return fmt.Errorf("fdpass: rights: %w", err)
		}
		fds = append(fds, got...)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed || len(c.queue)+len(fds) > MaxQueued {
		for _, fd := range fds {
			_ = unix.Close(fd)
		}
		if c.closed {
			return net.ErrClosed
		}
		return fmt.Errorf("%w: %d queued, limit %d", ErrTooManyFiles, len(c.queue)+len(fds), MaxQueued)
	}
	c.queue = append(c.queue, fds...)
	return nil
}

// TakeFiles removes the first n queued descriptors and returns them as
// files the caller owns. Fewer than n queued is ErrMissingFiles (nothing
// taken).
func (c *Conn) TakeFiles(n int) ([]*os.File, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if n > len(c.queue) {
		return nil, fmt.Errorf("%w: frame declares %d, %d arrived", ErrMissingFiles, n, len(c.queue))
	}
	out := make([]*os.File, n)
	for i, fd := range c.queue[:n] {
		out[i] = os.NewFile(uintptr(fd), "fdpass")
	}
	c.queue = append(c.queue[:0], c.queue[n:]...)
	return out, nil
}

// DiscardFiles closes every queued descriptor and returns how many there
// were (a peer that must not send any learns it by the count).
func (c *Conn) DiscardFiles() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := len(c.queue)
	for _, fd := range c.queue {
		_ = unix.Close(fd)
	}
	c.queue = c.queue[:0]
	return n
}

// WriteWithFiles writes b and passes files with it: at most MaxFilesPerMsg
// per sendmsg, each batch attached to the next slice of b, so b must be at
// least as many bytes as there are batches (ErrTooManyFiles otherwise). The
// files stay owned by the caller.
func (c *Conn) WriteWithFiles(b []byte, files []*os.File) error {
	batches := (len(files) + MaxFilesPerMsg - 1) / MaxFilesPerMsg
	if batches > len(b) {
		return fmt.Errorf("%w: %d files need %d data bytes, frame has %d", ErrTooManyFiles, len(files), batches, len(b))
	}
	if batches == 0 {
		_, err := c.c.Write(b)
		return err
	}
	step := len(b) / batches
	for i := range batches {
		fs := files[i*MaxFilesPerMsg : min((i+1)*MaxFilesPerMsg, len(files))]
		fds := make([]int, len(fs))
		for j, f := range fs {
			fds[j] = int(f.Fd())
		}
		chunk := b[i*step : (i+1)*step]
		if i == batches-1 {
			chunk = b[i*step:]
		}
		n, _, err := c.c.WriteMsgUnix(chunk, unix.UnixRights(fds...), nil)
		if err != nil {
			return fmt.Errorf("fdpass: sendmsg with %d files: %w", len(fds), err)
		}
		if n < len(chunk) {
			if _, err := c.c.Write(chunk[n:]); err != nil {
				return err
			}
		}
	}
	return nil
}

// Close closes the connection and every queued descriptor. A second Close
// returns an error wrapping net.ErrClosed.
func (c *Conn) Close() error {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return fmt.Errorf("fdpass: %w", net.ErrClosed)
	}
	c.closed = true
	c.mu.Unlock()
	c.DiscardFiles()
	return c.c.Close()
}
