package localapi

import (
	"slices"

	"github.com/kvsidecar/kvsidecar/connector"
	"github.com/kvsidecar/kvsidecar/internal/codes"
	v1 "github.com/kvsidecar/kvsidecar/proto/kvsidecar/v1"
)

// Conversions from the cache, the pool and the rank to the reply messages.

func cacheInfo(c *Cache) *v1.KVCacheInfo {
	regs := c.Pool.Regions()
	layout := c.Pool.Layout()
	return &v1.KVCacheInfo{
		Geometry: c.Create.GetGeometry(), TpRank: c.Create.GetTpRank(), TpSize: c.Create.GetTpSize(),
		NumBlocks: uint32(c.Pool.NumBlocks()), HeadsPerRank: uint32(layout.HeadsPerRank),
		BlockLen: regs[0].BlockLen, RegionLen: regs[0].Len, NumRegions: uint32(len(regs)),
		PageSize: c.Pool.PageSize(), EngineId: c.EngineID, DeviceMemory: c.DeviceMemory,
		Ownership: c.Create.GetOwnership(),
	}
}

func statsOf(c *Cache) *v1.StatsReply {
	if c == nil {
		return &v1.StatsReply{}
	}
	ps := c.Pool.Stats()
	rs := c.Rank.Stats()
	regs := c.Pool.Regions()
	var reserved uint64
	for _, r := range regs {
		reserved += r.Len
	}
	return &v1.StatsReply{
		PagesMapped: uint64(ps.PagesMapped), BytesMapped: ps.BytesMapped, BlocksUsed: uint64(ps.BlocksUsed),
		BlocksTotal: uint64(ps.BlocksTotal), MemoryLimitBytes: ps.MemoryLimit, LeasesHeld: uint64(rs.LeasesHeld),
		LoadsInFlight: uint64(rs.LoadsInFlight), DeviceBytes: reserved, ReservePages: uint64(ps.ReservePages),
		ReservationBytes: reserved, PageSize: ps.PageSize, NumRegions: uint64(ps.NumRegions), CacheReady: true,
	}
}

func finishedProto(f connector.Finished) *v1.GetFinishedReply {
	out := &v1.GetFinishedReply{DoneSending: f.DoneSending, DoneRecving: f.DoneRecving}
	for _, fl := range f.Failed {
		fr := &v1.FailedRequest{RequestId: fl.RequestID, Error: codes.ToProto(fl.Err)}
		for _, b := range fl.BlockIDs {
			fr.BlockIds = append(fr.BlockIds, uint32(b))
			out.InvalidBlockIds = append(out.InvalidBlockIds, uint32(b))
		}
		out.Failed = append(out.Failed, fr)
	}
	slices.Sort(out.InvalidBlockIds)
	out.InvalidBlockIds = slices.Compact(out.InvalidBlockIds)
	return out
}
