package kvgen

import (
	"encoding/binary"
	"fmt"
	"hash/fnv"
)

// Shape is the geometry of one block of one region on one rank.
type Shape struct {
	// BlockSize is tokens per block.
	BlockSize int
	// RowBytes is the bytes of one head of one token: head_dim × dtype bytes.
	// It must be a positive multiple of 8.
	RowBytes int
	// FirstHead and Heads are the heads this rank holds, HND order.
	FirstHead, Heads int
}

// BlockLen is the bytes of one block of one region: Heads × BlockSize × RowBytes.
func (s Shape) BlockLen() int { return s.Heads * s.BlockSize * s.RowBytes }

// Validate checks that s can be generated.
func (s Shape) Validate() error {
	if s.BlockSize < 1 || s.RowBytes < 8 || s.RowBytes%8 != 0 || s.Heads < 1 || s.FirstHead < 0 {
		return fmt.Errorf("kvgen: shape %+v: block size, heads >= 1 and row bytes a positive multiple of 8 required", s)
	}
	return nil
}

// Key returns the content key of a prefix-block hash id of a trace.
func Key(hashID int64) uint64 {
	h := fnv.New64a()
	var b [8]byte
	binary.LittleEndian.PutUint64(b[:], uint64(hashID))
	h.Write(b[:])
	return mix(h.Sum64())
}

// mix is the splitmix64 finalizer.
func mix(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	x ^= x >> 31
	return x
}

const golden = 0x9e3779b97f4a7c15

func rowSeed(key uint64, region, head, token int) uint64 {
	return mix(key ^ uint64(region)<<48 ^ uint64(head)<<32 ^ uint64(token))
}

// FillBlock writes into dst (len s.BlockLen()) the content of the block
// whose first token is firstToken, for region and the heads of s.
func FillBlock(dst []byte, s Shape, key uint64, region, firstToken int) {
	off := 0
	for h := s.FirstHead; h < s.FirstHead+s.Heads; h++ {
		for j := range s.BlockSize {
			w := rowSeed(key, region, h, firstToken+j)
			row := dst[off : off+s.RowBytes]
			for i := 0; i < len(row); i += 8 {
				binary.LittleEndian.PutUint64(row[i:], w)
				w += golden
			}
			off += s.RowBytes
		}
	}
}

// CheckBlock compares src (len s.BlockLen()) with the content FillBlock
// writes and returns the number of differing bytes and the offset of the
// first one (-1 when equal).
func CheckBlock(src []byte, s Shape, key uint64, region, firstToken int) (mismatches, first int) {
	first = -1
	off := 0
	for h := s.FirstHead; h < s.FirstHead+s.Heads; h++ {
		for j := range s.BlockSize {
			w := rowSeed(key, region, h, firstToken+j)
			row := src[off : off+s.RowBytes]
			for i := 0; i < len(row); i += 8 {
				if got := binary.LittleEndian.Uint64(row[i:]); got != w {
					for k := range 8 {
						if byte(got>>(8*k)) != byte(w>>(8*k)) {
							if first < 0 {
								first = off + i + k
							}
							mismatches++
						}
					}
				}
				w += golden
			}
			off += s.RowBytes
		}
	}
	return mismatches, first
}
