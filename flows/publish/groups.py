"""Groups of tensors: the units a publish's encoding is mapped over when it runs on several workers.

A group is a run of consecutive tensor names (in name order). By default there is one group per
worker thread, of near-equal raw bytes, and more only where each still holds a GiB
(``dcr_core.batches.batch_count``): every group is a Prefect task run, whose API calls cost a
worker about 0.1-0.3 s, so fewer, larger groups keep that cost out of the encoding; with
``options.group_bytes``, runs of about that many bytes (a tensor larger is a group of its own). It carries only names and the
array each tensor is stored under, so it travels to a worker as a few hundred bytes, and the
worker reads the tensors and their baseline where it runs (``flows.publish.encode.encode_group``).

Array names are fixed here, for the whole step, before the split: an array's name depends on the
names before it (two tensor names that escape alike get distinct arrays), so naming per group
would make the stored keys depend on the grouping. With names fixed, what a group stores depends
only on its tensors' bits, their baseline and the plan: the stored objects, the manifest and the
policy digest are the same whatever runs the groups and however many there are.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from importlib import metadata

from dcr_core.batches import batches_for
from flows.publish.plan import PublishPlan
from flows.steps import ResultCache
from storage import layout

RESULTS = "group-results"  # under the publisher's cache directory: <step>-<attempt>/<key>
RESULT_SECONDS = 24 * 3600.0  # a rerun within a day uses a finished group's result; older ones are swept


@dataclass(frozen=True)
class TensorGroup:
    """Tensors ``names`` (in name order) stored under ``arrays``: group ``index`` of ``count``."""

    index: int
    count: int
    names: tuple[str, ...]
    arrays: tuple[str, ...]
    nbytes: int


def unique_array(array: str, used: set[str]) -> str:
    """``array``, or ``array`` with underscores appended until no earlier array has its name."""
    while array in used:  # two names escaping alike: keep arrays distinct
        array += "_"
    used.add(array)
    return array


def array_names(names) -> dict[str, str]:
    """The array of every tensor name, assigned in name order (see module doc)."""
    used: set[str] = set()
    return {n: unique_array(layout.array_segment(n), used) for n in sorted(names)}


def plan_groups(plan: PublishPlan, slots: int) -> list[TensorGroup]:
    """The plan's tensors as groups consecutive in name order: of about ``options.group_bytes``
    each, or by default ``dcr_core.batches.batch_count`` groups of near-equal bytes for ``slots``
    worker threads (see the module doc)."""
    names = sorted(plan.infos)
    arrays = array_names(names)
    runs = batches_for(((n, plan.infos[n].nbytes) for n in names), slots, plan.options.group_bytes)
    return [TensorGroup(i, len(runs), tuple(r), tuple(arrays[n] for n in r), sum(plan.infos[n].nbytes for n in r))
            for i, r in enumerate(runs)]


# -- a finished group's result, kept for a rerun of the same attempt ------------------------------

def result_key(params: dict) -> str:
    """A digest of everything an ``encode-group`` result depends on: the ROOT, the step, the
    attempt (a rerun of a failed flow run keeps its attempt: ``flows.orchestration.task_cache``), the base it
    is a delta of (pinned by manifest digest), the options, DCR's version, the group's tensors and
    arrays, and the source checkpoint as the file system describes it (path, size, modification
    and change times, inode of every file: a checkpoint rewritten since is another input)."""
    plan, group = params["plan"], params["group"]
    base = plan.base
    doc = {
        "dcr": metadata.version("dcr"), "root": plan.root.url, "step": plan.step, "attempt": plan.attempt,
        "kind": plan.kind, "base": None if base is None else [base.step, base.attempt, base.manifest_digest],
        "options": plan.options.model_dump(mode="json", exclude={"cache_dir", "io_workers"}),
        "tensors": [[n, plan.infos[n].dtype, list(plan.infos[n].shape)] for n in group.names],
        "arrays": list(group.arrays), "source": file_identity(params["source"]),
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def file_identity(path: str) -> list:
    """``[path, size, mtime_ns, ctime_ns, inode]`` of ``path``, of every file under it if it is a
    directory (a sharded checkpoint), in path order."""
    paths = [path] if not os.path.isdir(path) else sorted(
        os.path.join(d, f) for d, _, files in os.walk(path) for f in files)
    out = []
    for p in paths:
        st = os.stat(p)
        out.append([os.path.relpath(p, path) if p != path else p, st.st_size, st.st_mtime_ns, st.st_ctime_ns,
                    st.st_ino])
    return out


def results_dir(shared: dict) -> str:
    """Where the results of one attempt's groups are kept: ``<cache_dir>/group-results/<step>-<attempt>``
    (the publisher's cache directory, made absolute for workers: a LocalCluster's workers share it;
    a worker on another machine keeps its own, and a rerun there simply encodes the group again)."""
    plan = shared["plan"]
    return os.path.join(plan.options.cache_dir, RESULTS, f"{plan.step}-{plan.attempt}")


GROUP_CACHE = ResultCache(result_key, results_dir, RESULT_SECONDS)


def drop_results(plan: PublishPlan) -> None:
    """Once the step is committed, its groups' results are of no further use: removed, with those
    of attempts older than ``RESULT_SECONDS`` (a run that failed and was never run again)."""
    shutil.rmtree(results_dir({"plan": plan}), ignore_errors=True)
    where, now = os.path.join(plan.options.cache_dir, RESULTS), time.time()
    with contextlib.suppress(OSError):
        for name in os.listdir(where):
            path = os.path.join(where, name)
            with contextlib.suppress(OSError):
                if now - os.stat(path).st_mtime > RESULT_SECONDS:
                    shutil.rmtree(path, ignore_errors=True)


def stored_keys(entries, packed: bool) -> set[str]:
    """The keys (inside the step's store) of every object the entries name: each array's metadata
    (not in a ``packed`` store: ``storage.chunk_io.StepWriter``) and every stored chunk, pack and part."""
    keys: set[str] = set()
    for e in entries:
        if not packed:
            keys.add(layout.array_meta_key(e.array))
        keys.update(e.stored_at(pos)[0] for pos in range(len(e.stored_nbytes)))
    return keys
