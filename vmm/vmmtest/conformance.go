package vmmtest

import (
	"bytes"
	"errors"
	"net"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/kvsidecar/kvsidecar/vmm"
)

// Stater is implemented by backends that can report how much memory the OS
// holds for their pages (the host backend: the memfd's st_blocks × 512).
type Stater interface {
	Stat() (size, allocated uint64, err error)
}

// RunConformance runs the suite against fresh backends from newBackend, one
// per subtest; newBackend registers the backend's Close with t.Cleanup (a
// second Close error wrapping net.ErrClosed is fine) or calls t.Skip.
func RunConformance(t *testing.T, newBackend func(t testing.TB) vmm.Backend) {
	t.Helper()
	t.Run("granularity", func(t *testing.T) {
		b := newBackend(t)
		g := b.Granularity()
		require.NotZero(t, g)
		require.Zero(t, g%4096, "granularity %d not a multiple of 4 KiB", g)
	})
	t.Run("map write read unmap", func(t *testing.T) {
		b := newBackend(t)
		g := b.Granularity()
		base := reserve(t, b, 3*g)
		h := create(t, b)
		require.NoError(t, b.Map(base+g, h))
		require.NoError(t, b.SetAccess(base+g, g))
		want := pattern(int(g), 7)
		require.NoError(t, b.CopyIn(base+g, want))
		got := make([]byte, g)
		require.NoError(t, b.CopyOut(base+g, got))
		require.True(t, bytes.Equal(want, got), "read back differs from what was written")
		// A sub-range at an odd offset reads the same bytes.
		part := make([]byte, 100)
		require.NoError(t, b.CopyOut(base+g+13, part))
		require.Equal(t, want[13:113], part)
		require.NoError(t, b.Unmap(base+g))
		require.NoError(t, b.Release(h))
	})
	t.Run("typed errors", func(t *testing.T) {
		b := newBackend(t)
		g := b.Granularity()
		base := reserve(t, b, 2*g)
		h := create(t, b)
		require.NoError(t, b.Map(base, h))
		h2 := create(t, b)
		tests := []struct {
			name string
			err  error
			want error
		}{
			{"map mapped slot", b.Map(base, h2), vmm.ErrAlreadyMapped},
			{"unmap unmapped slot", b.Unmap(base + g), vmm.ErrNotMapped},
			{"set access on unmapped", b.SetAccess(base+g, g), vmm.ErrNotMapped},
			{"copy out of unmapped", b.CopyOut(base+g, make([]byte, 8)), vmm.ErrNotMapped},
			{"copy into unmapped", b.CopyIn(base+g+8, []byte{1}), vmm.ErrNotMapped},
			{"release mapped page", b.Release(h), vmm.ErrAlreadyMapped},
		}
		for _, tc := range tests {
			t.Run(tc.name, func(t *testing.T) {
				require.ErrorIs(t, tc.err, tc.want)
				require.Contains(t, tc.err.Error(), "vmm: ")
			})
		}
		require.NoError(t, b.Unmap(base))
		require.ErrorIs(t, b.Unmap(base), vmm.ErrNotMapped, "second unmap")
		require.NoError(t, b.Release(h))
		require.NoError(t, b.Release(h2))
	})
	t.Run("export shares the physical page", func(t *testing.T) {
		b := newBackend(t)
		g := b.Granularity()
		base := reserve(t, b, g)
		h := create(t, b)
		require.NoError(t, b.Map(base, h))
		require.NoError(t, b.SetAccess(base, g))
		want := pattern(int(g), 3)
		require.NoError(t, b.CopyIn(base, want))
		f, off, err := b.Export(h)
		require.NoError(t, err)
		defer f.Close()
		if imp, ok := b.(vmm.Importer); ok {
			h2, err := imp.Import(f, off)
			require.NoError(t, err)
			base2 := reserve(t, b, g)
			require.NoError(t, b.Map(base2, h2))
			require.NoError(t, b.SetAccess(base2, g))
			got := make([]byte, g)
			require.NoError(t, b.CopyOut(base2, got))
			require.True(t, bytes.Equal(want, got), "import of the exported fd reads other bytes")
			require.NoError(t, b.Unmap(base2))
			require.NoError(t, b.Release(h2))
		} else {
			// The second place: the exported file mapped as an engine would.
			m, err := unix.Mmap(int(f.Fd()), int64(off), int(g), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
			require.NoError(t, err)
			defer func() { require.NoError(t, unix.Munmap(m)) }()
			require.True(t, bytes.Equal(want, m), "exported fd maps other bytes")
			// And writes through the second mapping are seen through the first.
			m[5] ^= 0xff
			got := make([]byte, 8)
			require.NoError(t, b.CopyOut(base, got))
			require.Equal(t, m[:8], got)
		}
		require.NoError(t, b.Unmap(base))
		require.NoError(t, b.Release(h))
	})
	t.Run("release returns memory", func(t *testing.T) {
		b := newBackend(t)
		st, ok := b.(Stater)
		if !ok {
			t.Skip("backend does not report allocated bytes")
		}
		g := b.Granularity()
		base := reserve(t, b, 4*g)
		var hs []vmm.Handle
		for i := uint64(0); i < 4; i++ {
			h := create(t, b)
			require.NoError(t, b.Map(base+i*g, h))
			require.NoError(t, b.SetAccess(base+i*g, g))
			require.NoError(t, b.CopyIn(base+i*g, pattern(int(g), byte(i))))
			hs = append(hs, h)
		}
		_, before, err := st.Stat()
		require.NoError(t, err)
		require.GreaterOrEqual(t, before, 4*g, "written pages are allocated")
		for i, h := range hs {
			require.NoError(t, b.Unmap(base+uint64(i)*g))
			require.NoError(t, b.Release(h))
		}
		_, after, err := st.Stat()
		require.NoError(t, err)
		require.LessOrEqual(t, after, before-4*g, "punched pages still allocated: %d -> %d bytes", before, after)
		// A released slot is reused and reads zero.
		h := create(t, b)
		require.NoError(t, b.Map(base, h))
		require.NoError(t, b.SetAccess(base, g))
		got := make([]byte, 64)
		require.NoError(t, b.CopyOut(base, got))
		require.Equal(t, make([]byte, 64), got)
		require.NoError(t, b.Unmap(base))
		require.NoError(t, b.Release(h))
	})
	t.Run("outside reservation", func(t *testing.T) {
		b := newBackend(t)
		g := b.Granularity()
		base := reserve(t, b, g)
		h := create(t, b)
		err := b.Map(base+g, h)
		require.Error(t, err)
		require.False(t, errors.Is(err, vmm.ErrAlreadyMapped))
		require.NoError(t, b.Release(h))
	})
	t.Run("concurrent pages", func(t *testing.T) {
		b := newBackend(t)
		g := b.Granularity()
		const n = 8
		base := reserve(t, b, n*g)
		var wg sync.WaitGroup
		errs := make([]error, n)
		for i := range n {
			wg.Go(func() {
				addr := base + uint64(i)*g
				h, err := b.Create()
				if err == nil {
					err = b.Map(addr, h)
				}
				if err == nil {
					err = b.SetAccess(addr, g)
				}
				if err == nil {
					err = b.CopyIn(addr, []byte{byte(i)})
				}
				got := []byte{0}
				if err == nil {
					err = b.CopyOut(addr, got)
				}
				if err == nil && got[0] != byte(i) {
					err = errors.New("wrong byte read back")
				}
				if err == nil {
					err = b.Unmap(addr)
				}
				if err == nil {
					err = b.Release(h)
				}
				errs[i] = err
			})
		}
		wg.Wait()
		for i, err := range errs {
			require.NoError(t, err, "page %d", i)
		}
	})
	t.Run("close twice", func(t *testing.T) {
		b := newBackend(t)
		base := reserve(t, b, b.Granularity())
		h := create(t, b)
		require.NoError(t, b.Map(base, h))
		require.NoError(t, b.Close(), "close with a page still mapped")
		require.ErrorIs(t, b.Close(), net.ErrClosed)
		_, err := b.Create()
		require.ErrorIs(t, err, net.ErrClosed)
	})
}

func reserve(t testing.TB, b vmm.Backend, size uint64) uint64 {
	t.Helper()
	base, err := b.Reserve(size)
	require.NoError(t, err)
	require.NotZero(t, base)
	return base
}

func create(t testing.TB, b vmm.Backend) vmm.Handle {
	t.Helper()
	h, err := b.Create()
	require.NoError(t, err)
	return h
}

func pattern(n int, seed byte) []byte {
	p := make([]byte, n)
	for i := range p {
		p[i] = byte(i*31) ^ seed
	}
	return p
}
