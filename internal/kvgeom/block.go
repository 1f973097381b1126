package kvgeom

// BlockID is the id of one KV block of a rank: the same id names the block's
// slice in every region of the rank, ids run from 0 to NumBlocks−1, and block
// 0 is the null block a pool never hands out. It is the uint32 of the wire's
// block_ids fields.
type BlockID uint32

// ID is the integer forms a block id takes: int in vmm.Pool, uint32 in the
// wire's block_ids fields and transfer.Access, BlockID here.
type ID interface{ ~int | ~uint32 }

// Wire returns ids as the uint32 block ids of the wire, in order. Block ids
// of a pool fit (NumBlocks is at most 2^31−1); an int outside [0, 2^32)
// wraps, as any uint32 conversion does.
func Wire[T ID](ids []T) []uint32 { return convert[uint32](ids) }

// Ints returns ids as the ints vmm.Pool takes, in order.
func Ints[T ID](ids []T) []int { return convert[int](ids) }

func convert[To, From ID](ids []From) []To {
	out := make([]To, len(ids))
	for i, id := range ids {
		out[i] = To(id)
	}
	return out
}

// Packing is where the blocks of one region sit: blocks of BlockLen bytes,
// packed whole into pages of PageSize bytes, PageSize/BlockLen to a page and
// never straddling one, so block b starts at
// (b / perPage)·PageSize + (b % perPage)·BlockLen and a page's tail shorter
// than a block is padding. PageSize 0 means no pages: block b starts at
// b·BlockLen. When BlockLen divides PageSize (every power-of-2 geometry) both
// read b·BlockLen. It is the rule behind AgentMetadata's Region.page_size.
//
// Check (or NewPacking) tells whether a Packing is one that holds blocks;
// the other methods never divide by zero: a Packing that fails Check is read
// as blocks back to back.
type Packing struct {
	BlockLen uint64 // bytes of one block, > 0
	PageSize uint64 // bytes of one page, 0 (no pages) or at least BlockLen
}

// NewPacking returns the Packing of blocks of blockLen bytes in pages of
// pageSize bytes (0: no pages), or the error of Packing.Check.
func NewPacking(blockLen, pageSize uint64) (Packing, error) {
	p := Packing{BlockLen: blockLen, PageSize: pageSize}
	return p, p.Check()
}

// Check returns nil when BlockLen > 0 and PageSize is 0 or at least
// BlockLen; otherwise an *Error naming block_len (and page_size) with both
// values and the rule.
func (p Packing) Check() error {
	switch {
	case p.BlockLen == 0:
		return errorf([]string{"block_len"}, "block_len=0 must be > 0")
	case p.PageSize != 0 && p.BlockLen > p.PageSize:
		return errorf([]string{"block_len", "page_size"},
			"block_len=%d exceeds the page size (page_size=%d): blocks never straddle a page", p.BlockLen, p.PageSize)
	}
	return nil
}

// BlocksPerPage is PageSize / BlockLen: how many whole blocks fit in one
// page. It is 0 when PageSize is 0 or p fails Check.
func (p Packing) BlocksPerPage() uint64 {
	if p.BlockLen == 0 || p.PageSize < p.BlockLen {
		return 0
	}
	return p.PageSize / p.BlockLen
}

// Offset returns the byte offset of block b inside its region.
func (p Packing) Offset(b BlockID) uint64 {
	per := p.BlocksPerPage()
	if per == 0 {
		return uint64(b) * p.BlockLen
	}
	return uint64(b)/per*p.PageSize + uint64(b)%per*p.BlockLen
}

// BlockAt returns the id of the block holding byte off of a region; bytes of
// a page's padding count as the page's last block. It is a uint64 because an
// offset past the last block can name an id beyond BlockID. A Packing with
// BlockLen 0 holds no blocks: BlockAt is 0.
func (p Packing) BlockAt(off uint64) uint64 {
	per := p.BlocksPerPage()
	switch {
	case p.BlockLen == 0:
		return 0
	case per == 0:
		return off / p.BlockLen
	}
	slot := min((off%p.PageSize)/p.BlockLen, per-1)
	return off/p.PageSize*per + slot
}
