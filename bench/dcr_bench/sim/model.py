"""The timeline model of one refit: closed-form pipeline equations, no event queue.

Quantities (from the scenario)::

    M  = N * b                      raw model bytes (N parameters, b bytes each)
    D  = N * r * e                  delta payload bytes (change rate r, e encoded bytes per changed element)
    T  tensors, taken as equal in size (M / T raw bytes each); chunks of at most c raw bytes do not
       cross tensors: k = ceil(M / (T c)) chunks per tensor, of M / (T k) raw bytes
    n  = T * k * (1 - (1 - r)^(M / (T k b)))
                                    stored chunks: those with at least one change (an all-zero XOR
                                    chunk is not stored)
    T_c = T * (1 - (1 - r)^(M / (T b)))   changed tensors
    s  = D / n                      bytes per stored chunk; CPU stages see M / n raw bytes per chunk

Requests, from the step layout (F = fixed_objects: source, stream indexes, group document)::

    per-object:  PUT = F + T_c + n  (an array document per changed tensor, an object per stored chunk)
                 GET = F + n        (a receiver reads the manifest's chunks, not the array documents)
    packed:      PUT = GET = F + ceil(D / pack_bytes)   (chunks concatenated into packs)

A publish PUTs PUT objects, a mirror GETs and PUTs them, a receiver GETs GET objects: per stored
chunk, q = PUT / n or GET / n requests.

Links. A link has bandwidth B and per-request latency L (round trip plus server time: time a request
holds a worker without moving bytes). k concurrent flows on one link instance get B / k each; a flow
through several links gets the smallest share: ``rate = min_l B_l / k_l``. A link's ``scope`` says how
many flows share an instance: ``per_receiver`` (k = 1), ``per_region`` (the flows of one region),
``global`` (every flow of the phase). Links of different roles are independent (full duplex).

Stages. Objects flow through a chain of stages; stage i spends ``t_i`` per object and ``o_i`` once::

    CPU stage:   t = (M / n) * sum_k (1 / (G_k * 1e9)) / threads  +  (T_c / n) * tau / processes
                                 G_k: GB/s per thread of raw model bytes of each pass k over the data:
                                 publisher: encode + 2 digests (new tensor, chunk payload);
                                 receiver: decode_apply + 2 digests (held bits, chunk payload)
                                 tau: CPU seconds per changed tensor (publish_s_per_tensor in the
                                 encode stage, receive_s_per_tensor in the apply stage), divided among
                                 processes (Python work per tensor: threads do not divide it)
    link stage:  t = max(s / rate + q * L / w + j * s / G,  q / R),   o = L * (1 - 1/w)
                                 w workers keep w requests in flight, so latency costs L / w per request
                                 once the pipe is full, and L for the first; L is the links' latency
                                 plus the store's own time per request (requests.store_ms); G is a
                                 store's own processing rate after an object's bytes arrived (a test
                                 server's CPU; inf for a real object store), j the store passes (1, or
                                 2 for a copy); R the requests per second this client gets under the
                                 store's per-prefix limit (requests.put_per_s / get_per_s x prefixes),
                                 shared by the store's clients: the origin's PUTs by the publisher, its
                                 GETs by every receiver (direct) or by the regions' mirrors (tree); a
                                 region store's PUTs by its mirror, its GETs by its receivers
    pipeline(stages) = sum_i (o_i + t_i) + (n - 1) * max_i t_i

With ``io.shared_cores = C`` (every actor and the store on one machine of C cores: a local
measurement), a streaming pipeline also cannot beat its CPU: ``p0 + n * sum_i (t_i - wire_i) / C``
(what each object costs the cores in every stage, request CPU and store processing included; the
time its bytes spend on the wire costs none). Sequential phases do not overlap, so they are unchanged.

(the classic pipeline bound: the first object crosses every stage, the rest follow at the pace of the
slowest stage). A stage "discovery" (``o = discovery_s``, ``t = 0``) is a reader's delay in noticing
new objects (half its poll interval).

Refits. ``P0`` = what a publish does before its first object (fixed ``publish_s`` plus a snapshot
copy of the new policy, M / copy rate), ``RT_x`` = round trips x latency, ``tail`` = what a receiver
does after it holds every payload and has seen the commit::

    commit      = P0 + pipeline(encode, upload) + RT_publish
    tail        = receive_s + M / digest rate + install_copies * M / copy rate + RT_receive  (verify, install
                                                                           it, record the position)
                  + M / decode_apply rate when streamed (the refit decodes the prefetched stored
                                                         bytes again after the commit)
    direct, sequential:  commit + discovery + pipeline(fetch, decode_apply) + tail
    direct, streaming:   max(P0 + pipeline(encode, upload, discovery, fetch, decode_apply),
                             commit + discovery) + tail
    tree, sequential:    mirror = commit + discovery + pipeline(copy) + mirror_s + RT_mirror
                         mirror + discovery + pipeline(fetch from region, decode_apply) + tail
    tree, streaming:     mirror = max(P0 + pipeline(encode, upload, discovery, copy), commit + discovery)
                                  + mirror_s + RT_mirror
                         max(P0 + pipeline(encode, upload, discovery, copy, discovery, fetch, decode_apply),
                             mirror + discovery) + tail
    full (transport only): pipeline(upload M in parts) [+ pipeline(copy M)] + pipeline(download M)

With ``overlap_cpu_and_io = false`` (an actor whose requests cost CPU on the cores it encodes or
decodes on: measured on a small machine as an effective concurrency of 1 for small requests), the
latency and store terms of its link stage move into its CPU stage (they queue behind its CPU work);
the link stage keeps only the wire time ``s / rate``, which still overlaps.

Streaming is never slower than sequential: one pipeline over the concatenated stages is at most the
sum of the separate pipelines (max over all stages <= sum of the two maxima), and the commit it waits
for comes no later. Receivers of all regions are alike, so one receiver's timeline is everyone's.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from dcr_bench.sim.scenario import LinkSpec, Scenario


@dataclass(frozen=True)
class Stage:
    name: str
    per_item: float
    once: float = 0.0
    wire: float = 0.0  # of per_item, the time the object's bytes occupy the link


@dataclass
class Segment:
    actor: str  # publisher, mirror, receiver
    phase: str
    start: float
    end: float


@dataclass
class Timeline:
    mode: str
    streaming: bool
    total_s: float
    segments: list[Segment] = field(default_factory=list)
    bytes_per_link: dict[str, float] = field(default_factory=dict)
    stages: dict[str, float] = field(default_factory=dict)  # per-object stage times (s), for inspection

    def to_dict(self) -> dict:
        return asdict(self)


def _absorb(cpu: Stage, link: Stage) -> tuple[Stage, Stage]:
    """``cpu`` takes over ``link``'s non-wire time (latency, store), which runs on the same cores."""
    return (Stage(cpu.name, cpu.per_item + link.per_item - link.wire, cpu.once),
            Stage(link.name, link.wire, link.once, link.wire))


