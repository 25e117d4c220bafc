"""What inductor makes of a compiled graph's ops, as the planner models it: its fused kernels (memory-bound ops
grouped between anchors, `fused_kernels`), the bytes each moves (`fused_bytes`, for the time model), and the
intermediates that never leave a kernel (`fused_intermediates`, for the memory replay): a value that one fused
kernel writes and only that kernel reads lives in registers, never in an allocation of its own. The probe runs
compiled graphs op by op (aot_eager_decomp_partition: inductor's decompositions and partitioner, no code
generation), which allocates every such value; a GPU running inductor's kernels does not."""

from __future__ import annotations

from .trace import ATTENTION, FALLBACK, GEMM, GRAPH_OUTPUTS, VIEW, Op, Run


def fusable(op: Op) -> bool:
    """Whether inductor may fuse the op with its neighbours: a memory-bound op (not an anchor: GEMM, attention, a
    collective or a fallback; not a view, which moves nothing)."""
    return op.kind not in (GEMM, ATTENTION, VIEW, FALLBACK) and op.collective is None


def free_view(op: Op) -> bool:
    """A view, which is no kernel and moves nothing; a collective's wait is recorded as a view of its buffer and
    is not one."""
    return op.kind == VIEW and op.collective is None


def fused_kernels(graph: list[Op]) -> list[list[Op]]:
    """The kernels inductor makes of one compiled graph call's ops, in order of their first op: each anchor
    (GEMM, attention, collective, fallback) its own; memory-bound ops joined with their producers and consumers
    among the memory-bound ops, across anchors that do not depend on them (inductor schedules by dependency, not
    by program order), unless that would make a kernel both feed and wait for one anchor. Views are free."""
    producer: dict[int, int] = {}  # allocation -> index of the op that wrote it
    parent = list(range(len(graph)))
    anchors_up = [set() for _ in graph]  # anchors each op depends on, transitively
    anchors_down = [set() for _ in graph]  # of a group's root: anchors that depend on the group

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    fused = [fusable(op) for op in graph]
    for i, op in enumerate(graph):
        sources = {producer[key] for key, _ in op.reads if key in producer}
        for j in sources:
            anchors_up[i] |= anchors_up[j] | ({j} if not fused[j] and graph[j].kind != VIEW else set())
        if not fused[i]:
            if op.kind != VIEW:  # an anchor: every group it reads from feeds it
                for j in sources:
                    if fused[j]:
                        anchors_down[root(j)].add(i)
        else:
            for j in sorted(sources):
                if fused[j]:
                    a, b = root(j), root(i)
                    if a != b and not (anchors_down[a] & (anchors_up[i] | anchors_up[b])):
                        parent[b] = a
                        anchors_down[a] |= anchors_down[b]
                        anchors_up[a] |= anchors_up[b]
            anchors_up[root(i)] |= anchors_up[i]
        for key, _ in op.writes:  # views write nothing: their outputs are their inputs' allocations
            producer[key] = i
    groups: dict[int, list[Op]] = {}
    for i, op in enumerate(graph):
        if free_view(op):
            continue
        groups.setdefault(root(i) if fused[i] else -1 - i, []).append(op)
    return sorted(groups.values(), key=lambda ops: graph.index(ops[0]))


def fused_bytes(group: list[Op], graph: list[Op]) -> int:
    """Bytes a fused kernel moves: what it reads that it did not write, and what it writes that another op of
    its graph reads (or the graph returns)."""
    members = {id(op) for op in group}
    written = {key for op in group for key, _ in op.writes}
    reads: dict[int, int] = {}
    for op in group:
        for key, nbytes in op.reads:
            if key not in written:
                reads[key] = max(reads.get(key, 0), nbytes)
    read_outside = {key for op in graph if id(op) not in members for key, _ in op.reads}
    outputs: dict[int, int] = {}
    for op in group:
        for key, nbytes in op.writes:
            if key in read_outside:
                outputs[key] = max(outputs.get(key, 0), nbytes)
    return sum(reads.values()) + sum(outputs.values())


def fused_intermediates(run: Run) -> set[int]:
    """The allocations of a recorded micro-batch that inductor's kernels would not make: written by a fused kernel
    of a compiled graph call (more than anchors and views) and read by no op outside that kernel, the graph's
    outputs included (a view reads nothing; what reads the view reads the allocation)."""
    ops = [op for segment in run.segments.values() for op in segment.ops]
    readers: dict[int, set[int]] = {}
    for i, op in enumerate(ops):
        if free_view(op) and op.name != GRAPH_OUTPUTS:
            continue
        for key, _ in op.reads:
            readers.setdefault(key, set()).add(i)
    index = {id(op): i for i, op in enumerate(ops)}
    regions: dict[int, list[Op]] = {}
    for op in ops:
        if op.region is not None:
            regions.setdefault(op.region, []).append(op)
    internal = set()
    for graph in regions.values():
        for kernel in fused_kernels(graph):
            if not fusable(kernel[0]):  # an anchor's kernel: its outputs are written to memory
                continue
            members = {index[id(op)] for op in kernel}
            internal |= {key for op in kernel for key, _ in op.writes if readers.get(key, set()) <= members}
    return internal
