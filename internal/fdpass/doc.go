// Package fdpass sends and receives file descriptors beside a byte stream
// over a unix stream socket (SCM_RIGHTS), for the local API between an
// engine and its sidecar.
//
// A writer attaches the files of one frame to the first bytes of that frame;
// the kernel delivers them with the read that returns those bytes, never
// later. A Conn therefore queues every descriptor it receives in arrival
// order, and the reader of a frame that declares n descriptors takes the
// first n of the queue once the frame is complete.
//
//	c := fdpass.New(unixConn)
//	err := c.WriteWithFiles(frame, files) // files are sent, not closed
//	r := wire.NewReader(c, 0)             // c.Read collects descriptors
//	err = r.ReadMsg(&msg)
//	files, err := c.TakeFiles(n)
package fdpass