def pipeline(n: float, stages: list[Stage]) -> float:
    """Time for ``n`` objects to pass every stage: sum of (once + per object) + (n - 1) x slowest."""
    if not stages:
        return 0.0
    return sum(s.once + s.per_item for s in stages) + max(0.0, n - 1) * max(s.per_item for s in stages)


def _touched(elements: float, rate: float) -> float:
    """Probability that a run of ``elements`` elements holds at least one change."""
    return -math.expm1(elements * math.log1p(-rate)) if rate < 1 else 1.0


@dataclass(frozen=True)
class Sizes:
    raw: float  # M
    delta: float  # D
    objects: float  # n: stored chunks, the items every stage of a refit passes
    object_bytes: float  # s
    full_parts: float
    changed_tensors: float  # T_c
    packs: float  # P (0 in the per-object layout)
    puts: float  # objects a publish writes and a mirror copies
    gets: float  # objects a receive reads

    @staticmethod
    def of(sc: Scenario) -> Sizes:
        m = sc.model
        raw = m.parameters * m.bytes_per_param
        tensor_raw = raw / m.tensors
        per_tensor = math.ceil(tensor_raw / m.chunk_bytes)  # chunks do not cross tensors
        chunk_numel = tensor_raw / per_tensor / m.bytes_per_param
        objects = max(1.0, math.ceil(m.tensors * per_tensor * _touched(chunk_numel, m.change_rate)))
        changed = max(1.0, math.ceil(m.tensors * _touched(tensor_raw / m.bytes_per_param, m.change_rate)))
        delta = m.parameters * m.change_rate * m.bytes_per_change
        if m.layout == "packed":
            packs = max(1.0, math.ceil(delta / m.pack_bytes))
            puts = gets = m.fixed_objects + packs
        else:
            packs = 0.0
            puts, gets = m.fixed_objects + changed + objects, m.fixed_objects + objects
        return Sizes(raw, delta, objects, delta / objects, max(1.0, math.ceil(raw / m.full_part_bytes)),
                     changed, packs, puts, gets)


