"""Video memory: constant budget over long streams, deterministic consolidation, question-aware selection,
and snapshots that stay consistent while a writer runs."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from runtime.memory.star import abstract_init, abstract_update, kmeans_pp, pool_grid, weighted_kmeans
from runtime.memory.video import MemorySizes, MemorySnapshot, VideoMemory

DIM = 16


def frames(n: int, tokens: int = 64, *, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(n, tokens, DIM, generator=gen) * scale


def by_kind(snap: MemorySnapshot, query: torch.Tensor | None = None) -> dict[str, list]:
    out: dict[str, list] = {"temporal": [], "abstract": [], "retrieved": [], "spatial": []}
    for b in snap.blocks(query):
        out[b.kind].append(b)
    return out


# -- star.py ------------------------------------------------------------------------------------------------


def test_weighted_kmeans_recovers_clusters_and_respects_weights():
    gen = torch.Generator().manual_seed(1)
    centres = torch.tensor([[10.0, 0.0], [-10.0, 0.0], [0.0, 10.0]])
    truth = torch.arange(3).repeat_interleave(20)
    points = centres[truth] + 0.3 * torch.randn(60, 2, generator=gen)
    result = weighted_kmeans(points, torch.ones(60), 3, iters=10, generator=torch.Generator().manual_seed(0))
    # Same partition as the truth, up to relabelling, and centroids at the blob means.
    pairs = set(zip(truth.tolist(), result.assign.tolist(), strict=True))
    assert len(pairs) == 3 and len({c for _, c in pairs}) == 3
    for t, c in pairs:
        torch.testing.assert_close(result.centroids[c], points[truth == t].mean(0))

    # A heavy point pulls its centroid: 9 x [0] + 1 x [1] -> 0.1, not the unweighted 0.5.
    pts = torch.tensor([[0.0], [1.0], [100.0], [101.0]])
    result = weighted_kmeans(pts, torch.tensor([9.0, 1.0, 1.0, 3.0]), 2, generator=torch.Generator().manual_seed(0))
    got = sorted(result.centroids.flatten().tolist())
    assert got == pytest.approx([0.1, 100.75])


def test_pool_and_abstract_update_math():
    x = torch.arange(16.0).reshape(1, 16, 1)  # a 4x4 grid, row-major
    assert pool_grid(x, 4, 2).flatten().tolist() == [2.5, 4.5, 10.5, 12.5]
    f = torch.randn(64, DIM, generator=torch.Generator().manual_seed(0))
    a = abstract_init(f, 25)
    assert a.shape == (25, DIM)
    expect = 0.8 * a + 0.2 * torch.softmax(a @ f.T / DIM**0.5, dim=-1) @ f
    torch.testing.assert_close(abstract_update(a, f[None], 0.2), expect)


def test_kmeans_pp_never_picks_a_point_twice_even_among_duplicates():
    # Exact duplicates (a still scene) are at distance 0 from a chosen copy, so they carry no D^2 mass: once all the
    # mass is gone the pick falls back to any point not yet taken, never to a taken one.
    a, b = [1.0, 2.0], [3.0, -1.0]
    points = torch.tensor([a, a, a, b])
    for seed in range(10):
        every = kmeans_pp(points, torch.ones(4), 4, torch.Generator().manual_seed(seed))
        assert sorted(every.tolist()) == [0, 1, 2, 3]  # k = n: each point once
        two = kmeans_pp(points, torch.ones(4), 2, torch.Generator().manual_seed(seed))
        assert len(set(two.tolist())) == 2 and sorted(points[two].tolist()) == [a, b]  # the distinct point is a seed
        # A point of zero weight has no mass either; when only it and copies of a seed are left, it is taken
        # before a copy (a copy seeds a cluster that is certain to stay empty), however near it lies (0.5 away).
        near = torch.tensor([a, a, a, [1.5, 2.0]])
        light = kmeans_pp(near, torch.tensor([1.0, 1.0, 1.0, 0.0]), 2, torch.Generator().manual_seed(seed))
        assert light[0] != 3 and light[1] == 3


def test_weighted_kmeans_on_duplicates_leaves_an_empty_last_cluster_on_its_seed():
    # Two values twice each into 3 clusters: the third seed is a copy of an earlier one, and every point ties
    # between the two copies and goes to the lower cluster, so the last cluster is always empty (a one-hot sized by
    # the largest cluster used rather than by k would crash here).
    a, b = [1.0, 2.0], [3.0, -1.0]
    points = torch.tensor([a, a, b, b])
    for seed in range(5):
        result = weighted_kmeans(points, torch.ones(4), 3, generator=torch.Generator().manual_seed(seed))
        init = result.init.tolist()
        assert len(set(init)) == 3 and sorted({tuple(points[i].tolist()) for i in init}) == [tuple(a), tuple(b)]
        assert torch.bincount(result.assign, minlength=3)[2] == 0
        assert result.assign.tolist() in ([0, 0, 1, 1], [1, 1, 0, 0])
        assert result.centroids[:2].tolist() == [points[init[0]].tolist(), points[init[1]].tolist()]
        assert torch.equal(result.centroids[2], points[init[2]])  # empty: its seed, not a zero mean

    # A cluster of total weight 1 (two half-weighted points) sits at their weighted mean, not at its seed.
    pts = torch.tensor([[0.0], [1.0], [100.0], [103.0]])
    result = weighted_kmeans(pts, torch.full((4,), 0.5), 2, generator=torch.Generator().manual_seed(0))
    assert sorted(result.centroids.flatten().tolist()) == [0.5, 101.5]


# -- video.py -----------------------------------------------------------------------------------------------


def test_budget_bounds_and_conservation_over_10000_frames():
    sizes = MemorySizes(segment_s=5.0, max_segments=16, buffer_frames=120)
    memory = VideoMemory(sizes, DIM)
    gen = torch.Generator().manual_seed(0)
    assert sizes.budget() == 64 + 25 * 16 + 25 + 3 * 64 == 681
    written = 0
    while written < 10_000:
        n = min(int(torch.randint(1, 200, (1,), generator=gen)), 10_000 - written)
        memory.write(frames(n, gen=gen), [float(t) for t in range(written, written + n)])
        written += n
        snap = memory.snapshot()
        assert snap.frames_seen == written and snap.tokens <= sizes.budget()
        if written >= sizes.spatial_frames + sizes.temporal_slots:
            assert snap.tokens == sizes.budget()
        assert len(snap.segments) <= sizes.max_segments and snap.buffered <= sizes.buffer_frames
        assert sum(snap.temporal_weights) == snap.frames_consolidated == written - sizes.spatial_frames
        assert len(snap.temporal_weights) == sizes.temporal_slots or written <= 26
        assert sum(s.frames for s in snap.segments) == written  # merges lose no frames
        assert all(a.end <= b.start for a, b in zip(snap.segments, snap.segments[1:], strict=False))
    # Bounded writer state: nothing grows with the stream.
    assert len(memory._kf_keys) == len(snap.segments)
    assert memory._ring.frames.shape[0] == sizes.buffer_frames
    kinds = by_kind(snap)
    assert [len(kinds[k]) for k in ("temporal", "abstract", "retrieved", "spatial")] == [25, 1, 3, 1]
    starts = [b.start for b in kinds["temporal"]]
    assert starts == sorted(starts)
    assert kinds["spatial"][0].start == snap.last_time == 9999.0


def _stream(seed: int) -> list:
    memory = VideoMemory(MemorySizes(temporal_slots=5, retrieved_frames=2, buffer_frames=40, seed=seed), DIM)
    gen = torch.Generator().manual_seed(123)
    t = 0
    for n in [1, 3, 7, 20, 2, 40, 5, 1, 60, 9]:
        memory.write(frames(n, gen=gen), [float(t + i) for i in range(n)])
        t += n
    return memory.snapshot().blocks()


def test_consolidation_is_deterministic_for_a_seed():
    a, b, c = _stream(0), _stream(0), _stream(1)
    assert [(x.kind, x.key, x.start, x.end) for x in a] == [(x.kind, x.key, x.start, x.end) for x in b]
    assert all(torch.equal(x.embeds, y.embeds) for x, y in zip(a, b, strict=True))
    temporal = [(x.embeds, y.embeds) for x, y in zip(a, c, strict=True) if x.kind == "temporal"]
    assert not all(torch.equal(x, y) for x, y in temporal)  # another seed, another clustering


def test_selection_finds_a_planted_segment():
    sizes = MemorySizes(segment_s=10.0, retrieved_frames=2)
    memory = VideoMemory(sizes, DIM)
    gen = torch.Generator().manual_seed(5)
    q = torch.zeros(DIM)
    q[3] = 1.0
    for seg in range(30):
        x = frames(10, gen=gen)
        if seg == 17:
            x = x * 0.3 + 2.0 * q  # every token leans toward q
            planted = x
        memory.write(x, [seg * 10.0 + i for i in range(10)])
    snap = memory.snapshot()
    picked = snap.select(q, 1)
    assert len(picked) == 1 and picked[0].start == 170.0 and picked[0].end == 179.0
    assert max(snap.scores(q)) == snap.scores(q)[snap.segments.index(picked[0])]
    means = planted.mean(1)  # the keyframe is the segment's frame nearest its mean
    assert picked[0].keyframe_time == 170.0 + int(((means - means.mean(0)) ** 2).sum(1).argmin())
    assert [s.start for s in snap.select(q)] == sorted(s.start for s in snap.select(q))
    retrieved = by_kind(snap, q)["retrieved"]
    assert picked[0].keyframe_time in [b.start for b in retrieved]
    block = next(b for b in retrieved if b.start == picked[0].keyframe_time)
    assert torch.equal(block.embeds, picked[0].keyframe) and 170.0 <= block.start <= 179.0
    again = by_kind(snap, q)["retrieved"]
    assert [b.key for b in again] == [b.key for b in retrieved]  # same question, same keys: KV reusable
    assert sum(b.embeds.shape[0] for b in snap.blocks(q)) <= sizes.budget()


def test_snapshots_stay_consistent_under_concurrent_writes():
    sizes = MemorySizes(temporal_slots=8, buffer_frames=50, segment_s=7.0, max_segments=6)
    memory = VideoMemory(sizes, DIM)
    errors: list[BaseException] = []

    def writer() -> None:
        try:
            gen = torch.Generator().manual_seed(9)
            for start in range(0, 1000, 5):
                x = frames(5, gen=gen)
                x[:, :, 0] = torch.arange(start, start + 5, dtype=torch.float32)[:, None]  # content names its time
                memory.write(x, [float(t) for t in range(start, start + 5)])
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    thread = threading.Thread(target=writer)
    thread.start()
    kept: list[tuple[torch.Tensor, torch.Tensor]] = []
    qgen = torch.Generator().manual_seed(3)
    seen_keys: dict[int, torch.Tensor] = {}
    version, snaps, last = -1, 0, None
    while thread.is_alive() or snaps == 0:
        snap = memory.snapshot()
        if snap is last:
            time.sleep(0.0002)  # let the writer have the GIL; checking the same snapshot again proves nothing
            continue
        last, snaps = snap, snaps + 1
        assert snap.version > version
        version = snap.version
        assert snap.tokens <= sizes.budget()
        assert all(a.end <= b.start for a, b in zip(snap.segments, snap.segments[1:], strict=False))
        assert all(s.closed for s in snap.segments[:-1]) and (not snap.segments or not snap.segments[-1].closed)
        query = torch.randn(DIM, generator=qgen)
        blocks = snap.blocks()
        assert sum(b.embeds.shape[0] for b in snap.blocks(query)) <= sizes.budget()
        if snap.frames_seen:
            spatial = blocks[-1]
            assert spatial.kind == "spatial" and spatial.start == snap.last_time == snap.frames_seen - 1
            assert torch.all(spatial.embeds[:, 0] == spatial.start)
            assert sum(s.frames for s in snap.segments) == snap.frames_seen
            assert sum(snap.temporal_weights) == snap.frames_consolidated
        for b in blocks + snap.blocks(query):  # a key names one content, in every snapshot
            if b.key in seen_keys:
                assert torch.equal(seen_keys[b.key], b.embeds)
            else:
                seen_keys[b.key] = b.embeds.clone()
        if snaps % 10 == 1 and len(kept) < 500:
            tensors = [b.embeds for b in blocks + snap.blocks(query)] + [s.keyframe for s in snap.segments]
            kept += [(t, t.clone()) for t in tensors + [s.mean for s in snap.segments]]
    thread.join()
    assert not errors, errors
    assert snaps > 10 and memory.snapshot().frames_seen == 1000 and memory.snapshot().version == 200
    assert all(torch.equal(live, copy) for live, copy in kept)  # nothing published was written over


def test_notes_attach_steer_selection_and_follow_merges():
    sizes = MemorySizes(segment_s=2.0, max_segments=4, retrieved_frames=1)
    memory = VideoMemory(sizes, DIM)
    gen = torch.Generator().manual_seed(2)
    base = torch.randn(DIM, generator=gen)
    alike = base + 0.01 * torch.randn(5, 64, DIM, generator=gen)  # segments A and B look the same
    first = torch.cat([frames(2, gen=gen, scale=3.0), alike])  # X, then A (2 frames) and B (3 frames)
    assert [s.start for s in memory.write(first, [0.0, 1.0, 2.0, 3.0, 4.0, 4.5, 5.0])] == [0.0, 2.0]
    closed = memory.write(frames(2, gen=gen, scale=3.0), [6.0, 7.0])  # B closes; C open: 4 segments, no merge
    a_id, b_id = memory.snapshot().segments[1].id, closed[0].id
    q = torch.randn(DIM, generator=gen)
    version = memory.snapshot().version
    assert memory.set_note(a_id, "a red car enters", q)
    assert memory.set_note(b_id, "the car parks")
    snap = memory.snapshot()
    assert snap.version == version + 2
    assert snap.segments[1].note == "a red car enters" and torch.equal(snap.segments[1].note_embedding, q)
    assert snap.select(q, 1)[0].id == a_id and snap.scores(q)[1] == pytest.approx(1.0)

    memory.write(frames(1, gen=gen, scale=3.0), [8.0])  # C closes: 5 segments > 4, so alike A and B merge
    snap = memory.snapshot()
    assert len(snap.segments) == 4
    merged = snap.segments[1]
    assert merged.note == "a red car enters; the car parks" and (merged.start, merged.end, merged.frames) == (2, 5, 5)
    assert 4.0 <= merged.keyframe_time <= 5.0  # the bigger side's keyframe
    assert merged.id not in (a_id, b_id) and not memory.set_note(a_id, "gone") and not memory.set_note(b_id, "gone")
    assert snap.select(q, 1)[0].id == merged.id  # the note's embedding survives the merge
    assert memory.set_note(snap.segments[-1].id, "open segment note")  # the open segment takes notes too
    assert memory.snapshot().segments[-1].note == "open segment note"
    long = VideoMemory(sizes, DIM)  # joined notes stay bounded
    long.write(torch.cat([alike[:4], alike[:4]]), [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0])
    for seg in long.snapshot().segments:
        long.set_note(seg.id, "x" * 200)
    long.write(alike[:2], [8.0, 9.0])
    assert max(len(seg.note) for seg in long.snapshot().segments) == 300


def test_a_static_scene_keeps_the_budget_and_conserves_weight():
    # Identical frames leave k-means nothing to separate: duplicate seeds and empty clusters must stay sound.
    sizes = MemorySizes(temporal_slots=5, buffer_frames=20)
    memory = VideoMemory(sizes, DIM)
    still = torch.ones(1, 64, DIM)
    keys = []
    for t in range(30):
        memory.write(still.repeat(2, 1, 1), [2.0 * t, 2.0 * t + 1])
        snap = memory.snapshot()
        assert sum(snap.temporal_weights) == snap.frames_consolidated == 2 * t + 1
        assert snap.tokens <= sizes.budget()
        keys.append({b.key for b in snap.blocks() if b.kind == "temporal"})
    assert snap.tokens == sizes.budget() and 0 in snap.temporal_weights
    assert all(k == keys[-1] for k in keys[3:])  # same centroids, same keys: nothing to recompute


def test_memory_owns_its_tensors():
    memory = VideoMemory(MemorySizes(temporal_slots=2, segment_s=3.0), DIM)
    x = frames(8, gen=torch.Generator().manual_seed(0))
    memory.write(x, [float(t) for t in range(8)])
    snap = memory.snapshot()
    tensors = [b.embeds for b in snap.blocks()] + [s.keyframe for s in snap.segments]
    before = [t.clone() for t in tensors]
    x.zero_()  # the caller reuses its buffer
    assert all(torch.equal(t, b) for t, b in zip(tensors, before, strict=True))


def test_consolidation_changes_only_what_it_merges():
    memory = VideoMemory(MemorySizes(), DIM)
    gen = torch.Generator().manual_seed(8)
    memory.write(frames(40, gen=gen), [float(t) for t in range(40)])
    churn = []
    for t in range(40, 60):
        before = {b.key for b in memory.snapshot().blocks() if b.kind == "temporal"}
        memory.write(frames(1, gen=gen), [float(t)])
        after = {b.key for b in memory.snapshot().blocks() if b.kind == "temporal"}
        churn.append(len(after - before))
    # One new frame into 25 full slots merges one pair: the other slots keep tensor and key (KV stays valid).
    assert max(churn) <= 3 and sum(churn) <= 2.5 * len(churn)


def test_bad_input_and_bad_sizes_raise():
    memory = VideoMemory(MemorySizes(), DIM)
    with pytest.raises(ValueError, match="features"):
        memory.write(torch.zeros(2, 63, DIM), [0.0, 1.0])
    with pytest.raises(ValueError, match="features"):
        memory.write(torch.zeros(2, 64, DIM + 1), [0.0, 1.0])
    with pytest.raises(ValueError, match="times"):
        memory.write(torch.zeros(2, 64, DIM), [0.0])
    with pytest.raises(ValueError, match="non-decreasing"):
        memory.write(torch.zeros(2, 64, DIM), [1.0, 0.5])
    memory.write(torch.zeros(1, 64, DIM), [5.0])
    with pytest.raises(ValueError, match="backwards"):
        memory.write(torch.zeros(1, 64, DIM), [4.0])
    with pytest.raises(ValueError, match="query"):
        memory.snapshot().select(torch.zeros(DIM + 1))
    for bad in (
        dict(grid=8, temporal_grid=3),
        dict(temporal_slots=0),
        dict(abstract_ratio=0.0),
        dict(abstract_ratio=1.5),
        dict(segment_s=0.0),
        dict(max_segments=1),
        dict(buffer_frames=3),
        dict(retrieved_frames=-1),
    ):
        with pytest.raises(ValueError, match="MemorySizes"):
            MemorySizes(**bad).validate()
        with pytest.raises(ValueError):
            VideoMemory(MemorySizes(**bad), DIM)
    MemorySizes().validate()


def test_default_retrieval_takes_buffer_frames_nearest_the_largest_clusters():
    # 2x2 grid pooled to 2x2 (identity), so the buffer frame nearest a centroid is easy to work out here.
    sizes = MemorySizes(grid=2, temporal_grid=2, temporal_slots=2, abstract_tokens=2, retrieved_frames=1)
    gen = torch.Generator().manual_seed(4)
    a_dir, b_dir = torch.zeros(4, DIM), torch.zeros(4, DIM)
    a_dir[:, 0], b_dir[:, 1] = 10.0, 10.0
    a = a_dir + torch.randn(10, 4, DIM, generator=gen)
    b = b_dir + torch.randn(4, 4, DIM, generator=gen)
    b[3] = b[:3].mean(0)  # the spatial frame sits on B's centroid, but it is shown already: never retrieved
    stream = torch.cat([a, b])
    memory = VideoMemory(sizes, DIM)
    memory.write(stream, [float(t) for t in range(14)])
    snap = memory.snapshot()
    assert sorted(snap.temporal_weights) == [3, 10]  # 10 A frames, 3 B frames (the last B is spatial)
    assert sorted((b.start, b.end) for b in by_kind(snap)["temporal"]) == [(0.0, 9.0), (10.0, 12.0)]
    dist_a = ((a - a.mean(0)) ** 2).sum((1, 2))
    near_a, second_a = dist_a.argsort()[:2].tolist()  # A is largest: its frame nearest A's mean
    (retrieved,) = by_kind(snap)["retrieved"]
    assert retrieved.start == float(near_a) and torch.equal(retrieved.embeds, a[near_a])

    def retrieved_times(count: int) -> list[float]:
        memory = VideoMemory(MemorySizes(**{**sizes.__dict__, "retrieved_frames": count}), DIM)
        memory.write(stream, [float(t) for t in range(14)])
        return [blk.start for blk in by_kind(memory.snapshot())["retrieved"]]

    near_b = 10 + int(((b[:3] - b[3]) ** 2).sum((1, 2)).argmin())
    assert retrieved_times(2) == [float(near_a), float(near_b)]
    # More frames than slots: the largest slot again, with the next-nearest frame (frames are distinct).
    assert retrieved_times(3) == sorted([float(near_a), float(second_a), float(near_b)])


def test_a_note_for_no_segment_is_refused_and_a_wrong_embedding_is_an_error():
    memory = VideoMemory(MemorySizes(segment_s=2.0), DIM)
    assert not memory.set_note(0, "nothing written yet")  # no closed and no open segment
    memory.write(frames(2, gen=torch.Generator().manual_seed(0)), [0.0, 1.0])
    sid = memory.snapshot().segments[0].id
    assert not memory.set_note(sid + 1, "no such segment")
    with pytest.raises(ValueError, match=r"note embedding must be \[16\], got \(3,\)"):
        memory.set_note(sid, "bad", torch.zeros(3))
    assert memory.set_note(sid, "fine", torch.ones(DIM, dtype=torch.float64))
    stored = memory.snapshot().segments[0].note_embedding
    assert stored.dtype == torch.float32 and torch.equal(stored, torch.ones(DIM))  # the memory's own dtype


def test_selection_takes_the_configured_number_of_segments_by_default():
    memory = VideoMemory(MemorySizes(segment_s=1.0, retrieved_frames=2), DIM)
    memory.write(frames(6, gen=torch.Generator().manual_seed(4)), [float(t) for t in range(6)])
    snap = memory.snapshot()
    q = torch.randn(DIM, generator=torch.Generator().manual_seed(9))
    assert len(snap.segments) == 6 and len(snap.select(q)) == 2 and len(snap.select(q, 4)) == 4
    assert {s.id for s in snap.select(q)} <= {s.id for s in snap.select(q, 4)}  # the best two are among the best four


def test_a_segment_mean_is_the_mean_of_all_its_frames():
    memory = VideoMemory(MemorySizes(segment_s=10.0), DIM)
    x = frames(7, gen=torch.Generator().manual_seed(6))
    memory.write(x[:3], [0.0, 1.0, 2.0])
    torch.testing.assert_close(memory.snapshot().segments[0].mean, x[:3].mean((0, 1)))
    memory.write(x[3:6], [3.0, 4.0, 5.0])  # the open segment grows over writes
    torch.testing.assert_close(memory.snapshot().segments[0].mean, x[:6].mean((0, 1)))
    memory.write(x[6:], [10.0])  # closes it and opens the next
    closed, opened = memory.snapshot().segments
    assert (closed.frames, opened.frames) == (6, 1)
    torch.testing.assert_close(closed.mean, x[:6].mean((0, 1)))
    torch.testing.assert_close(opened.mean, x[6].mean(0))


def _merge_alike(na: int, nb: int, ea: torch.Tensor | None, eb: torch.Tensor | None):
    """Segments X, A (na frames), B (nb frames), C, then D: five > max_segments 4, and A and B look alike, so
    they merge. Returns the merged segment with A's and B's frames and times."""
    memory = VideoMemory(MemorySizes(segment_s=2.0, max_segments=4), DIM)
    gen = torch.Generator().manual_seed(10 * na + nb)
    base = torch.randn(DIM, generator=gen)
    xa, xb = (base + 0.01 * torch.randn(n, 64, DIM, generator=gen) for n in (na, nb))
    ta, tb = [2.0 + 0.5 * i for i in range(na)], [4.0 + 0.5 * i for i in range(nb)]
    memory.write(torch.cat([frames(2, gen=gen, scale=3.0), xa, xb]), [0.0, 1.0, *ta, *tb])
    memory.write(frames(2, gen=gen, scale=3.0), [6.0, 7.0])
    x_seg, a_seg, b_seg, c_seg = memory.snapshot().segments
    assert (a_seg.frames, b_seg.frames, b_seg.closed, c_seg.closed) == (na, nb, True, False)
    memory.set_note(a_seg.id, "a", ea)
    memory.set_note(b_seg.id, "b", eb)
    memory.write(frames(1, gen=gen, scale=3.0), [8.0])
    segments = memory.snapshot().segments
    assert len(segments) == 4 and segments[0].id == x_seg.id and segments[2].id == c_seg.id
    return segments[1], (xa, ta), (xb, tb)


def _nearest_own_mean(x: torch.Tensor) -> int:
    means = x.mean(1)
    return int(((means - means.mean(0)) ** 2).sum(1).argmin())


def test_a_merged_segment_weighs_its_halves_by_frames_and_keeps_the_bigger_halfs_keyframe():
    gen = torch.Generator().manual_seed(11)
    ea, eb = torch.randn(DIM, generator=gen), torch.randn(DIM, generator=gen)
    for na, nb in [(3, 2), (2, 3), (2, 2)]:
        merged, (xa, ta), (xb, tb) = _merge_alike(na, nb, ea, eb)
        assert (merged.start, merged.end, merged.frames, merged.note) == (2.0, tb[-1], na + nb, "a; b")
        torch.testing.assert_close(merged.mean, torch.cat([xa, xb]).mean((0, 1)))  # every frame counts once
        torch.testing.assert_close(merged.note_embedding, (na * ea + nb * eb) / (na + nb))
        x, t = (xa, ta) if na >= nb else (xb, tb)  # the bigger half; the earlier one on a tie
        k = _nearest_own_mean(x)
        assert merged.keyframe_time == t[k] and torch.equal(merged.keyframe, x[k])
    merged, _, _ = _merge_alike(2, 3, None, eb)  # one half without a note embedding: the other's, unscaled
    torch.testing.assert_close(merged.note_embedding, eb)
    merged, _, _ = _merge_alike(3, 2, None, None)
    assert merged.note_embedding is None and merged.note == "a; b"


def test_a_temporal_slot_spans_the_frames_it_stands_for():
    # 2x2 grid pooled to 2x2 (identity): two far-apart scenes A and B, so the clusters are plain to see.
    sizes = MemorySizes(grid=2, temporal_grid=2, temporal_slots=2, abstract_tokens=2, retrieved_frames=1)
    memory = VideoMemory(sizes, DIM)
    gen = torch.Generator().manual_seed(12)
    a_dir, b_dir = torch.zeros(4, DIM), torch.zeros(4, DIM)
    a_dir[:, 0], b_dir[:, 1] = 10.0, 10.0

    def scene(direction: torch.Tensor, n: int) -> torch.Tensor:
        return direction + torch.randn(n, 4, DIM, generator=gen)

    def spans() -> list[tuple[float, float, int]]:
        snap = memory.snapshot()
        temporal = by_kind(snap)["temporal"]
        return [(b.start, b.end, w) for b, w in zip(temporal, snap.temporal_weights, strict=True)]

    memory.write(torch.cat([scene(a_dir, 5), scene(b_dir, 5)]), [float(t) for t in range(10)])
    assert spans() == [(0.0, 4.0, 5), (5.0, 8.0, 4)]  # frame 9 is the spatial frame
    memory.write(torch.cat([scene(a_dir, 2), scene(b_dir, 1)]), [10.0, 11.0, 12.0])
    # Frames 9 (B), 10 and 11 (A) join the slots: A now stands for 0-4, 10, 11 and B for 5-9.
    assert spans() == [(0.0, 11.0, 7), (5.0, 9.0, 5)]


def test_a_still_scene_slot_keeps_its_key_and_still_spans_every_frame():
    # Identical frames re-cluster onto the same centroid, so a slot takes over its old block (and key): its span
    # must still move on. The empty slot sits on its seed: one of the points k-means was given.
    sizes = MemorySizes(temporal_slots=2, buffer_frames=20)
    memory = VideoMemory(sizes, DIM)
    still = torch.ones(1, 64, DIM)
    before: list[tuple[float, float]] = []
    for t in range(20):
        memory.write(still, [float(t)])
        snap = memory.snapshot()
        temporal = by_kind(snap)["temporal"]
        slots = sorted(zip(snap.temporal_weights, [(b.start, b.end) for b in temporal], strict=True))
        if t >= 3:  # frames 0 .. t-1 consolidated, all into one slot
            (empty_w, empty_span), (full_w, full_span) = slots
            assert (empty_w, full_w, full_span) == (0, t, (0.0, t - 1.0))
            assert empty_span in [*before, (t - 1.0, t - 1.0)]
        before = [span for _, span in slots]
