package tpgroup

import (
	"context"
	"fmt"
	"net"
	"sync"
)

// pipeNet is an in-memory network of group members for tests under
// testing/synctest: unix sockets are real I/O and never "durably blocked",
// so a bubble's fake clock could not advance past a goroutine waiting on
// one, while net.Pipe is built from channels and timers of the bubble.
type pipeNet struct {
	mu sync.Mutex
	ls map[int]*pipeListener
}

func newPipeNet() *pipeNet { return &pipeNet{ls: map[int]*pipeListener{}} }

// listener returns rank's listener. backlog is how many dialed connections
// wait unaccepted before dial blocks.
func (n *pipeNet) listener(rank, backlog int) *pipeListener {
	n.mu.Lock()
	defer n.mu.Unlock()
	l := &pipeListener{conns: make(chan net.Conn, backlog), done: make(chan struct{})}
	n.ls[rank] = l
	return l
}

func (n *pipeNet) dial(ctx context.Context, rank int) (net.Conn, error) {
	n.mu.Lock()
	l := n.ls[rank]
	n.mu.Unlock()
	if l == nil {
		return nil, fmt.Errorf("pipenet: no listener for rank %d", rank)
	}
	client, server := net.Pipe()
	select {
	case l.conns <- server:
		return client, nil
	case <-l.done:
		return nil, fmt.Errorf("pipenet: rank %d: %w", rank, net.ErrClosed)
	case <-ctx.Done():
		return nil, context.Cause(ctx)
	}
}

type pipeListener struct {
	conns chan net.Conn
	done  chan struct{}
	once  sync.Once
}

func (l *pipeListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.conns:
		return c, nil
	case <-l.done:
		return nil, net.ErrClosed
	}
}

func (l *pipeListener) Close() error {
	l.once.Do(func() { close(l.done) })
	return nil
}

func (l *pipeListener) Addr() net.Addr { return pipeAddr{} }

type pipeAddr struct{}

func (pipeAddr) Network() string { return "pipe" }
func (pipeAddr) String() string  { return "pipe" }