def _share(link: LinkSpec, flows_per_region: int, regions: int) -> float:
    k = {"per_receiver": 1, "per_region": flows_per_region, "global": flows_per_region * regions}[link.scope]
    return link.bytes_per_s / k


class Model:
    def __init__(self, sc: Scenario):
        self.sc = sc
        self.size = Sizes.of(sc)
        t, links, io = sc.topology, sc.links, sc.io
        self.w = io.workers
        self.store_rate = io.store_mb_per_s * 1e6
        self.receivers = t.regions * t.receivers_per_region
        cpu = sc.cpu
        per_obj_raw = self.size.raw / self.size.objects
        # Per-tensor CPU, spread over the objects: work in Python per tensor, divided among processes.
        tensors_per_obj = self.size.changed_tensors / self.size.objects
        pub_tensor = tensors_per_obj * (cpu.publish_s_per_tensor or 0.0) / cpu.publisher_processes
        rec_tensor = tensors_per_obj * (cpu.receive_s_per_tensor or 0.0) / cpu.receiver_processes
        # Digest passes over the raw bytes: the publisher digests each new tensor and each chunk's
        # payload (2); a receiver checks its held bits and each chunk on arrival (2), then the result (1).
        self.cpu_pub = Stage("encode", per_obj_raw * (1 / cpu.encode_gb_per_s + 2 / cpu.digest_gb_per_s)
                             / (1e9 * cpu.publisher_threads) + pub_tensor)
        self.cpu_rec = Stage("decode+apply", per_obj_raw * (1 / cpu.decode_apply_gb_per_s + 2 / cpu.digest_gb_per_s)
                             / (1e9 * cpu.receiver_threads) + rec_tensor)
        self.verify_s = self.size.raw / (cpu.digest_gb_per_s * 1e9 * cpu.receiver_threads)
        self.snapshot_s = self.size.raw / (cpu.copy_gb_per_s * 1e9 * cpu.publisher_threads)
        self.install_s = self.size.raw / (cpu.copy_gb_per_s * 1e9 * cpu.receiver_threads)
        self.discovery = Stage("discovery", 0.0, io.discovery_s)
        req = sc.requests
        store_s = req.store_ms / 1e3  # every request of a path waits for one store
        self.l_up = links.uplink.latency_s + store_s
        # Reads of the origin: by every receiver (direct) or by one mirror per region (tree).
        egress = [links.origin_egress] if links.origin_egress else []
        self.direct_path = ([links.inter_region, links.receiver, *egress], t.receivers_per_region)
        self.copy_path = ([links.inter_region, *egress], 1)
        self.region_path = ([links.receiver], t.receivers_per_region)
        # A mirror writes into its region's store as one of that store's clients.
        self.l_direct = links.inter_region.latency_s + links.receiver.latency_s + sum(e.latency_s for e in egress) \
            + store_s
        self.l_copy = self.l_direct
        self.l_region = links.receiver.latency_s + store_s
        # Request rates a client may use under a store's per-prefix limits, shared by the clients of
        # that store: the origin's PUTs by the publisher; its GETs by every receiver (direct) or one
        # mirror per region (tree); a region's store's PUTs by its mirror, its GETs by its receivers.
        put_rate, get_rate = req.put_per_s * req.prefixes, req.get_per_s * req.prefixes
        self.put_limit = put_rate
        self.origin_get_limit = get_rate / self.receivers
        self.copy_limit = min(get_rate / t.regions, put_rate)
        self.region_get_limit = get_rate / t.receivers_per_region

    # ---------------------------------------------------------------- stages

    def _rate(self, path: tuple[list[LinkSpec], int], regions: int) -> float:
        links, per_region = path
        return min(_share(link, per_region, regions) for link in links)

    def _link(self, name: str, nbytes: float, rate: float, latency: float, requests: float = 1.0,
              limit: float = math.inf, stores: int = 1) -> Stage:
        """One object over a link: its bytes at the flow's share, the latency of its ``requests``
        requests, and ``stores`` passes of the store's own processing (not overlapped with the same
        object's bytes); no faster than the store lets this client make ``requests`` requests
        (``limit`` per second)."""
        wire = nbytes / rate
        per = max(wire + requests * latency / self.w + stores * nbytes / self.store_rate, requests / limit)
        return Stage(name, per, latency * (1 - 1 / self.w), wire)

    def _delta_stages(self) -> dict[str, Stage]:
        s, regions, n = self.size.object_bytes, self.sc.topology.regions, self.size.objects
        up = self.sc.links.uplink
        put, get = self.size.puts / n, self.size.gets / n  # requests per stored chunk
        return {
            "upload": self._link("upload", s, up.bytes_per_s, self.l_up, put, self.put_limit),
            "fetch_origin": self._link("fetch", s, self._rate(self.direct_path, regions), self.l_direct, get,
                                       self.origin_get_limit),
            "copy": self._link("copy", s, self._rate(self.copy_path, regions), self.l_copy, put, self.copy_limit,
                               stores=2),
            "fetch_region": self._link("fetch", s, self._rate(self.region_path, regions), self.l_region, get,
                                       self.region_get_limit),
        }

    # ---------------------------------------------------------------- modes

    def run(self, mode: str, streaming: bool) -> Timeline:
        if mode == "full":
            return self._full()
        return self._dcr(mode == "tree", streaming)

    def _bytes(self, payload: float, tree: bool) -> dict[str, float]:
        regions = self.sc.topology.regions
        return {"uplink": payload, "inter_region": payload * (regions if tree else self.receivers),
                "receiver": payload * self.receivers}

    def _dcr(self, tree: bool, streaming: bool) -> Timeline:
        o = self.sc.overhead
        st = self._delta_stages()
        n = self.size.objects
        enc, up, dec, disc = self.cpu_pub, st["upload"], self.cpu_rec, self.discovery
        if not self.sc.io.overlap_cpu_and_io:
            # Requests cost CPU on the actor's own cores: their latency and the store's processing
            # queue behind its CPU work (one stage: the sum); only the bytes on the wire overlap.
            enc, up = _absorb(enc, up)
            key = "fetch_region" if tree else "fetch_origin"
            dec, fetched = _absorb(dec, st[key])
            st = {**st, key: fetched}
        p0 = o.publish_s + self.snapshot_s
        chunks_done = p0 + pipeline(n, [enc, up])
        commit = chunks_done + o.publish_round_trips * self.l_up
        segs = [Segment("publisher", "prepare", 0.0, p0), Segment("publisher", "encode+upload", p0, chunks_done),
                Segment("publisher", "commit", chunks_done, commit)]
        first_up = p0 + enc.once + enc.per_item + up.once + up.per_item  # the first object is stored
        fetch, l_read = (st["fetch_region"], self.l_region) if tree else (st["fetch_origin"], self.l_direct)
        if tree:
            cp = st["copy"]
            if streaming:
                copy_start = first_up + disc.once
                copy_done = p0 + self._streamed(n, [enc, up, disc, cp])
                mirror_seen = max(copy_done, commit + disc.once)
            else:
                copy_start = commit + disc.once
                copy_done = copy_start + pipeline(n, [cp])
                mirror_seen = copy_done
            mirror = mirror_seen + o.mirror_s + o.mirror_round_trips * self.l_copy
            segs += [Segment("mirror", "copy", copy_start, copy_done)]
            if mirror_seen > copy_done:
                segs.append(Segment("mirror", "wait for commit", copy_done, mirror_seen))
            segs.append(Segment("mirror", "commit", mirror_seen, mirror))
            ready = mirror  # the step the receivers apply is committed where they read it
            chain = [enc, up, disc, cp, disc, fetch, dec]
        else:
            copy_start = first_up
            ready = commit
            chain = [enc, up, disc, fetch, dec]
        if streaming:
            fetch_start = (copy_start + cp.once + cp.per_item if tree else first_up) + disc.once
            fetch_done = p0 + self._streamed(n, chain)
        else:
            fetch_start = ready + disc.once
            fetch_done = fetch_start + pipeline(n, [fetch, dec])
        apply_start = max(fetch_done, ready + disc.once)
        # A streamed refit holds the stored bytes it checked on arrival and decodes them again when it
        # applies them after the commit (payloads would hold a dense copy of every touched chunk).
        redecode = self.size.raw / (self.sc.cpu.decode_apply_gb_per_s * 1e9 * self.sc.cpu.receiver_threads) \
            if streaming else 0.0
        total = apply_start + redecode + o.receive_s + self.verify_s + o.install_copies * self.install_s \
            + o.receive_round_trips * l_read
        segs.append(Segment("receiver", "fetch+decode", fetch_start, fetch_done))
        if apply_start > fetch_done:
            segs.append(Segment("receiver", "wait for commit", fetch_done, apply_start))
        segs.append(Segment("receiver", "verify+install", apply_start, total))
        stages = {s.name: s.per_item for s in chain if s is not disc}
        return Timeline("tree" if tree else "direct", streaming, total, segs, self._bytes(self.size.delta, tree), stages)

    def _streamed(self, n: float, stages: list[Stage]) -> float:
        """A pipeline whose stages run at once: on a machine of ``shared_cores``, no faster than its CPU."""
        t = pipeline(n, stages)
        cores = self.sc.io.shared_cores
        if cores is None:
            return t
        return max(t, n * sum(s.per_item - s.wire for s in stages) / cores)

    def _full(self) -> Timeline:
        """Transport only: upload the full checkpoint, then every receiver downloads it (through the
        mirrors with ``full_via = "tree"``). No CPU, no streaming."""
        t = self.sc.topology
        tree = t.full_via == "tree"
        parts, raw, regions = self.size.full_parts, self.size.raw, t.regions
        part = raw / parts
        up = self._link("upload", part, self.sc.links.uplink.bytes_per_s, self.l_up, limit=self.put_limit)
        up_done = pipeline(parts, [up])
        segs = [Segment("publisher", "upload", 0.0, up_done)]
        start = up_done
        if tree:
            cp = self._link("copy", part, self._rate(self.copy_path, regions), self.l_copy, limit=self.copy_limit,
                            stores=2)
            copy_done = start + pipeline(parts, [cp])
            segs.append(Segment("mirror", "copy", start, copy_done))
            start = copy_done
            dn = self._link("download", part, self._rate(self.region_path, regions), self.l_region,
                            limit=self.region_get_limit)
        else:
            dn = self._link("download", part, self._rate(self.direct_path, regions), self.l_direct,
                            limit=self.origin_get_limit)
        total = start + pipeline(parts, [dn])
        segs.append(Segment("receiver", "download", start, total))
        return Timeline("full", False, total, segs, self._bytes(raw, tree), {"upload": up.per_item, "download": dn.per_item})


def simulate(sc: Scenario) -> list[Timeline]:
    """Every (mode, streaming) the scenario asks for; ``full`` once (it has no streaming variant)."""
    m = Model(sc)
    out = []
    for mode in sc.run.modes:
        for streaming in ([False] if mode == "full" else sc.run.streaming):
            out.append(m.run(mode, streaming))
    return out
